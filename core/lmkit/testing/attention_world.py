"""A paged KV cache driven step by step, with dense causal attention as the oracle.

:class:`AttentionWorld` builds each step's :class:`~lmkit.api.AttentionMetadata` the
way the model runner does (decode requests first, block tables wider than needed,
block ids scattered over the pool, block 0 never used), runs the backend under test,
and compares every request's output with dense causal attention computed in float64
over the full key/value history the world remembers. Requests can share cached
prefix blocks (:meth:`AttentionWorld.fork`), as prefix-cache hits do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmkit.api.attention import FP8_KV_MAX, AttentionBackend, AttentionMetadata
from lmkit.testing.failure import NotApplicable

# (atol, rtol) against the float64 oracle, per dtype of the backend's inputs
TOLERANCES = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float64: (1e-9, 1e-9),
}
EXTRA_TABLE_WIDTH = 3  # block-table columns past the longest request (as the runner pads)
MAX_REQS, MAX_TOKENS = 32, 2048  # sizes of the persistent metadata buffers


@dataclass
class AttentionCase:
    """One backend configuration the suite instantiates."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    #: an FP8 cache (``torch.float8_e4m3fn``) and the ``(k_scale, v_scale)`` set on the
    #: built backend; ``None``: the cache stores ``dtype``
    kv_cache_dtype: torch.dtype | None = None
    kv_scales: tuple[float, float] = (1.0, 1.0)

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        window = f", sliding_window {self.sliding_window}" if self.sliding_window else ""
        cap = f", logits_soft_cap {self.logits_soft_cap}" if self.logits_soft_cap else ""
        kv = (f", {str(self.kv_cache_dtype).removeprefix('torch.')} cache with scales "
              f"{self.kv_scales}" if self.kv_cache_dtype is not None else "")
        return (f"heads {self.num_heads}/{self.num_kv_heads} (query/kv), head_size "
                f"{self.head_size}, block_size {self.block_size}, {dtype} on "
                f"{self.device.type}{window}{cap}{kv}")

    def kwargs(self, options: Any) -> dict[str, Any]:
        """The keyword arguments a model constructs the backend with for this case
        (``logits_soft_cap`` and ``kv_cache_dtype`` only when set, as models pass
        them)."""
        cap = {} if self.logits_soft_cap is None else {"logits_soft_cap": self.logits_soft_cap}
        if self.kv_cache_dtype is not None:
            cap["kv_cache_dtype"] = self.kv_cache_dtype
        return dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    head_size=self.head_size, scale=self.head_size ** -0.5, dtype=self.dtype,
                    device=self.device, block_size=self.block_size,
                    sliding_window=self.sliding_window, options=options, **cap)

    def stored(self, x: torch.Tensor, which: int) -> torch.Tensor:
        """``x`` (float64 keys, ``which`` 0, or values, 1) as an FP8 cache gives them
        back: ``x * (1 / scale)`` in float32, saturated to +-448, rounded to e4m3, times
        the scale; ``x`` itself for a cache of the model's dtype."""
        if self.kv_cache_dtype is None:
            return x
        scale = self.kv_scales[which]
        q = (x.to(self.dtype).float() * (1.0 / scale)).clamp(-FP8_KV_MAX, FP8_KV_MAX)
        return q.to(self.kv_cache_dtype).to(torch.float64) * scale

    def build(self, cls: type, options: Any) -> AttentionBackend:
        """Construct the backend as the model does."""
        return cls(**self.kwargs(options))


@dataclass
class _Req:
    keys: torch.Tensor  # float64 [num_tokens, num_kv_heads, head_size] (CPU)
    values: torch.Tensor
    blocks: list[int] = field(default_factory=list)


@dataclass
class StepMismatch:
    """The first request of a step whose output is wrong."""

    rid: int
    context: int
    query_len: int
    detail: str


def tolerance_error(got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float,
                    context: int) -> str | None:
    """``None`` when ``got`` (``[q_len, heads, d]``, a request's step output) is within
    ``atol + rtol * |ref|`` of ``ref`` everywhere (NaN never is); else the largest error
    and the first query token and head past the tolerance, in words (token positions
    counted after ``context`` earlier entries)."""
    err = (got - ref).abs()
    bad = ~(err <= atol + rtol * ref.abs())  # NaN counts as bad
    if not bool(bad.any()):
        return None
    tok, head, _ = (int(i) for i in bad.nonzero()[0])
    return (f"max abs error {float(err.nan_to_num(math.inf).max()):.3g} > tolerance "
            f"{atol:g} + {rtol:g}*|ref|; first at query token {tok} (position "
            f"{context + tok}), head {head}")


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int,
                    scale: float, window: int | None, soft_cap: float | None = None
                    ) -> torch.Tensor:
    """Causal attention of ``q`` ``[q_len, H, D]`` at positions ``context + i`` over
    ``k``/``v`` ``[context + q_len, Hkv, D]`` (float64), scores soft-capped
    (``c * tanh(s / c)``) when ``soft_cap`` is given; returns ``[q_len, H, D]``."""
    q_pos = torch.arange(q.shape[0])[:, None] + context
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return masked_attention(q, k, v, allowed, scale, soft_cap)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     allowed: torch.Tensor, scale: float, soft_cap: float | None = None
                     ) -> torch.Tensor:
    """Attention of ``q`` ``[q_len, H, D]`` over ``k``/``v`` ``[keys, Hkv, D]`` where
    ``allowed`` (bool ``[q_len, keys]``) says which key each query sees; scores
    soft-capped (``c * tanh(s / c)``) when ``soft_cap`` is given."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~allowed[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class AttentionWorld:
    """Requests with KV history in a paged cache owned by one backend instance."""

    def __init__(self, backend: AttentionBackend, case: AttentionCase, num_blocks: int,
                 seed: int = 0) -> None:
        self.backend = backend
        self.case = case
        self.gen = torch.Generator().manual_seed(seed)
        shape = tuple(backend.kv_cache_shape(num_blocks))
        self.cache = torch.zeros(shape, dtype=case.kv_cache_dtype or case.dtype,
                                 device=case.device)
        if case.kv_cache_dtype is not None:  # the scales an FP8 cache is read with
            backend.k_scale, backend.v_scale = case.kv_scales
        # block 0 is the runner's null block: never handed out
        order = torch.randperm(num_blocks - 1, generator=self.gen) + 1
        self.free: list[int] = order.tolist()
        self.reqs: dict[int, _Req] = {}
        self.num_steps = 0
        # persistent device buffers, updated in place each step as the runner's are (a
        # backend may keep references to them, e.g. inside a captured CUDA graph)
        dev = case.device
        self._qsl = torch.zeros(MAX_REQS + 1, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(MAX_REQS, dtype=torch.int32, device=dev)
        self._tables = torch.zeros(MAX_REQS, num_blocks, dtype=torch.int32, device=dev)
        self._slots = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=dev)

    def _rand(self, *shape: int) -> torch.Tensor:
        """Random data as the backend's dtype sees it, returned in float64 (CPU)."""
        x = torch.randn(*shape, generator=self.gen, dtype=torch.float32)
        return x.to(self.case.dtype).to(torch.float64)

    def _ensure_blocks(self, req: _Req, length: int) -> None:
        need = -(-length // self.case.block_size)
        while len(req.blocks) < need:
            if not self.free:
                raise RuntimeError("conformance world ran out of KV blocks (a suite bug)")
            req.blocks.append(self.free.pop())

    def fork(self, rid: int, parent: int, num_tokens: int) -> None:
        """Start request ``rid`` whose first ``num_tokens`` (whole blocks) are a cached
        prefix shared with ``parent``'s blocks, as a prefix-cache hit is."""
        bs = self.case.block_size
        if num_tokens % bs:
            raise ValueError("a shared prefix covers whole blocks")
        p = self.reqs[parent]
        self.reqs[rid] = _Req(p.keys[:num_tokens].clone(), p.values[:num_tokens].clone(),
                              list(p.blocks[: num_tokens // bs]))

    def context_len(self, rid: int) -> int:
        """Tokens of ``rid`` already in the cache."""
        return self.reqs[rid].keys.shape[0] if rid in self.reqs else 0

    def metadata(self, work: list[tuple[int, int]], contexts: dict[int, int],
                 cuda_graph: bool = False) -> AttentionMetadata:
        """The step's metadata for ``work`` (``(rid, query_len)`` in batch order), each
        request starting after ``contexts[rid]`` cached tokens. Device tensors are views
        of persistent buffers (the block table a strided view, as the runner's is);
        ``cuda_graph`` marks a step captured in or replayed from a CUDA graph."""
        bs = self.case.block_size
        q_lens = [q for _, q in work]
        ctx = [contexts[rid] for rid, _ in work]
        seq_lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
        width = min(max(len(self.reqs[rid].blocks) for rid, _ in work) + EXTRA_TABLE_WIDTH,
                    self._tables.shape[1])
        tables = torch.zeros(len(work), width, dtype=torch.int32)
        slots = []
        for i, (rid, q) in enumerate(work):
            blocks = self.reqs[rid].blocks
            tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            slots += [blocks[p // bs] * bs + p % bs for p in range(ctx[i], ctx[i] + q)]
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        num_decodes = 0
        while num_decodes < len(work) and q_lens[num_decodes] == 1:
            num_decodes += 1
        n, t = len(work), len(slots)
        if n > MAX_REQS or t > MAX_TOKENS:
            raise ValueError("conformance world: step too large (a suite bug)")
        self._qsl[: n + 1].copy_(qsl)
        self._seq_lens[:n].copy_(seq)
        self._tables[:n, :width].copy_(tables)
        self._slots[:t].copy_(torch.tensor(slots, dtype=torch.int64))
        return AttentionMetadata(
            num_reqs=n, num_actual_tokens=t, max_query_len=max(q_lens),
            max_seq_len=max(seq_lens), query_start_loc=self._qsl[: n + 1],
            seq_lens=self._seq_lens[:n], block_tables=self._tables[:n, :width],
            slot_mapping=self._slots[:t], query_start_loc_cpu=qsl, seq_lens_cpu=seq,
            num_decodes=num_decodes, cuda_graph=cuda_graph)

    def _write_kv_as_the_model(self, md: AttentionMetadata, k: torch.Tensor,
                               v: torch.Tensor) -> str | None:
        """Store ``k``/``v`` where :meth:`AttentionBackend.kv_write_slots` says, in the
        layout its docstring fixes; return what is wrong with the opt-in, if anything."""
        if not self.backend.supports_model_kv_write:
            raise NotApplicable("does not declare supports_model_kv_write")
        slots = self.backend.kv_write_slots()
        n, c = md.num_actual_tokens, self.case
        if slots.dtype != torch.int64 or slots.dim() != 1 or slots.shape[0] < n:
            return (f"kv_write_slots() returned {slots.dtype} {tuple(slots.shape)}; expected "
                    f"int64 [{n}] (the step's slot_mapping)")
        if not torch.equal(slots[:n].cpu(), md.slot_mapping[:n].cpu()):
            return "kv_write_slots() differs from the step's slot_mapping"
        expected = (2, self.cache.shape[1], c.block_size, c.num_kv_heads, c.head_size)
        if tuple(self.cache.shape) != expected:
            return (f"the backend opts in to model-written K/V but its cache is shaped "
                    f"{tuple(self.cache.shape)}, not [2, num_blocks, block_size, "
                    f"num_kv_heads, head_size] = {expected}")
        flat = self.cache.view(2, -1, c.num_kv_heads, c.head_size)
        flat[0].index_copy_(0, slots[:n], k[:n])
        flat[1].index_copy_(0, slots[:n], v[:n])
        return None

    def step(self, work: list[tuple[int, int]],
             forks: dict[int, tuple[int, int]] | None = None,
             run: Callable[..., torch.Tensor] | None = None,
             cuda_graph: bool = False, model_writes_kv: bool = False,
             plan: bool = True) -> StepMismatch | None:
        """Run one step and compare every request with the oracle.

        :param work: ``(rid, query_len)`` pairs; decodes are moved first, as the runner
            orders them.
        :param forks: ``{child: (parent, num_tokens)}``: ``child`` (in ``work``) starts
            this step on a shared prefix of ``parent``'s blocks that ``parent`` (also in
            ``work``) fills this very step.
        :param run: called as ``run(q, k, v, kv_cache)`` instead of ``backend.run(0, ...)``
            after ``plan`` (e.g. to replay a captured CUDA graph).
        :param cuda_graph: plan the step as one replayed from a CUDA graph.
        :param model_writes_kv: store K/V at the slots ``kv_write_slots()`` returns, as a
            model that fuses the cache write does, and call ``run(..., kv_written=True)``.
        :param plan: ``False`` skips ``plan``: only the persistent metadata buffers are
            rewritten (with ``run``: a graph replayed under the plan it was captured
            with).
        :return: the first mismatch, or None.
        """
        c = self.case
        forks = forks or {}
        work = [w for w in work if w[1] == 1] + [w for w in work if w[1] != 1]
        new_kv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        contexts: dict[int, int] = {}
        empty = torch.zeros(0, c.num_kv_heads, c.head_size, dtype=torch.float64)
        for rid, q_len in sorted(work, key=lambda w: w[0] in forks):
            if rid in forks:
                self.fork(rid, *forks[rid])
            req = self.reqs.setdefault(rid, _Req(empty, empty))
            contexts[rid] = req.keys.shape[0]
            q = self._rand(q_len, c.num_heads, c.head_size)
            k = self._rand(q_len, c.num_kv_heads, c.head_size)
            v = self._rand(q_len, c.num_kv_heads, c.head_size)
            new_kv[rid] = (q, k, v)
            self._ensure_blocks(req, contexts[rid] + q_len)
            req.keys = torch.cat([req.keys, c.stored(k, 0)])  # the oracle reads what the
            req.values = torch.cat([req.values, c.stored(v, 1)])  # cache holds
        md = self.metadata(work, contexts, cuda_graph)
        qs = [new_kv[rid][0] for rid, _ in work]
        ks = [new_kv[rid][1] for rid, _ in work]
        vs = [new_kv[rid][2] for rid, _ in work]

        def dev(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts).to(dtype=c.dtype, device=c.device)

        q, k, v = dev(qs), dev(ks), dev(vs)
        if plan:
            self.backend.plan(md)
        if run is not None:
            out = run(q, k, v, self.cache)
        elif model_writes_kv:
            problem = self._write_kv_as_the_model(md, k, v)
            if problem:
                return StepMismatch(work[0][0], contexts[work[0][0]], work[0][1], problem)
            out = self.backend.run(0, q, k, v, self.cache, kv_written=True)
        else:
            out = self.backend.run(0, q, k, v, self.cache)
        self.num_steps += 1
        if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
            return StepMismatch(work[0][0], contexts[work[0][0]], work[0][1],
                                f"run() returned {tuple(out.shape)} {out.dtype}; expected "
                                f"{tuple(q.shape)} {q.dtype} (the shape and dtype of q)")
        out64 = out.detach().to("cpu", torch.float64)
        atol, rtol = TOLERANCES.get(c.dtype, (1e-2, 1e-2))
        start = 0
        for (rid, q_len), qi in zip(work, qs, strict=True):
            req, ctx = self.reqs[rid], contexts[rid]
            ref = dense_attention(qi, req.keys, req.values, ctx, c.head_size ** -0.5,
                                  c.sliding_window, c.logits_soft_cap)
            got = out64[start:start + q_len]
            start += q_len
            error = tolerance_error(got, ref, atol, rtol, ctx)
            if error is not None:
                return StepMismatch(rid, ctx, q_len, (
                    f"output differs from causal attention over the request's "
                    f"{ctx + q_len} keys: {error}"))
        return None
