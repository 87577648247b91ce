"""The wire form of one step for workers in other processes: :class:`SchedulerOutput` in,
:class:`ModelRunnerOutput` out, as msgpack through explicit msgspec structs (no pickle).

Every field is spelled out: a new field of either dataclass must be added here too
(``tests/unit/test_step_codec.py`` fails until it is). Tensors (the grammar bitmask,
draft distributions) travel as dtype name, shape and raw bytes, and come back as CPU
tensors; the runner moves them where it needs them, as it does in-process.
"""

from __future__ import annotations

from typing import Any

import msgspec

from lmkit.api.outputs import TokenLogprob
from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.api.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from lmkit.offload.transfers import KVTransfers


class TensorWire(msgspec.Struct, array_like=True, frozen=True):
    """A CPU tensor or numpy array as ``torch`` dtype name, shape and raw bytes."""

    dtype: str
    shape: list[int]
    data: bytes
    numpy: bool = False


def tensor_to_wire(value: Any) -> TensorWire:
    """Any torch tensor or numpy array -> :class:`TensorWire` (copied to the host)."""
    import torch

    is_numpy = not isinstance(value, torch.Tensor)
    t = torch.from_numpy(value) if is_numpy else value.detach().cpu()
    t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return TensorWire(str(t.dtype).removeprefix("torch."), list(t.shape),
                      raw.numpy().tobytes(), is_numpy)


def tensor_from_wire(wire: TensorWire) -> Any:
    """:class:`TensorWire` -> a CPU torch tensor (or the numpy array it was)."""
    import torch

    dtype = getattr(torch, wire.dtype)
    if wire.data:
        t = torch.frombuffer(bytearray(wire.data), dtype=torch.uint8).view(dtype)
    else:
        t = torch.empty(0, dtype=dtype)
    t = t.reshape(wire.shape)
    return t.numpy() if wire.numpy else t


class SchedulerOutputWire(msgspec.Struct, array_like=True, frozen=True):
    """:class:`SchedulerOutput`, field by field."""

    scheduled_new_reqs: list[NewRequestData]
    cached_req_ids: list[str]
    cached_new_block_ids: list[list[int]]
    cached_num_computed_tokens: list[int]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    spec_draft_probs: dict[str, TensorWire]
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    structured_output_request_ids: dict[str, int]
    grammar_bitmask: TensorWire | None
    kv_transfers: KVTransfers | None
    spec_drafting: bool = True


def scheduler_output_to_wire(so: SchedulerOutput) -> SchedulerOutputWire:
    """The wire form of one step's plan."""
    cached = so.scheduled_cached_reqs
    return SchedulerOutputWire(
        scheduled_new_reqs=list(so.scheduled_new_reqs),
        cached_req_ids=list(cached.req_ids),
        cached_new_block_ids=[list(b) for b in cached.new_block_ids],
        cached_num_computed_tokens=list(cached.num_computed_tokens),
        num_scheduled_tokens=dict(so.num_scheduled_tokens),
        total_num_scheduled_tokens=so.total_num_scheduled_tokens,
        scheduled_spec_decode_tokens=dict(so.scheduled_spec_decode_tokens),
        spec_draft_probs={k: tensor_to_wire(v) for k, v in so.spec_draft_probs.items()},
        finished_req_ids=sorted(so.finished_req_ids),
        preempted_req_ids=sorted(so.preempted_req_ids),
        structured_output_request_ids=dict(so.structured_output_request_ids),
        grammar_bitmask=(None if so.grammar_bitmask is None
                         else tensor_to_wire(so.grammar_bitmask)),
        kv_transfers=so.kv_transfers,
        spec_drafting=so.spec_drafting,
    )


def scheduler_output_from_wire(w: SchedulerOutputWire) -> SchedulerOutput:
    """Rebuild the :class:`SchedulerOutput` a runner executes."""
    return SchedulerOutput(
        scheduled_new_reqs=w.scheduled_new_reqs,
        scheduled_cached_reqs=CachedRequestData(w.cached_req_ids, w.cached_new_block_ids,
                                                w.cached_num_computed_tokens),
        num_scheduled_tokens=w.num_scheduled_tokens,
        total_num_scheduled_tokens=w.total_num_scheduled_tokens,
        scheduled_spec_decode_tokens=w.scheduled_spec_decode_tokens,
        spec_draft_probs={k: tensor_from_wire(v) for k, v in w.spec_draft_probs.items()},
        finished_req_ids=set(w.finished_req_ids),
        preempted_req_ids=set(w.preempted_req_ids),
        structured_output_request_ids=w.structured_output_request_ids,
        grammar_bitmask=None if w.grammar_bitmask is None else tensor_from_wire(w.grammar_bitmask),
        kv_transfers=w.kv_transfers,
        spec_drafting=w.spec_drafting,
    )


class RunnerOutputWire(msgspec.Struct, array_like=True, frozen=True):
    """:class:`ModelRunnerOutput`, field by field."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob]] | None
    prompt_logprobs: dict[str, list[TokenLogprob | None]]
    num_draft_tokens: dict[str, int]
    num_accepted_tokens: dict[str, int]
    finished_kv_loads: dict[int, bool]
    pooled: dict[str, Any] | None = None
    draft_token_ids: dict[str, list[int]] = {}
    no_allowed_token: dict[str, int] = {}


def runner_output_to_wire(out: ModelRunnerOutput) -> RunnerOutputWire:
    """The wire form of one step's result."""
    return RunnerOutputWire(list(out.req_ids), [list(t) for t in out.sampled_token_ids],
                            out.logprobs, out.prompt_logprobs, out.num_draft_tokens,
                            out.num_accepted_tokens, out.finished_kv_loads, out.pooled,
                            out.draft_token_ids, out.no_allowed_token)


def runner_output_from_wire(w: RunnerOutputWire) -> ModelRunnerOutput:
    """Rebuild the :class:`ModelRunnerOutput` the scheduler consumes."""
    return ModelRunnerOutput(
        req_ids=w.req_ids, sampled_token_ids=w.sampled_token_ids, logprobs=w.logprobs,
        prompt_logprobs=w.prompt_logprobs, num_draft_tokens=w.num_draft_tokens,
        num_accepted_tokens=w.num_accepted_tokens, finished_kv_loads=w.finished_kv_loads,
        pooled=w.pooled, draft_token_ids=w.draft_token_ids, no_allowed_token=w.no_allowed_token)
