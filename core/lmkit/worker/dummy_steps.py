"""Steps over made-up tokens on a scratch KV cache, outside serving: the largest step
(to measure peak memory before the KV cache is sized) and the step shapes serving will
meet (to compile JIT kernel variants at startup)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmkit.api.sampling_params import SamplingParams
from lmkit.worker import memory
from lmkit.worker.input_batch import CachedRequestState, InputBatch, StepInputs

if TYPE_CHECKING:
    from lmkit.api.kv_cache_spec import KVCacheGroup
    from lmkit.config.schema import SchedulerConfig


@dataclass(frozen=True)
class DummyStepModel:
    """What a dummy step needs of the model runner.

    Attributes:
        scheduler: the step limits (``max_num_batched_tokens``, ``max_num_seqs``).
        max_model_len: the longest sequence.
        block_size: tokens per KV block.
        device: where the scratch KV cache is allocated.
        kv_groups: the model's KV cache groups (the scratch cache's layers and layouts).
        forward: ``forward(step, kv_caches) -> hidden [num_tokens, hidden]`` (the
            runner's eager forward: plan attention once, run the model).
        compute_logits: the model's LM head, ``hidden [n, hidden] -> [n, vocab]``.
    """

    scheduler: SchedulerConfig
    max_model_len: int
    block_size: int
    device: torch.device
    kv_groups: tuple[KVCacheGroup, ...]
    forward: Callable[[StepInputs, list[torch.Tensor]], torch.Tensor]
    compute_logits: Callable[[torch.Tensor], torch.Tensor]


def profile_run(runner: DummyStepModel) -> None:
    """The largest step the scheduler can produce, on a scratch KV cache."""
    sched = runner.scheduler
    num_tokens = sched.max_num_batched_tokens
    num_reqs = max(1, min(sched.max_num_seqs, num_tokens))
    q_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
    q_lens[: num_tokens % num_reqs] += 1
    dummy_step(runner, q_lens, np.zeros(num_reqs, dtype=np.int64))


def warm_up_step_shapes(runner: DummyStepModel) -> None:
    """Run the step shapes serving meets before serving does, so that JIT kernels
    (Triton, FlashInfer) compile their variants here and not in the middle of a
    busy step: decodes mixed with a short and a long prefill over a cached prefix,
    decodes with one short prefill, eager decodes, and one request alone. Decode graphs
    end before the LM head, which runs eagerly on each step's rows: its one-row call
    is a variant of its own (Triton specialises an argument equal to 1), met in W1 only
    when the last request decodes alone, where compiling it cost 0.43 s on an H200."""
    sched = runner.scheduler
    budget, max_len = sched.max_num_batched_tokens, runner.max_model_len
    long = max(1, min(200, budget - 8, max_len - 40))
    shapes = [([1, 1, 1, 5, long], [33, 17, 40, 0, min(16, max_len - long)]),
              ([1, 7], [20, 0]), ([1, 1, 1], [9, 30, 64]), ([1], [12])]
    for q_lens, contexts in shapes:
        q, c = np.array(q_lens, dtype=np.int64), np.array(contexts, dtype=np.int64)
        keep = min(len(q), sched.max_num_seqs)
        q, c = q[:keep], np.clip(c[:keep], 0, np.maximum(0, max_len - q[:keep]))
        if q.sum() <= budget:
            dummy_step(runner, q, c)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def dummy_step(runner: DummyStepModel, q_lens: np.ndarray, contexts: np.ndarray,
               token_ids: list[int] | None = None) -> None:
    """One forward pass (and LM head) over made-up tokens on a scratch KV cache:
    request ``i`` runs ``q_lens[i]`` tokens after ``contexts[i]`` cached ones; the
    leading one-token requests are the step's decodes. The tokens are 0s, or
    ``token_ids`` (one request's, as many as it runs)."""
    num_reqs, lens = len(q_lens), q_lens + contexts
    blocks_per_req = -(-int(lens.max()) // runner.block_size)
    caches = memory.allocate_kv_caches(runner.kv_groups, num_reqs * blocks_per_req,
                                       runner.device)
    batch = InputBatch(num_reqs, int(lens.max()), runner.block_size, int(q_lens.sum()))
    for i, (n, c) in enumerate(zip(lens, contexts, strict=True)):
        ids = token_ids if token_ids is not None else [0] * int(n)
        state = CachedRequestState(f"dummy-{i}", ids, [], SamplingParams(), None, None, int(c))
        batch.add_request(state, list(range(i * blocks_per_req, (i + 1) * blocks_per_req)))
    not_decode = np.flatnonzero(q_lens != 1)
    num_decodes = int(not_decode[0]) if len(not_decode) else num_reqs
    step = batch.prepare(np.arange(num_reqs), q_lens, num_decodes)
    with torch.inference_mode():
        hidden = runner.forward(step, caches)
        runner.compute_logits(hidden[np.cumsum(q_lens) - 1]).argmax(dim=-1)
    del caches, hidden
