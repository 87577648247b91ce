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
    ``ModelRunnerOutput.finished_kv_loads`` with its success. A ``same_step`` load is
    read by this step's forward (its request was admitted in the step): the runner
    starts it with ``OffloadManager.load_now`` and reports it in this step's output,
    failed when the tier no longer had the blocks (the scheduler then throws away what
    the step computed for the request).
    """

    transfer_id: int
    block_hashes: list[bytes]
    block_ids: list[int]
    same_step: bool = False


@dataclass(slots=True)
class KVTransfers:
    """One step's transfers, run by the runner (1 and 2 before the forward) in this order:

    1. ``store_hashes`` / ``store_block_ids``: blocks the device prefix cache evicted
       while this step was planned. Their device blocks are handed out again in this
       same step, so they are copied out first.
    2. ``loads``: tier hits into device blocks the scheduler holds for them. A load of
       a request still waiting is touched by no forward until it is reported
       finished; a ``same_step`` load is read by this step's forward, which runs after
       the copy.
    3. ``write_hashes`` / ``write_block_ids`` (write-through): blocks registered in
       the prefix cache this step, whose KV this step's forward computes; stored right
       after the forward is issued (``OffloadManager.store_computed``), so that their
       eviction later costs no copy. Skipped when a same-step load of the step failed.

    ``fence``: the prefix cache was reset, so blocks written through may be reused
    without an eviction: the tier orders this step after their reads first.
    """

    store_hashes: list[bytes] = field(default_factory=list)
    store_block_ids: list[int] = field(default_factory=list)
    loads: list[LoadRequest] = field(default_factory=list)
    write_hashes: list[bytes] = field(default_factory=list)
    write_block_ids: list[int] = field(default_factory=list)
    fence: bool = False

    def __bool__(self) -> bool:
        return bool(self.store_hashes or self.loads or self.write_hashes or self.fence)
