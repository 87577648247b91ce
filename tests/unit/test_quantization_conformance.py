"""lmkit.testing.quantization: the suite passes the scaffold's int8-rows method and
fails, naming the property, a method that breaks one (wrong rows, wrong kernel, wrong
names, a check that lets an empty directory through, a constructor without facts)."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

torch = pytest.importorskip("torch")
from lmkit.scaffold.generate import new_plugin  # noqa: E402
from lmkit.testing.failure import ConformanceFailure  # noqa: E402
from lmkit.testing.quantization import check_quantization_method  # noqa: E402

NAME = "int8-rows-conformance"


@pytest.fixture(scope="module")
def method(tmp_path_factory):
    root = new_plugin(NAME, "quantization", tmp_path_factory.mktemp("scaffold"))
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("int8_rows_conformance.method").Int8RowsConformanceMethod
    finally:
        sys.path.remove(str(root))


@pytest.mark.slow  # every property on a tiny model: about 5 s here
def test_the_scaffold_method_passes(method):
    results = check_quantization_method(method)
    assert results.pop("norm linear").startswith("not applicable")  # declares no folding
    assert results.pop("silu mul linear").startswith("not applicable")
    assert set(results.values()) == {"passed"}


def _folding(method, add_residual: bool):
    """The scaffold method declaring norm folding, done in torch (``add_residual=False``:
    a broken one that forgets the residual)."""
    def linear_with_norm(self, weight):
        lin = self.linear(weight)

        def folded(x, residual, norm_weight, eps, bias):
            h = x + residual if residual is not None and add_residual else x
            normed = norm_weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
            return lin(normed, bias), h
        return lin, folded

    return type("Folding", (method,), {"supports_norm_linear": True, "fold_max_rows": 32,
                                       "linear_with_norm": linear_with_norm})


def test_norm_folding_is_checked_when_declared(method):
    assert check_quantization_method(_folding(method, True), only=["norm linear"]) == {
        "norm linear": "passed"}
    with pytest.raises(ConformanceFailure, match="the returned residual is not x"):
        check_quantization_method(_folding(method, False), only=["norm linear"])


@pytest.mark.parametrize(("prop", "override", "message"), [
    ("dequantize rows", {"dequantize": lambda self, w, rows=None: self.full(w)[:len(rows)]
                         if rows is not None else self.full(w)}, "dequantize(w)[rows]"),
    ("linear", {"linear": lambda self, w: lambda x, b: x @ self.dequantize(w).t()},
     "x @ dequantize(w).T + bias"),
    ("weights", {"iterate_weights": lambda self: ((f"x.{n}", t) for n, t in self.base())},
     "which the dense checkpoint does not have"),
    ("check", {"check": lambda self: None}, "accepted a directory without a checkpoint"),
])
def test_a_broken_method_fails_the_property(method, prop, override, message):
    helpers = {"full": method.dequantize, "base": method.iterate_weights}
    broken = type("Broken", (method,), {**helpers, **override})
    with pytest.raises(ConformanceFailure, match=re.escape(message)) as e:
        check_quantization_method(broken, only=[prop])
    assert prop in str(e.value)


def test_a_constructor_without_facts_fails(method):
    class Old(method):
        def __init__(self, options=None):
            super().__init__(None, options=options)

    with pytest.raises(ConformanceFailure, match=r"(?s)constructor signature.*cls\(facts, \*, "
                                                 r"options\)"):
        check_quantization_method(Old, only=["constructor signature"])


def test_silu_folding_is_checked_when_declared(method):
    def linear_with_silu_mul(self, weight, exact=True):
        lin = self.linear(weight)

        def folded(gate_up, bias):
            k = gate_up.shape[1] // 2
            act = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
            return lin(act if exact else gate_up[:, k:].contiguous(), bias)
        return lin, folded

    def folding(exact):
        return type("SiluFolding", (method,), {
            "supports_silu_mul_linear": True, "fold_max_rows": 32,
            "linear_with_silu_mul": lambda self, w: linear_with_silu_mul(self, w, exact)})

    assert check_quantization_method(folding(True), only=["silu mul linear"]) == {
        "silu mul linear": "passed"}
    with pytest.raises(ConformanceFailure, match="against linear"):
        check_quantization_method(folding(False), only=["silu mul linear"])

