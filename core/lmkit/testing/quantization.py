"""Conformance suite for quantization methods (:class:`lmkit.api.QuantizationMethod`).

The method is built as the engine builds it, ``cls(facts, options=...)``, for a tiny
random Llama in safetensors (:func:`lmkit.testing.tiny_model.make_tiny_model`) or a
model directory you pass (one in the format the method reads, e.g. a converted GGUF
model that keeps ``model.gguf``). Properties:

* ``check``: :meth:`check` accepts the model, and refuses a directory without the
  checkpoint with :class:`~lmkit.api.ModelLoadError` (not another exception);
* ``weights``: :meth:`iterate_weights` yields each name once, every one a weight of the
  dense checkpoint (Hugging Face names), at least one of them quantized; quantized ones
  have the dense weight's shape and dequantize close to it (relative error at most
  :data:`MAX_WEIGHT_ERROR`), the others equal it;
* ``linear``: ``linear(w)(x, bias)`` is ``x @ dequantize(w).T + bias`` for 1, 3 and 40
  rows (error at most :data:`MAX_LINEAR_ERROR` of the largest output);
* ``fuse``: :meth:`fuse` of two same-typed weights is ``None`` (not fusable) or one
  weight whose rows are both parts' rows;
* ``dequantize rows``: ``dequantize(w, rows)`` is ``dequantize(w)[rows]``;
* ``norm linear`` (methods declaring ``supports_norm_linear``): ``linear_with_norm(w)``'s
  folded function, where the method gives one, gives ``h = x + residual`` exactly (``x`` without a residual) and
  ``linear(rms_norm(h) * norm_weight, bias)`` (error at most :data:`MAX_LINEAR_ERROR`)
  for 1 and 3 rows;
* ``silu mul linear`` (methods declaring ``supports_silu_mul_linear``): the folded
  function of ``linear_with_silu_mul(w)``, where the method gives one, is
  ``linear(silu(gate) * up, bias)`` (error at most :data:`MAX_LINEAR_ERROR`).

A method that does not declare ``"cpu"`` among its ``device`` values, or whose
``weight_format`` values do not include the model's format, is not applicable here.

Use :func:`check_quantization_method`, or subclass :class:`QuantizationConformance`
and define a ``quantization_method`` fixture returning the spec or class (and
optionally set ``model_dir``).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lmkit.testing.failure import (
    CONSTRUCTOR_PROPERTY,
    NotApplicable,
    Target,
    resolve_target,
    run_checks,
    skip_if_not_applicable,
)

SUITE = "quantization"
MAX_WEIGHT_ERROR = 0.1  # |dequantize(w) - w| / |w| (Frobenius), per weight
MAX_LINEAR_ERROR = 0.05  # of max |x @ W.T|: int8 rounding of activations is allowed
ROWS = (1, 3, 40)


class _World:
    """The model's facts and dense weights, and the method built for them."""

    def __init__(self, t: Target, model_dir: Path, prop: str) -> None:
        import torch

        from lmkit.api.quantization import QuantizedTensor
        from lmkit.loading.model_facts import load_model_facts
        from lmkit.loading.weights import iterate_weights
        from lmkit.plugin_host.manager import PluginHost

        self.t, self.torch, self.QuantizedTensor = t, torch, QuantizedTensor
        host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
        self.facts = load_model_facts(model_dir, host)
        self.input = f"the model in {model_dir} ({self.facts.weight_format})"
        for key, have in (("device", "cpu"), ("weight_format", self.facts.weight_format)):
            allowed = t.caps_values(key)
            if allowed is not None and have not in allowed:
                raise NotApplicable(f"the method declares {key} {sorted(allowed)}; this "
                                    f"suite runs {have!r} (pass model_dir of that format)")
        self.dense = {name: w.float() for name, w in iterate_weights(model_dir)}
        self.method = t.build(SUITE, "quantization", prop, self.input, self.facts,
                              options=t.options)

    def fail(self, prop: str, detail: str, input: str | None = None) -> AssertionError:
        return self.t.fail(SUITE, prop, input or self.input, detail)

    def call(self, prop: str, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            raise self.fail(prop, f"{what} raised {type(e).__name__}: {e}") from e

    def weights(self, prop: str) -> dict[str, Any]:
        self.call(prop, "check()", self.method.check)
        out: dict[str, Any] = {}
        for name, w in self.call(prop, "iterate_weights()",
                                 lambda: list(self.method.iterate_weights())):
            if name in out:
                raise self.fail(prop, f"iterate_weights() yielded {name!r} twice")
            out[name] = w
        return out

    def quantized(self, prop: str, weights: dict[str, Any] | None = None) -> dict[str, Any]:
        """The quantized weights, one per (type, shape): the kernels they exercise."""
        out: dict[Any, tuple[str, Any]] = {}
        for n, wt in (self.weights(prop) if weights is None else weights).items():
            if isinstance(wt, self.QuantizedTensor):
                out.setdefault((wt.qtype, tuple(wt.shape)), (n, wt))
        if not out:
            raise self.fail(prop, "iterate_weights() yielded no QuantizedTensor")
        return dict(out.values())


def _check(w: _World) -> None:
    prop = "check"
    w.call(prop, "check()", w.method.check)
    with tempfile.TemporaryDirectory(prefix="lmkit-quantization-empty-") as empty:
        other = w.t.build(SUITE, "quantization", prop, w.input,
                          dataclasses.replace(w.facts, model_dir=Path(empty)),
                          options=w.t.options)
        from lmkit.errors import ModelLoadError

        try:
            other.check()
        except ModelLoadError:
            return
        except Exception as e:
            raise w.fail(prop, f"check() raised {type(e).__name__}: {e}; raise "
                         "ModelLoadError saying what is missing", f"an empty directory {empty}"
                         ) from e
        raise w.fail(prop, "check() accepted a directory without a checkpoint",
                     f"an empty directory {empty}")


def _relative_error(torch: Any, got: Any, want: Any) -> float:
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-12))


def _weights(w: _World) -> None:
    prop = "weights"
    torch = w.torch
    weights = w.weights(prop)
    w.quantized(prop, weights)  # at least one
    for name, weight in weights.items():
        if name not in w.dense:
            raise w.fail(prop, f"iterate_weights() yielded {name!r}, which the dense "
                         "checkpoint does not have (use Hugging Face names)")
        want = w.dense[name]
        got = w.call(prop, f"dequantize({name})", lambda weight=weight: w.method.dequantize(
            weight)) if isinstance(weight, w.QuantizedTensor) else weight
        if tuple(got.shape) != tuple(want.shape) or (
                isinstance(weight, w.QuantizedTensor) and tuple(weight.shape) != tuple(want.shape)):
            raise w.fail(prop, f"{name}: shape {tuple(got.shape)}, the checkpoint's is "
                         f"{tuple(want.shape)}")
        error = _relative_error(torch, got.float(), want)
        limit = MAX_WEIGHT_ERROR if isinstance(weight, w.QuantizedTensor) else 1e-6
        if error > limit:
            raise w.fail(prop, f"{name}: relative error {error:.3g} against the dense "
                         f"weight (at most {limit})")


def _linear(w: _World) -> None:
    prop = "linear"
    torch = w.torch
    gen = torch.Generator().manual_seed(0)
    for name, weight in w.quantized(prop).items():
        fn = w.call(prop, f"linear({name})", lambda weight=weight: w.method.linear(weight))
        dense = w.method.dequantize(weight)
        bias = torch.randn(weight.shape[0], generator=gen)
        for rows in ROWS:
            x = torch.randn(rows, weight.shape[1], generator=gen)
            for b in (None, bias):
                want = x @ dense.t() + (b if b is not None else 0)
                got = w.call(prop, f"linear({name})(x, bias)", lambda fn=fn, x=x, b=b: fn(x, b))
                error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
                if tuple(got.shape) != tuple(want.shape) or error > MAX_LINEAR_ERROR:
                    raise w.fail(prop, f"{name}: output {tuple(got.shape)} with error "
                                 f"{error:.3g} of the largest output (at most "
                                 f"{MAX_LINEAR_ERROR}) against x @ dequantize(w).T + bias",
                                 f"x [{rows}, {weight.shape[1]}], bias "
                                 f"{'given' if b is not None else 'None'}")


def _fuse(w: _World) -> None:
    prop = "fuse"
    torch = w.torch
    by_type: dict[tuple[str, int], list[Any]] = {}
    for weight in w.weights(prop).values():
        if isinstance(weight, w.QuantizedTensor):
            by_type.setdefault((weight.qtype, weight.shape[1]), []).append(weight)
    pairs = [ws[:2] for ws in by_type.values() if len(ws) >= 2]
    if not pairs:
        raise NotApplicable("the model has no two quantized weights of one type and width")
    for a, b in pairs:
        fused = w.call(prop, "fuse([a, b])", lambda a=a, b=b: w.method.fuse([a, b]))
        if fused is None:
            continue
        want = torch.cat([w.method.dequantize(a), w.method.dequantize(b)])
        got = w.method.dequantize(fused)
        if tuple(fused.shape) != tuple(want.shape) or not torch.allclose(got, want, rtol=0,
                                                                         atol=1e-6):
            raise w.fail(prop, f"fuse of {a.qtype} {a.shape} and {b.shape}: got "
                         f"{fused.shape}, not both parts' rows", "two same-typed weights")


def _dequantize_rows(w: _World) -> None:
    prop = "dequantize rows"
    torch = w.torch
    for name, weight in w.quantized(prop).items():
        rows = torch.tensor([weight.shape[0] - 1, 0, weight.shape[0] // 2])
        got = w.call(prop, f"dequantize({name}, rows)", lambda weight=weight, rows=rows:
                     w.method.dequantize(weight, rows))
        if not torch.equal(got, w.method.dequantize(weight)[rows]):
            raise w.fail(prop, f"{name}: dequantize(w, rows) differs from dequantize(w)[rows]",
                         f"rows {rows.tolist()}")


def _norm_linear(w: _World) -> None:
    prop = "norm linear"
    torch = w.torch
    if not w.method.supports_norm_linear:
        raise NotApplicable("the method does not declare supports_norm_linear")
    gen = torch.Generator().manual_seed(0)
    for name, weight in w.quantized(prop).items():
        lin, folded = w.call(prop, f"linear_with_norm({name})",
                             lambda weight=weight: w.method.linear_with_norm(weight))
        if folded is None:  # the method cannot fold here (e.g. a CUDA method on the CPU)
            continue
        k = weight.shape[1]
        norm_w, bias = torch.rand(k, generator=gen) + 0.5, torch.randn(weight.shape[0],
                                                                      generator=gen)
        for rows in (1, 3):
            x = torch.randn(rows, k, generator=gen)
            for residual in (None, torch.randn(rows, k, generator=gen)):
                h = x if residual is None else x + residual
                normed = norm_w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
                want = lin(normed, bias)
                got, got_h = w.call(prop, f"linear_with_norm({name})[1](x, residual, ...)",
                                    lambda f=folded, x=x, r=residual, nw=norm_w, b=bias:
                                    f(x, r, nw, 1e-5, b))
                error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
                where = f"x [{rows}, {k}], residual {'given' if residual is not None else 'None'}"
                if not torch.equal(got_h, h):
                    raise w.fail(prop, f"{name}: the returned residual is not x + residual", where)
                if tuple(got.shape) != tuple(want.shape) or error > MAX_LINEAR_ERROR:
                    raise w.fail(prop, f"{name}: error {error:.3g} of the largest output (at "
                                 f"most {MAX_LINEAR_ERROR}) against linear(rms_norm(x + "
                                 "residual) * norm_weight, bias)", where)


def _silu_mul_linear(w: _World) -> None:
    prop = "silu mul linear"
    torch = w.torch
    if not w.method.supports_silu_mul_linear:
        raise NotApplicable("the method does not declare supports_silu_mul_linear")
    gen = torch.Generator().manual_seed(0)
    for name, weight in w.quantized(prop).items():
        lin, folded = w.call(prop, f"linear_with_silu_mul({name})",
                             lambda weight=weight: w.method.linear_with_silu_mul(weight))
        if folded is None:  # the method cannot fold here (e.g. this CPU): linear() only
            continue
        k = weight.shape[1]
        bias = torch.randn(weight.shape[0], generator=gen)
        for rows in (1, 3):
            gate_up = torch.randn(rows, 2 * k, generator=gen)
            want = lin(torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:], bias)
            got = w.call(prop, f"linear_with_silu_mul({name})[1](gate_up, bias)",
                         lambda f=folded, g=gate_up, b=bias: f(g, b))
            error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
            if tuple(got.shape) != tuple(want.shape) or error > MAX_LINEAR_ERROR:
                raise w.fail(prop, f"{name}: error {error:.3g} of the largest output (at most "
                             f"{MAX_LINEAR_ERROR}) against linear(silu(gate) * up, bias)",
                             f"gate_up [{rows}, {2 * k}]")


PROPERTIES: dict[str, Callable[[_World], None]] = {
    CONSTRUCTOR_PROPERTY: lambda w: None, "check": _check, "weights": _weights,
    "linear": _linear, "fuse": _fuse, "dequantize rows": _dequantize_rows,
    "norm linear": _norm_linear, "silu mul linear": _silu_mul_linear}


def _with_world(t: Target, model_dir: Path | None, prop: str,
                body: Callable[[_World], None]) -> None:
    with tempfile.TemporaryDirectory(prefix="lmkit-quantization-conformance-") as tmp:
        if model_dir is None:
            from lmkit.testing.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny")
        body(_World(t, Path(model_dir), prop))


def check_quantization_method(method: Any, options: Any = None,
                              model_dir: str | Path | None = None,
                              only: Iterable[str] | None = None) -> dict[str, str]:
    """Run every quantization property against ``method`` (a Spec, Registration or
    QuantizationMethod subclass built as ``cls(facts, options=...)``), on ``model_dir``
    or a fresh tiny random model (safetensors).

    :raises ConformanceFailure: naming the first failing property and its input.
    """
    t = resolve_target(method, options)
    wanted = set(only) if only is not None else set(PROPERTIES)
    results: dict[str, str] = {}

    def body(w: _World) -> None:
        results.update(run_checks({n: (lambda f=f: f(w)) for n, f in PROPERTIES.items()},
                                  wanted))

    try:
        _with_world(t, Path(model_dir) if model_dir else None, CONSTRUCTOR_PROPERTY, body)
    except NotApplicable as e:
        return {name: f"not applicable: {e}" for name in PROPERTIES if name in wanted}
    return results


class QuantizationConformance:
    """pytest base class: one test per quantization property. Define a
    ``quantization_method`` fixture returning the spec or class; set ``model_dir`` (a
    path) to run another model than a fresh tiny random Llama."""

    model_dir: str | Path | None = None

    def _check(self, quantization_method: Any, prop: str) -> None:
        t = resolve_target(quantization_method)
        model_dir = Path(self.model_dir) if self.model_dir else None
        skip_if_not_applicable(lambda: _with_world(t, model_dir, prop, PROPERTIES[prop]))

    def test_constructor_signature(self, quantization_method: Any) -> None:
        self._check(quantization_method, CONSTRUCTOR_PROPERTY)

    def test_check(self, quantization_method: Any) -> None:
        self._check(quantization_method, "check")

    def test_weights(self, quantization_method: Any) -> None:
        self._check(quantization_method, "weights")

    def test_linear(self, quantization_method: Any) -> None:
        self._check(quantization_method, "linear")

    def test_fuse(self, quantization_method: Any) -> None:
        self._check(quantization_method, "fuse")

    def test_dequantize_rows(self, quantization_method: Any) -> None:
        self._check(quantization_method, "dequantize rows")

    def test_norm_linear(self, quantization_method: Any) -> None:
        self._check(quantization_method, "norm linear")

    def test_silu_mul_linear(self, quantization_method: Any) -> None:
        self._check(quantization_method, "silu mul linear")

