"""The engine's logits processors: instances, request slots and batch updates.

:class:`LogitsProcessorSet` is owned by the model runner. It builds each processor
(:class:`~lmkit.api.logits_processor.LogitsProcessor`) once, from the registry, the
first time a request selects it (the ones the config enables for every request at
start-up), gives every request that uses a processor a slot, queues the additions and
removals as :class:`~lmkit.api.logits_processor.BatchUpdate` per processor, and hands
them over before the next step samples. Per step it builds the ``[num_rows]`` slot
tensor once; the sampler then calls each processor in use on the whole batch.

:func:`check_request` runs in the engine core when a request arrives: each processor
it names checks its ``extra_args`` there, so a bad argument refuses that request alone.
This module imports torch only when a step uses processors (the engine core imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmkit.api.logits_processor import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
)

if TYPE_CHECKING:
    import torch

KIND = "logits_processor"


def check_request(registry: Any, params: Any, enabled: Sequence[str], vocab_size: int
                  ) -> None:
    """Let every processor that applies to a request check its arguments
    (:meth:`LogitsProcessor.validate_params`); raises
    :class:`~lmkit.errors.InvalidRequestError` (or UnknownBackendError for an unknown
    name). Loads the processors' classes, not instances. O(1) without processors."""
    names = (*enabled, *(params.logits_processors or ()))
    for name in dict.fromkeys(names):
        registry.get(KIND, name).spec.load().validate_params(params, vocab_size)


@dataclass
class _Pending:
    """Batch changes of one processor not yet handed to it."""

    removed: list[int] = field(default_factory=list)
    added: dict[str, AddedRequest] = field(default_factory=dict)  # req id -> addition


class LogitsProcessorSet:
    """The logits processors of one engine (see the module docstring).

    Args:
        load: ``name -> processor instance``, building it (raises
            :class:`~lmkit.errors.UnknownBackendError` for an unknown name); ``None``
            for a set with no processors (before the model is loaded).
        enabled: names applied to every request (config ``logits_processors.enable``).
        max_num_slots: the most requests the runner holds at once.
    """

    def __init__(self, load: Callable[[str], LogitsProcessor] | None = None,
                 enabled: Sequence[str] = (),
                 max_num_slots: int = 0) -> None:
        self._load = load
        self.enabled = tuple(dict.fromkeys(enabled))
        self._instances: dict[str, LogitsProcessor] = {}
        self._users: dict[str, int] = {}  # name -> requests using it now
        self._pending: dict[str, _Pending] = {}
        self._slot_of: dict[str, tuple[int, tuple[str, ...]]] = {}  # req id -> slot, names
        # the last slot is never given out: rows of requests without processors use it
        self._none_slot = max_num_slots
        self._free = list(range(max_num_slots - 1, -1, -1))
        for name in self.enabled:
            self._instance(name)

    @classmethod
    def from_registry(cls, registry: Any, enabled: Sequence[str],
                      options: Mapping[str, Mapping[str, Any]], vocab_size: int,
                      max_num_slots: int, device: torch.device) -> LogitsProcessorSet:
        """Processors from the plugin registry, built with ``options[name]`` (validated
        against the spec's options model) and a :class:`LogitsProcessorContext`."""
        ctx = LogitsProcessorContext(vocab_size=vocab_size, max_num_slots=max_num_slots + 1,
                                     device=device)

        def load(name: str) -> LogitsProcessor:
            spec = registry.get(KIND, name).spec
            return spec.load()(ctx, spec.validate_options(options.get(name)))

        return cls(load, enabled, max_num_slots)

    @property
    def affects_greedy(self) -> bool:
        """Whether a processor applied to every request can change the argmax."""
        return any(not self._instances[n].is_argmax_invariant for n in self.enabled)

    @property
    def in_use(self) -> bool:
        """Whether any request in the batch uses a processor."""
        return bool(self._slot_of)

    def _instance(self, name: str) -> LogitsProcessor:
        proc = self._instances.get(name)
        if proc is None:
            if self._load is None:
                raise RuntimeError(f"logits processor {name!r} asked for before the model "
                                   "runner built its processors (load_model)")
            proc = self._instances[name] = self._load(name)
            self._users[name] = 0
            self._pending[name] = _Pending()
        return proc

    def add(self, req_id: str, params: Any, prompt_token_ids: Sequence[int],
            output_token_ids: Sequence[int]) -> None:
        """A request joins the batch (O(1) when it uses no processor)."""
        names = self.enabled + tuple(n for n in params.logits_processors or ()
                                     if n not in self.enabled)
        if not names:
            return
        if not self._free:
            raise RuntimeError(f"logits processors: no free slot for request {req_id!r} "
                               f"({self._none_slot} slots, one per running request)")
        slot = self._free.pop()
        self._slot_of[req_id] = (slot, names)
        for name in names:
            self._instance(name)
            self._users[name] += 1
            self._pending[name].added[req_id] = AddedRequest(
                slot, req_id, params, prompt_token_ids, output_token_ids)

    def remove(self, req_id: str) -> None:
        """A request leaves the batch (finished, aborted or preempted)."""
        entry = self._slot_of.pop(req_id, None)
        if entry is None:
            return
        slot, names = entry
        for name in names:
            self._users[name] -= 1
            pending = self._pending[name]
            if pending.added.pop(req_id, None) is None:  # the processor has seen it
                pending.removed.append(slot)
        self._free.append(slot)

    def for_step(self, row_req_ids: Sequence[str], device: torch.device
                 ) -> tuple[list[LogitsProcessor], torch.Tensor]:
        """The processors in use and the ``[num_rows]`` slot of each row's request
        (call it when :attr:`in_use`). Hands each processor its pending batch update."""
        active = []
        for name, proc in self._instances.items():
            pending = self._pending[name]
            if pending.removed or pending.added:
                self._pending[name] = _Pending()
                proc.update_state(BatchUpdate(tuple(pending.removed),
                                              tuple(pending.added.values())))
            if self._users[name]:
                active.append(proc)
        import torch

        none = self._none_slot
        slots = [self._slot_of[rid][0] if rid in self._slot_of else none
                 for rid in row_req_ids]
        return active, torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True)
