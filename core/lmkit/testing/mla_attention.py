"""Conformance suite for MLA attention backends (:class:`lmkit.api.MLAAttentionBackend`).

Every output of :meth:`~lmkit.api.MLAAttentionBackend.run_mla` is compared with dense
multi-head latent attention computed in float64 over the request's whole latent
history: per head ``[k_nope | v] = c_kv @ w_kv_b.T``, scores ``scale * (q_nope . k_nope
+ q_pe . k_pe)``, causal. The backend fills its own latent cache (``[num_blocks,
block_size, kv_lora_rank + qk_rope_head_dim]``); steps are planned with metadata built
as the model runner builds it (:class:`~lmkit.testing.attention_world.AttentionWorld`:
decodes first, scattered blocks, wide block tables). Every step runs two layers, each
with its own cache and ``kv_b_proj`` weight (a backend caching per-layer weight
products must key them by layer). Properties:

* ``prefill``, ``decode`` (the absorbed path of most backends), ``mixed batch``;
* ``chunked prefill`` (chunks not block-aligned), when the spec claims it;
* ``prefill over a cached prefix`` and ``same-step prefix sharing``, when it claims
  ``prefix_caching``;
* ``multi-token queries`` (speculative decoding), when it claims ``multi_token_query``;
* ``shapes``: head counts (4, 16, and 128 -- V2/V3 on one GPU -- with the first claimed
  dimension set) and MLA dimensions, DeepSeek-V2/V3's (``kv_lora_rank`` 512,
  ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128) included,
  restricted to the claimed ``head_size`` (``kv_lora_rank + qk_rope_head_dim``) values;
* ``block sizes``, ``dtypes``: the whole workload per claimed block size and dtype;
* ``unclaimed features refused``: a sliding window or ``causal=False`` raises;
* ``cuda graphs``: when claimed and CUDA is present, ``run_mla`` captured in a graph
  and replayed after a new ``plan`` gives the oracle's result.

Use :func:`check_mla_attention_backend`, or subclass :class:`MLAAttentionConformance`
and define an ``attention_backend`` fixture returning the spec (or class) under test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch

from lmkit.api.mla_attention import MLAAttentionBackend
from lmkit.testing import attention as mha_suite
from lmkit.testing.attention import _device, _dtypes, _sizes
from lmkit.testing.attention_world import AttentionWorld
from lmkit.testing.failure import (
    CONSTRUCTOR_PROPERTY,
    NotApplicable,
    Target,
    resolve_target,
    run_checks,
    skip_if_not_applicable,
)
from lmkit.testing.mla_world import (
    NUM_LAYERS,
    SCALE_FACTOR,
    TOLERANCES,
    MLACase,
    MLAWorld,
    dense_mla,
)

__all__ = ["DEEPSEEK_DIMS", "HEAD_COUNTS", "NUM_BLOCKS", "NUM_LAYERS", "SCALE_FACTOR",
           "SMALL_DIMS", "TOLERANCES", "UNEVEN_DIMS", "WIDE_HEADS", "MLAAttentionConformance",
           "MLACase", "MLAWorld", "base_case", "check_cuda_graphs",
           "check_mla_attention_backend", "dense_mla"]

SUITE = "MLA attention"
KIND = "attention"
NUM_BLOCKS = 96
# (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
SMALL_DIMS = (64, 32, 16, 32)
DEEPSEEK_DIMS = (512, 128, 64, 128)
UNEVEN_DIMS = (96, 48, 32, 16)  # v_head_dim != qk_nope_head_dim
HEAD_COUNTS = (4, 16)
#: DeepSeek-V2/V3's query heads on one GPU: run on the first claimed dimension set only
#: (a backend may tile many heads differently from few; one set keeps the suite short)
WIDE_HEADS = 128

Workload = Callable[[AttentionWorld, Target], Iterable[tuple[str, Any]]]


def _dims_for(t: Target) -> list[tuple[int, int, int, int]]:
    """The MLA dimension sets whose latent width the spec claims (``head_size``)."""
    claimed = t.caps_values("head_size")
    dims = [d for d in (SMALL_DIMS, UNEVEN_DIMS, DEEPSEEK_DIMS)
            if claimed is None or d[0] + d[2] in claimed]
    if not dims:
        raise NotApplicable(f"{t.name} claims latent widths (head_size) "
                            f"{sorted(claimed or ())}, none of the suite's "
                            f"{[d[0] + d[2] for d in (SMALL_DIMS, UNEVEN_DIMS, DEEPSEEK_DIMS)]}")
    return dims


def base_case(t: Target) -> MLACase:
    """4 heads, the first claimed dimension set (small ones first), the smallest block
    size, float32 if claimed."""
    dtypes = _dtypes(t)
    dtype = torch.float32 if torch.float32 in dtypes else dtypes[0]
    block = _sizes(t, "block_size", mha_suite.DEFAULT_BLOCK_SIZES)[0]
    return MLACase.of(HEAD_COUNTS[0], _dims_for(t)[0], block, dtype, _device(t))


def _run(t: Target, prop: str, case: MLACase, workload: Workload) -> None:
    """Build the backend for ``case``, run ``workload``'s steps, fail on a mismatch."""
    backend = t.build(SUITE, KIND, prop, case.describe(), **case.kwargs(t.options))
    if not isinstance(backend, MLAAttentionBackend):
        raise t.fail(SUITE, CONSTRUCTOR_PROPERTY, case.describe(),
                     f"{type(backend).__qualname__} does not subclass "
                     "lmkit.api.MLAAttentionBackend")
    world = MLAWorld(backend, case, NUM_BLOCKS)
    for label, args in workload(world, t):
        work, forks = args if isinstance(args, tuple) else (args, None)
        described = ", ".join(f"req {rid}: context {world.context_len(rid)}, query {q}"
                              for rid, q in work)
        where = f"{case.describe()}; step {world.num_steps + 1} ({label}): [{described}]"
        try:
            bad = world.step(work, forks)
        except Exception as e:
            raise t.fail(SUITE, prop, where, f"plan()/run_mla() raised {type(e).__name__}: "
                         f"{e}") from e
        if bad is not None:
            raise t.fail(SUITE, prop, where, f"request {bad.rid} (context {bad.context}, "
                         f"query {bad.query_len}): {bad.detail}")


def _checks(t: Target) -> dict[str, Callable[[], None]]:
    def on_base(prop: str, workload: Workload, feature: str | None = None) -> Callable[[], None]:
        def check() -> None:
            if feature:
                mha_suite._require(t, feature)
            _run(t, prop, base_case(t), workload)
        return check

    def shapes() -> None:
        base = base_case(t)
        for heads in HEAD_COUNTS:
            for dims in _dims_for(t):
                case = MLACase.of(heads, dims, base.block_size, base.dtype, base.device)
                _run(t, "shapes", case, mha_suite.full_workload)
        wide = MLACase.of(WIDE_HEADS, _dims_for(t)[0], base.block_size, base.dtype,
                          base.device)
        _run(t, "shapes", wide, mha_suite.full_workload)

    def block_sizes() -> None:
        base = base_case(t)
        for bs in _sizes(t, "block_size", mha_suite.DEFAULT_BLOCK_SIZES):
            _run(t, "block sizes", replace(base, block_size=bs), mha_suite.full_workload)

    def dtypes() -> None:
        base = base_case(t)
        for dtype in _dtypes(t):
            _run(t, "dtypes", replace(base, dtype=dtype), mha_suite.full_workload)

    def unclaimed_refused() -> None:
        base = base_case(t)
        for what, kwargs in (("sliding_window=7", {"sliding_window": 7}),
                             ("causal=False", {"causal": False})):
            try:
                t.cls(**{**base.kwargs(t.options), **kwargs})
            except Exception:
                continue
            raise t.fail(SUITE, "unclaimed features refused", base.describe(),
                         f"constructing the MLA backend with {what} succeeded; MLA backends "
                         "attend causally over the whole context: raise an error instead")

    def constructor() -> None:
        case = base_case(t)
        t.build(SUITE, KIND, CONSTRUCTOR_PROPERTY, case.describe(), **case.kwargs(t.options))

    return {
        CONSTRUCTOR_PROPERTY: constructor,
        "prefill": on_base("prefill", mha_suite.prefill_workload),
        "decode": on_base("decode", mha_suite.decode_workload),
        "mixed batch": on_base("mixed batch", mha_suite.mixed_workload),
        "chunked prefill": on_base("chunked prefill", mha_suite.chunked_workload,
                                   "chunked_prefill"),
        "prefill over a cached prefix": on_base("prefill over a cached prefix",
                                                mha_suite.cached_prefix_workload,
                                                "prefix_caching"),
        "same-step prefix sharing": on_base("same-step prefix sharing",
                                            mha_suite.same_step_sharing_workload,
                                            "prefix_caching"),
        "multi-token queries": on_base("multi-token queries", mha_suite.multi_query_workload,
                                       "multi_token_query"),
        "shapes": shapes,
        "block sizes": block_sizes,
        "dtypes": dtypes,
        "unclaimed features refused": unclaimed_refused,
        "cuda graphs": lambda: check_cuda_graphs(t),
    }


def check_cuda_graphs(t: Target) -> None:
    """``run_mla`` of both layers captured once in a CUDA graph, then replayed after
    ``plan`` (``metadata.cuda_graph = True``) for later decode steps of the same shape,
    gives the oracle's result (only for specs claiming ``cuda_graphs``)."""
    mha_suite._require(t, "cuda_graphs")
    if not torch.cuda.is_available():
        raise NotApplicable("no CUDA device")
    prop, case = "cuda graphs", base_case(t)
    if case.device.type != "cuda":
        raise NotApplicable(f"{t.name} does not run on CUDA")
    backend = t.build(SUITE, KIND, prop, case.describe(), **case.kwargs(t.options))
    world = MLAWorld(backend, case, NUM_BLOCKS)
    world.step([(0, 9), (1, 17), (2, 4), (3, 30)])
    work = [(0, 1), (1, 1), (2, 1), (3, 1)]
    contexts = {rid: world.context_len(rid) for rid, _ in work}
    backend.plan(world.metadata(work, contexts, cuda_graph=True))

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=case.dtype, device=case.device)

    n, h = len(work), case.num_heads
    static = [(zeros(n, h, case.qk_nope_head_dim), zeros(n, h, case.qk_rope_head_dim),
               zeros(n, case.kv_lora_rank), zeros(n, case.qk_rope_head_dim))
              for _ in range(NUM_LAYERS)]
    weights = [w.to(dtype=case.dtype, device=case.device) for w in world.weights]
    graphs = [torch.cuda.CUDAGraph() for _ in range(NUM_LAYERS)]
    outs: list[torch.Tensor] = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for i in range(NUM_LAYERS):  # one graph per layer
                backend.run_mla(i, *static[i], world.caches[i], weights[i])  # warm-up
                with torch.cuda.graph(graphs[i], stream=stream):
                    outs.append(backend.run_mla(i, *static[i], world.caches[i], weights[i]))
    except Exception as e:
        raise t.fail(SUITE, prop, case.describe(),
                     f"capturing run_mla() in a CUDA graph raised {type(e).__name__}: {e}"
                     ) from e
    torch.cuda.current_stream().wait_stream(stream)

    def replay(layer: int, *args: torch.Tensor) -> torch.Tensor:
        for dst, src in zip(static[layer], args[:4], strict=True):
            dst.copy_(src)
        graphs[layer].replay()
        return outs[layer].clone()

    for i in range(3):
        bad = world.step(work, run=replay, cuda_graph=True)
        if bad is not None:
            raise t.fail(SUITE, prop, f"{case.describe()}; replayed decode step {i + 1}",
                         f"request {bad.rid} (context {bad.context}): {bad.detail}")


def check_mla_attention_backend(backend: Any, options: Any = None,
                                only: Iterable[str] | None = None) -> dict[str, str]:
    """Run every MLA property against ``backend`` (a Spec, Registration or
    MLAAttentionBackend subclass); return each property's outcome.

    :raises ConformanceFailure: naming the first property that fails and its input.
    """
    t = resolve_target(backend, options)
    return run_checks(_checks(t), set(only) if only is not None else None)


class MLAAttentionConformance:
    """pytest base class: one test per MLA property. Subclass it in a ``Test*`` class
    with a fixture ``attention_backend`` returning the Spec (or class, or ``(spec,
    options)``)."""

    def _check(self, attention_backend: Any, prop: str) -> None:
        skip_if_not_applicable(_checks(resolve_target(attention_backend))[prop])

    def test_constructor_signature(self, attention_backend: Any) -> None:
        self._check(attention_backend, CONSTRUCTOR_PROPERTY)

    def test_prefill(self, attention_backend: Any) -> None:
        self._check(attention_backend, "prefill")

    def test_decode(self, attention_backend: Any) -> None:
        self._check(attention_backend, "decode")

    def test_mixed_batch(self, attention_backend: Any) -> None:
        self._check(attention_backend, "mixed batch")

    def test_chunked_prefill(self, attention_backend: Any) -> None:
        self._check(attention_backend, "chunked prefill")

    def test_prefill_over_cached_prefix(self, attention_backend: Any) -> None:
        self._check(attention_backend, "prefill over a cached prefix")

    def test_same_step_prefix_sharing(self, attention_backend: Any) -> None:
        self._check(attention_backend, "same-step prefix sharing")

    def test_multi_token_queries(self, attention_backend: Any) -> None:
        self._check(attention_backend, "multi-token queries")

    def test_shapes(self, attention_backend: Any) -> None:
        self._check(attention_backend, "shapes")

    def test_block_sizes(self, attention_backend: Any) -> None:
        self._check(attention_backend, "block sizes")

    def test_dtypes(self, attention_backend: Any) -> None:
        self._check(attention_backend, "dtypes")

    def test_unclaimed_features_refused(self, attention_backend: Any) -> None:
        self._check(attention_backend, "unclaimed features refused")

    def test_cuda_graphs(self, attention_backend: Any) -> None:
        self._check(attention_backend, "cuda graphs")
