"""What the scheduler asks the model runner to move between the device KV cache and the
offload tier in one step (``SchedulerOutput.kv_transfers``).

Plain lists of bytes and ints, so the plan can cross a process boundary as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class LoadRequest:
    """Copy the tier's blocks ``block_hashes`` into device blocks ``block_ids``.

    ``transfer_id`` is the scheduler's name for the load; the runner reports it back in
    ``ModelRunnerOutput.finished_kv_loads`` with its success.
    """

    transfer_id: int
    block_hashes: list[bytes]
    block_ids: list[int]


@dataclass(slots=True)
class KVTransfers:
    """One step's transfers, run by the runner before the forward in this order:

    1. ``store_hashes`` / ``store_block_ids``: blocks the device prefix cache evicted
       while this step was planned. Their device blocks are handed out again in this
       same step, so they are copied out first.
    2. ``loads``: tier hits of requests waiting for admission, into device blocks the
       scheduler holds for them (no forward touches those blocks until the load is
       reported finished).
    """

    store_hashes: list[bytes] = field(default_factory=list)
    store_block_ids: list[int] = field(default_factory=list)
    loads: list[LoadRequest] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.store_hashes or self.loads)
