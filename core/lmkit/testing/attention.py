"""Conformance suite for attention backends (:class:`lmkit.api.AttentionBackend`).

Every output is compared with dense causal attention computed in float64 over the
request's whole key/value history (the same maths as the ``torch`` reference backend),
through a paged cache the backend itself fills, with metadata built as the model
runner builds it. Properties:

* ``prefill``, ``decode``, ``mixed batch`` (decodes and prefills in one step);
* ``chunked prefill`` (a prompt over several steps, chunks not block-aligned), when the
  spec claims ``chunked_prefill``;
* ``prefill over a cached prefix`` and ``same-step prefix sharing`` (a request whose
  cached blocks another request of the step fills), when it claims ``prefix_caching``;
* ``multi-token decode queries`` (speculative decoding), when it claims
  ``multi_token_query``; ``sliding window`` when it claims ``sliding_window``;
  ``logits soft cap`` (scores capped at 1, with a window when claimed) when it claims
  ``logits_soft_cap``; ``tree mask`` (draft trees verified and drafted level by level,
  :mod:`lmkit.testing.attention_tree`) when it claims ``tree_mask``;
* ``GQA and head sizes``, ``block sizes``, ``dtypes``: the whole workload over every
  head layout, head size (the claimed ``head_size`` values, else 64, 80, 128), block
  size (claimed ``block_size`` values, else 16 and 32) and claimed dtype;
* ``model-written K/V``: when the backend declares ``supports_model_kv_write``, the
  suite stores each step's K/V itself at the slots ``kv_write_slots()`` returns, in
  the documented layout, and calls ``run(..., kv_written=True)``;
* ``fp8 KV cache``: when the spec claims ``fp8_kv_cache``, the whole workload over a
  ``torch.float8_e4m3fn`` cache with scales 0.5 (keys) and 2.0 (values), against the
  oracle over the values the cache holds (``x * (1 / scale)`` in float32, saturated to
  +-448, rounded to e4m3, times the scale); the class must declare ``supports_fp8_kv_cache``;
* ``unclaimed features refused``: a backend that does not claim ``sliding_window``
  (``logits_soft_cap``, ``fp8_kv_cache``) raises when constructed with one, instead of
  silently ignoring it;
* ``cuda graphs``: when it claims ``cuda_graphs`` and CUDA is present, ``run`` captured
  in a graph and replayed after a new ``plan`` gives the eager result;
* ``in-place decode metadata``: when it also declares
  ``supports_in_place_decode_metadata``, the same graph replayed for later decode steps
  with *no* new ``plan`` (only the values in the metadata's device buffers changed, as
  a draft head's chained passes change them) gives the eager result.

Use :func:`check_attention_backend` directly, or subclass
:class:`AttentionConformance` and define an ``attention_backend`` fixture returning
the spec (or class) under test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch

from lmkit.testing.attention_graphs import replay_decode_steps
from lmkit.testing.attention_tree import check_tree_mask
from lmkit.testing.attention_world import AttentionCase, AttentionWorld
from lmkit.testing.failure import (
    CONSTRUCTOR_PROPERTY,
    NotApplicable,
    Target,
    resolve_target,
    run_checks,
    skip_if_not_applicable,
)

SUITE = "attention"
KIND = "attention"
HEAD_LAYOUTS = ((4, 4), (8, 2), (8, 1))  # (num_heads, num_kv_heads): MHA, GQA, MQA
DEFAULT_HEAD_SIZES = (64, 80, 128)
DEFAULT_BLOCK_SIZES = (16, 32)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NUM_BLOCKS = 128

Workload = Callable[[AttentionWorld, Target], Iterable[tuple[str, Any]]]


def _device(t: Target) -> torch.device:
    claimed = t.caps_values("device")
    if torch.cuda.is_available() and (claimed is None or "cuda" in claimed):
        return torch.device("cuda")
    if claimed is None or "cpu" in claimed:
        return torch.device("cpu")
    raise NotApplicable(f"{t.name} runs on {', '.join(sorted(claimed))} only and "
                        "this machine has no CUDA device")


def _dtypes(t: Target) -> list[torch.dtype]:
    claimed = t.caps_values("dtype")
    names = [n for n in DTYPES if claimed is None or n in claimed]
    if not names:
        raise NotApplicable(f"{t.name} claims none of the dtypes {', '.join(DTYPES)}")
    return [DTYPES[n] for n in names]


def _sizes(t: Target, key: str, default: tuple[int, ...]) -> list[int]:
    claimed = t.caps_values(key)
    if claimed is None:
        return list(default)
    values = sorted(int(v) for v in claimed)
    return sorted({values[0], values[len(values) // 2], values[-1]})


def base_case(t: Target) -> AttentionCase:
    """The configuration most properties run on: GQA 8/2, the claimed head size
    nearest 64, the smallest block size, float32 if claimed."""
    dtypes = _dtypes(t)
    head = min(_sizes(t, "head_size", DEFAULT_HEAD_SIZES), key=lambda h: abs(h - 64))
    dtype = torch.float32 if torch.float32 in dtypes else dtypes[0]
    return AttentionCase(8, 2, head, _sizes(t, "block_size", DEFAULT_BLOCK_SIZES)[0], dtype,
                         _device(t))


def _require(t: Target, feature: str) -> None:
    if not t.has_feature(feature):
        raise NotApplicable(f"{t.name} does not claim {feature!r}")


def _run(t: Target, prop: str, case: AttentionCase, workload: Workload,
         model_writes_kv: bool = False) -> None:
    """Build the backend for ``case``, run ``workload``'s steps, fail on a mismatch."""
    backend = t.build(SUITE, KIND, prop, case.describe(), **case.kwargs(t.options))
    world = AttentionWorld(backend, case, NUM_BLOCKS)
    for label, args in workload(world, t):
        work, forks = args if isinstance(args, tuple) else (args, None)
        described = ", ".join(f"req {rid}: context {world.context_len(rid)}, query {q}"
                              for rid, q in work)
        where = f"{case.describe()}; step {world.num_steps + 1} ({label}): [{described}]"
        try:
            bad = world.step(work, forks, model_writes_kv=model_writes_kv)
        except NotApplicable as e:
            raise NotApplicable(f"{t.name} {e}") from None
        except Exception as e:
            raise t.fail(SUITE, prop, where, f"plan()/run() raised {type(e).__name__}: {e}"
                         ) from e
        if bad is not None:
            raise t.fail(SUITE, prop, where, f"request {bad.rid} (context {bad.context}, "
                         f"query {bad.query_len}): {bad.detail}")


# -- workloads: generators of (label, work) or (label, (work, forks)) ---------------


def prefill_workload(w: AttentionWorld, t: Target) -> Iterable[tuple[str, Any]]:
    bs = w.case.block_size
    yield "prefill of new requests", [(0, 1), (1, 5), (2, bs), (3, 2 * bs + 3)]


def decode_workload(w: AttentionWorld, t: Target) -> Iterable[tuple[str, Any]]:
    bs = w.case.block_size
    yield "prefill", [(0, 3), (1, bs - 1), (2, 2 * bs + 5)]
    for i in range(3):  # request 1 crosses a block boundary on the second decode
        yield f"decode {i + 1}", [(0, 1), (1, 1), (2, 1)]


def mixed_workload(w: AttentionWorld, t: Target) -> Iterable[tuple[str, Any]]:
    bs = w.case.block_size
    yield "prefill", [(0, bs + 2), (1, 4)]
    yield "decodes with a new prefill", [(0, 1), (2, 2 * bs + 1), (1, 1)]
    yield "decodes with another prefill", [(2, 1), (3, 7), (0, 1), (1, 1)]


def chunked_workload(w: AttentionWorld, t: Target) -> Iterable[tuple[str, Any]]:
    bs = w.case.block_size
    yield "first chunk, and a short prompt", [(0, 7), (1, 3)]
    yield "second chunk with a decode", [(1, 1), (0, bs + 1)]
    yield "last chunk with a decode", [(1, 1), (0, 2 * bs - 5)]
    yield "decode after the chunks", [(0, 1), (1, 1)]


def cached_prefix_workload(w: AttentionWorld, t: Target) -> Iterable[tuple[str, Any]]:
    bs = w.case.block_size
    yield "prefill the future prefix owner", [(0, 3 * bs + 2)]
    w.fork(1, 0, 2 * bs)
    w.fork(2, 0, bs)
    yield "prefills over cached prefixes", [(1, 9), (2, 2 * bs + 3), (0, 1)]
    yield "decodes", [(0, 1), (1, 1), (2, 1)]


def same_step_sharing_workload(w: AttentionWorld, t: Target) -> Iterable[tuple[str, Any]]:
    bs = w.case.block_size
    yield ("a request whose prefix another request of the step writes",
           ([(0, 2 * bs + 1), (1, 5)], {1: (0, 2 * bs)}))
    yield "decodes", [(0, 1), (1, 1)]


def multi_query_workload(w: AttentionWorld, t: Target) -> Iterable[tuple[str, Any]]:
    bs = w.case.block_size
    yield "prefill", [(0, bs + 3), (1, 6), (2, 2 * bs)]
    yield "decodes of 1 to 4 query tokens", [(0, 4), (1, 1), (2, 3)]
    yield "again", [(2, 2), (0, 1), (1, 4)]


def full_workload(w: AttentionWorld, t: Target) -> Iterable[tuple[str, Any]]:
    """Everything the backend claims, in one run (used across heads, sizes, dtypes)."""
    yield from mixed_workload(w, t)
    if t.has_feature("chunked_prefill"):
        bs = w.case.block_size
        yield "chunk of a long prompt with decodes", [(0, 1), (1, 1), (4, bs + 3)]
        yield "its last chunk with decodes", [(0, 1), (4, bs), (2, 1)]
    if t.has_feature("prefix_caching"):
        w.fork(5, 2, w.case.block_size)
        yield "prefill over a cached prefix", [(5, 6), (0, 1)]


# -- properties ---------------------------------------------------------------------


def _checks(t: Target) -> dict[str, Callable[[], None]]:
    def on_base(prop: str, workload: Workload, feature: str | None = None) -> Callable[[], None]:
        def check() -> None:
            if feature:
                _require(t, feature)
            _run(t, prop, base_case(t), workload)
        return check

    def heads_and_sizes() -> None:
        base = base_case(t)
        for heads, kv_heads in HEAD_LAYOUTS:
            for head in _sizes(t, "head_size", DEFAULT_HEAD_SIZES):
                case = replace(base, num_heads=heads, num_kv_heads=kv_heads, head_size=head)
                _run(t, "GQA and head sizes", case, full_workload)

    def block_sizes() -> None:
        base = base_case(t)
        for bs in _sizes(t, "block_size", DEFAULT_BLOCK_SIZES):
            _run(t, "block sizes", replace(base, block_size=bs), full_workload)

    def dtypes() -> None:
        base = base_case(t)
        for dtype in _dtypes(t):
            _run(t, "dtypes", replace(base, dtype=dtype), full_workload)

    def sliding_window() -> None:
        _require(t, "sliding_window")
        case = replace(base_case(t), sliding_window=7)
        _run(t, "sliding window", case, full_workload)

    def logits_soft_cap() -> None:
        _require(t, "logits_soft_cap")
        window = 7 if t.has_feature("sliding_window") else None
        case = replace(base_case(t), sliding_window=window, logits_soft_cap=1.0)
        _run(t, "logits soft cap", case, full_workload)

    def fp8_kv_cache() -> None:
        _require(t, "fp8_kv_cache")
        case = replace(base_case(t), kv_cache_dtype=torch.float8_e4m3fn, kv_scales=(0.5, 2.0))
        if not getattr(t.cls, "supports_fp8_kv_cache", False):
            raise t.fail(SUITE, "fp8 KV cache", case.describe(),
                         "the spec claims 'fp8_kv_cache' but the class does not declare "
                         "supports_fp8_kv_cache = True")
        _run(t, "fp8 KV cache", case, full_workload)

    def model_written_kv() -> None:
        _run(t, "model-written K/V", base_case(t), full_workload, model_writes_kv=True)

    def unclaimed_refused() -> None:
        if t.spec is None:
            raise NotApplicable("no spec given: the claimed features are unknown")
        unclaimed = {feature: case for feature, case in (
            ("sliding_window", replace(base_case(t), sliding_window=7)),
            ("logits_soft_cap", replace(base_case(t), logits_soft_cap=1.0)),
            ("fp8_kv_cache", replace(base_case(t), kv_cache_dtype=torch.float8_e4m3fn)),
        ) if not t.has_feature(feature)}
        if not unclaimed:
            raise NotApplicable(f"{t.name} claims sliding_window, logits_soft_cap and "
                                "fp8_kv_cache")
        for feature, case in unclaimed.items():
            try:
                case.build(t.cls, t.options)
            except Exception:
                continue
            raise t.fail(SUITE, "unclaimed features refused", case.describe(),
                         f"the spec does not claim {feature!r}, yet constructing the backend "
                         f"with it succeeded; raise an error instead of silently ignoring it")

    def constructor() -> None:
        case = base_case(t)
        t.build(SUITE, KIND, CONSTRUCTOR_PROPERTY, case.describe(), **case.kwargs(t.options))

    return {
        CONSTRUCTOR_PROPERTY: constructor,
        "prefill": on_base("prefill", prefill_workload),
        "decode": on_base("decode", decode_workload),
        "mixed batch": on_base("mixed batch", mixed_workload),
        "chunked prefill": on_base("chunked prefill", chunked_workload, "chunked_prefill"),
        "prefill over a cached prefix": on_base("prefill over a cached prefix",
                                                cached_prefix_workload, "prefix_caching"),
        "same-step prefix sharing": on_base("same-step prefix sharing",
                                            same_step_sharing_workload, "prefix_caching"),
        "multi-token decode queries": on_base("multi-token decode queries",
                                              multi_query_workload, "multi_token_query"),
        "sliding window": sliding_window,
        "logits soft cap": logits_soft_cap,
        "tree mask": lambda: check_tree_mask(t, base_case(t), NUM_BLOCKS),
        "GQA and head sizes": heads_and_sizes,
        "block sizes": block_sizes,
        "dtypes": dtypes,
        "fp8 KV cache": fp8_kv_cache,
        "model-written K/V": model_written_kv,
        "unclaimed features refused": unclaimed_refused,
        "cuda graphs": lambda: check_cuda_graphs(t),
        "in-place decode metadata": lambda: check_cuda_graphs(t, in_place=True),
    }


def check_cuda_graphs(t: Target, in_place: bool = False) -> None:
    """``run`` captured once in a CUDA graph, then replayed after ``plan`` for later
    decode steps of the same shape, gives the oracle's result (only for specs claiming
    ``cuda_graphs``). Those steps are planned with ``metadata.cuda_graph = True``, as
    the runner plans the steps it captures and replays. ``in_place``: the later steps
    are not planned at all, only their metadata's device buffers rewritten (only for
    backends declaring ``supports_in_place_decode_metadata``)."""
    _require(t, "cuda_graphs")
    if not torch.cuda.is_available():
        raise NotApplicable("no CUDA device")
    prop, case = "in-place decode metadata" if in_place else "cuda graphs", base_case(t)
    if case.device.type != "cuda":
        raise NotApplicable(f"{t.name} does not run on CUDA")
    backend = t.build(SUITE, KIND, prop, case.describe(), **case.kwargs(t.options))
    if in_place and not type(backend).supports_in_place_decode_metadata:
        raise NotApplicable("does not declare supports_in_place_decode_metadata")
    replay_decode_steps(t, prop, backend, case, NUM_BLOCKS, plan=not in_place)


def check_attention_backend(backend: Any, options: Any = None,
                            only: Iterable[str] | None = None) -> dict[str, str]:
    """Run every attention property against ``backend`` (a Spec, Registration or
    AttentionBackend subclass); return each property's outcome.

    :raises ConformanceFailure: naming the first property that fails and its input.
    """
    t = resolve_target(backend, options)
    return run_checks(_checks(t), set(only) if only is not None else None)


class AttentionConformance:
    """pytest base class: one test per attention property.

    Subclass it in a ``Test*`` class and define a fixture ``attention_backend``
    returning the Spec (preferred: its caps decide what is tested) or the class;
    return ``(spec, options)`` to test with options.
    """

    def _check(self, attention_backend: Any, prop: str) -> None:
        t = resolve_target(attention_backend)
        skip_if_not_applicable(_checks(t)[prop])

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

    def test_multi_token_decode_queries(self, attention_backend: Any) -> None:
        self._check(attention_backend, "multi-token decode queries")

    def test_sliding_window(self, attention_backend: Any) -> None:
        self._check(attention_backend, "sliding window")

    def test_logits_soft_cap(self, attention_backend: Any) -> None:
        self._check(attention_backend, "logits soft cap")

    def test_tree_mask(self, attention_backend: Any) -> None:
        self._check(attention_backend, "tree mask")

    def test_gqa_and_head_sizes(self, attention_backend: Any) -> None:
        self._check(attention_backend, "GQA and head sizes")

    def test_block_sizes(self, attention_backend: Any) -> None:
        self._check(attention_backend, "block sizes")

    def test_dtypes(self, attention_backend: Any) -> None:
        self._check(attention_backend, "dtypes")

    def test_fp8_kv_cache(self, attention_backend: Any) -> None:
        self._check(attention_backend, "fp8 KV cache")

    def test_model_written_kv(self, attention_backend: Any) -> None:
        self._check(attention_backend, "model-written K/V")

    def test_unclaimed_features_refused(self, attention_backend: Any) -> None:
        self._check(attention_backend, "unclaimed features refused")

    def test_cuda_graphs(self, attention_backend: Any) -> None:
        self._check(attention_backend, "cuda graphs")

    def test_in_place_decode_metadata(self, attention_backend: Any) -> None:
        self._check(attention_backend, "in-place decode metadata")
