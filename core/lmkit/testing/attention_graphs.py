"""The attention suite's CUDA-graph properties (``cuda graphs``, ``in-place decode
metadata``): ``run`` captured once in a graph, replayed for later decode steps."""

from __future__ import annotations

from typing import Any

import torch

from lmkit.testing.attention_world import AttentionCase, AttentionWorld
from lmkit.testing.failure import Target

SUITE = "attention"


def replay_decode_steps(t: Target, prop: str, backend: Any, case: AttentionCase,
                        num_blocks: int, plan: bool = True) -> None:
    """Capture ``backend.run`` for a decode step of four requests in a CUDA graph, then
    replay it for three later decode steps (each planned with ``cuda_graph = True``,
    or, with ``plan=False``, only its metadata's device buffers rewritten) and compare
    each with the oracle; a mismatch or a capture that raises fails property ``prop``."""
    world = AttentionWorld(backend, case, num_blocks)
    world.step([(0, 9), (1, 17), (2, 4), (3, 30)])
    work = [(0, 1), (1, 1), (2, 1), (3, 1)]
    contexts = {rid: world.context_len(rid) for rid, _ in work}
    backend.plan(world.metadata(work, contexts, cuda_graph=True))
    q = torch.zeros(len(work), case.num_heads, case.head_size, dtype=case.dtype,
                    device=case.device)
    k = torch.zeros(len(work), case.num_kv_heads, case.head_size, dtype=case.dtype,
                    device=case.device)
    v = torch.zeros_like(k)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            backend.run(0, q, k, v, world.cache)  # warm-up (compiles kernels)
            with torch.cuda.graph(graph, stream=stream):
                out = backend.run(0, q, k, v, world.cache)
    except Exception as e:
        raise t.fail(SUITE, prop, case.describe(),
                     f"capturing run() in a CUDA graph raised {type(e).__name__}: {e}") from e
    torch.cuda.current_stream().wait_stream(stream)

    def replay(q_new: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               kv_cache: torch.Tensor) -> torch.Tensor:
        q.copy_(q_new)
        k.copy_(k_new)
        v.copy_(v_new)
        graph.replay()
        return out.clone()

    for i in range(3):
        bad = world.step(work, run=replay, cuda_graph=True, plan=plan)
        if bad is not None:
            raise t.fail(SUITE, prop, f"{case.describe()}; replayed decode step {i + 1}",
                         f"request {bad.rid} (context {bad.context}): {bad.detail}")
