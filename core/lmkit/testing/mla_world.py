"""The MLA conformance suite's world: :class:`MLACase` (one backend configuration),
:class:`MLAWorld` (requests with latent history in ``NUM_LAYERS`` paged caches, each
step compared with the oracle) and :func:`dense_mla`, the float64 oracle.

:mod:`lmkit.testing.mla_attention` runs the properties on it (and re-exports these).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmkit.api.mla_attention import MLAAttentionBackend
from lmkit.testing.attention_world import (
    AttentionCase,
    AttentionWorld,
    StepMismatch,
    _Req,
    tolerance_error,
)

NUM_LAYERS = 2
# (atol, rtol) against the float64 oracle
TOLERANCES = {torch.float32: (3e-4, 3e-4), torch.float16: (6e-3, 6e-3),
              torch.bfloat16: (5e-2, 5e-2)}
# the softmax scale is not 1/sqrt(qk head dim) (YaRN's mscale changes it): a backend
# must use the scale it is given
SCALE_FACTOR = 0.8


@dataclass
class MLACase(AttentionCase):
    """One MLA backend configuration: ``num_kv_heads`` is 1 and ``head_size`` the latent
    width, as DeepSeek models construct it."""

    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32

    @classmethod
    def of(cls, heads: int, dims: tuple[int, int, int, int], block_size: int,
           dtype: torch.dtype, device: torch.device) -> MLACase:
        rank, nope, rope, v = dims
        return cls(heads, 1, rank + rope, block_size, dtype, device, kv_lora_rank=rank,
                   qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)

    @property
    def scale(self) -> float:
        return SCALE_FACTOR * (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"{self.num_heads} heads, kv_lora_rank {self.kv_lora_rank}, qk_nope "
                f"{self.qk_nope_head_dim}, qk_rope {self.qk_rope_head_dim}, v "
                f"{self.v_head_dim}, block_size {self.block_size}, {dtype} on "
                f"{self.device.type}")

    def kwargs(self, options: Any) -> dict[str, Any]:
        """The keyword arguments a DeepSeek model constructs the backend with."""
        return {**super().kwargs(options), "scale": self.scale,
                "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim}


def dense_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
              k_pe: torch.Tensor, w_kv_b: torch.Tensor, context: int, scale: float
              ) -> torch.Tensor:
    """Causal MLA of queries at positions ``context + i`` over ``context + q_len`` latent
    entries (float64): ``q_nope [q, H, nope]``, ``q_pe [q, H, rope]``, ``kv_c [k, rank]``,
    ``k_pe [k, rope]``, ``w_kv_b [H * (nope + v), rank]``; returns ``[q, H, v]``."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    kv = (kv_c @ w_kv_b.t()).view(kv_c.shape[0], heads, -1)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    scores = (torch.einsum("qhd,khd->hqk", q_nope, k_nope)
              + torch.einsum("qhr,kr->hqk", q_pe, k_pe)) * scale
    q_pos = torch.arange(q_nope.shape[0])[:, None] + context
    allowed = torch.arange(kv_c.shape[0])[None, :] <= q_pos
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khv->qhv", scores.softmax(-1), v)


class MLAWorld(AttentionWorld):
    """Requests with latent history in ``NUM_LAYERS`` paged caches of one backend.

    Each layer has its own cache, ``kv_b_proj`` weight, inputs and latent history
    (:attr:`latents`); the base world's requests keep the blocks and token counts."""

    case: MLACase

    def __init__(self, backend: MLAAttentionBackend, case: MLACase, num_blocks: int,
                 seed: int = 0) -> None:
        super().__init__(backend, case, num_blocks, seed)
        self.caches = [self.cache] + [torch.zeros_like(self.cache)
                                      for _ in range(NUM_LAYERS - 1)]
        per_head = case.qk_nope_head_dim + case.v_head_dim
        self.weights = [self._rand(case.num_heads * per_head, case.kv_lora_rank)
                        / math.sqrt(case.kv_lora_rank) for _ in range(NUM_LAYERS)]
        # per layer: rid -> (c_kv, k_pe) history (float64, CPU)
        self.latents: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(NUM_LAYERS)]

    def fork(self, rid: int, parent: int, num_tokens: int) -> None:
        super().fork(rid, parent, num_tokens)
        for hist in self.latents:
            c, p = hist[parent]
            hist[rid] = (c[:num_tokens].clone(), p[:num_tokens].clone())

    def step(self, work: list[tuple[int, int]],
             forks: dict[int, tuple[int, int]] | None = None,
             run: Callable[..., torch.Tensor] | None = None,
             cuda_graph: bool = False, model_writes_kv: bool = False
             ) -> StepMismatch | None:
        """Run one step of every layer and compare each request with the oracle;
        ``run(layer, q_nope, q_pe, kv_c, k_pe, kv_cache, w_kv_b)`` replaces
        ``backend.run_mla`` when given."""
        forks = forks or {}
        work = [w for w in work if w[1] == 1] + [w for w in work if w[1] != 1]
        contexts: dict[int, int] = {}
        empty = torch.zeros(0, 1, dtype=torch.float64)
        for rid, q_len in sorted(work, key=lambda w: w[0] in forks):
            if rid in forks:  # blocks now; the latent history once the parent's is written
                AttentionWorld.fork(self, rid, *forks[rid])
            req = self.reqs.setdefault(rid, _Req(empty, empty))
            contexts[rid] = self.context_len(rid)
            self._ensure_blocks(req, contexts[rid] + q_len)
            # the world counts a request's tokens by its keys' rows
            req.keys = torch.zeros(contexts[rid] + q_len, 1, dtype=torch.float64)
        md = self.metadata(work, contexts, cuda_graph)
        self.backend.plan(md)
        self.num_steps += 1
        for layer in range(NUM_LAYERS):
            bad = self._run_layer(layer, work, contexts, forks, run)
            if bad is not None:
                return bad
        return None

    def _run_layer(self, layer: int, work: list[tuple[int, int]], contexts: dict[int, int],
                   forks: dict[int, tuple[int, int]],
                   run: Callable[..., torch.Tensor] | None) -> StepMismatch | None:
        c = self.case
        hist = self.latents[layer]
        inputs = [(self._rand(q_len, c.num_heads, c.qk_nope_head_dim),
                   self._rand(q_len, c.num_heads, c.qk_rope_head_dim),
                   self._rand(q_len, c.kv_lora_rank), self._rand(q_len, c.qk_rope_head_dim))
                  for _, q_len in work]
        none = (torch.zeros(0, c.kv_lora_rank, dtype=torch.float64),
                torch.zeros(0, c.qk_rope_head_dim, dtype=torch.float64))
        # parents first: a forked request's prefix may be written by its parent this step
        for i in sorted(range(len(work)), key=lambda i: work[i][0] in forks):
            rid = work[i][0]
            if rid in forks:
                parent, num_tokens = forks[rid]
                hist[rid] = (hist[parent][0][:num_tokens], hist[parent][1][:num_tokens])
            old_c, old_p = hist.get(rid, none)
            hist[rid] = (torch.cat([old_c, inputs[i][2]]), torch.cat([old_p, inputs[i][3]]))

        def dev(i: int) -> torch.Tensor:
            return torch.cat([x[i] for x in inputs]).to(dtype=c.dtype, device=c.device)

        args = (dev(0), dev(1), dev(2), dev(3), self.caches[layer],
                self.weights[layer].to(dtype=c.dtype, device=c.device))
        if run is not None:
            out = run(layer, *args)
        else:
            out = self.backend.run_mla(layer, *args)  # type: ignore[attr-defined]
        n = args[0].shape[0]
        expected = (n, c.num_heads, c.v_head_dim)
        if tuple(out.shape) != expected or out.dtype != c.dtype:
            return StepMismatch(work[0][0], contexts[work[0][0]], work[0][1],
                                f"layer {layer}: run_mla() returned {tuple(out.shape)} "
                                f"{out.dtype}; expected {expected} {c.dtype}")
        out64 = out.detach().to("cpu", torch.float64)
        atol, rtol = TOLERANCES.get(c.dtype, (1e-2, 1e-2))
        start = 0
        for (rid, q_len), x in zip(work, inputs, strict=True):
            ctx = contexts[rid]
            ref = dense_mla(x[0], x[1], *hist[rid], self.weights[layer], ctx, c.scale)
            got = out64[start:start + q_len]
            start += q_len
            error = tolerance_error(got, ref, atol, rtol, ctx)
            if error is not None:
                return StepMismatch(rid, ctx, q_len, (
                    f"layer {layer}: output differs from dense causal MLA over the "
                    f"request's {ctx + q_len} latent entries: {error}"))
        return None
