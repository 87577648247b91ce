"""The ``fp8`` method's checkpoint readers on tiny synthetic safetensors files: the
compressed-tensors layouts (per channel, per tensor, block-wise) and transformers'
``quant_method: fp8`` (block-wise ``weight_scale_inv``) load to weights close to the
dense source, and malformed files (a missing scale, a scale of the wrong shape or
dtype, an unknown tensor dtype, a scale without its weight, integer or 4-bit schemes,
other methods) are refused by ``check()`` before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from lmkit.api import ModelLoadError, PluginHost, QuantizedTensor, iterate_weights  # noqa: E402
from lmkit.loading.gguf import weight_format  # noqa: E402
from lmkit.loading.model_facts import load_model_facts  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402
from lmkit_plugins.quantization.fp8_checkpoint import read_layout  # noqa: E402
from lmkit_plugins.quantization.fp8_cuda import Fp8Method  # noqa: E402
from lmkit_plugins.quantization.fp8_write import write_fp8_checkpoint  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

BLOCK = (32, 32)  # the tiny model's projections are 64..128 wide: several blocks each
QKV = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fp8") / "dense")


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})


def _method(model_dir: Path, host: PluginHost) -> Fp8Method:
    return Fp8Method(load_model_facts(model_dir, host))


def _loaded(model_dir: Path, host: PluginHost) -> tuple[Fp8Method, dict]:
    method = _method(model_dir, host)
    method.check()
    return method, dict(method.iterate_weights())


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("layout,strategy,limit", [
    ("compressed-tensors", "channel", 0.035), ("compressed-tensors", "tensor", 0.035),
    ("compressed-tensors", "block", 0.05), ("fp8", "block", 0.05), ("fp8", "tensor", 0.035)])
def test_fp8_checkpoints_load_close_to_the_dense_source(dense, host, tmp_path, layout,
                                                        strategy, limit):
    fp8 = write_fp8_checkpoint(dense, tmp_path / "fp8", layout, strategy, BLOCK)
    assert weight_format(fp8) == layout  # what auto selection follows
    method, weights = _loaded(fp8, host)
    source = dict(iterate_weights(dense))
    assert set(weights) == set(source)
    quantized = {n: w for n, w in weights.items() if isinstance(w, QuantizedTensor)}
    assert len(quantized) == 14  # 7 projections x 2 layers; embedding and norms dense
    for name, w in weights.items():
        if name in quantized:
            assert w.qtype == "F8_E4M3" and w.data.scale.shape == (w.shape[0],)
            assert w.data.weight.dtype == torch.float8_e4m3fn
            assert _relative(method.dequantize(w), source[name]) < limit, name
        else:
            assert torch.equal(w, source[name])


def test_per_channel_and_per_tensor_scales_are_kept_exactly(dense, host, tmp_path):
    for strategy in ("channel", "tensor"):
        fp8 = write_fp8_checkpoint(dense, tmp_path / strategy, "compressed-tensors", strategy)
        stored = load_file(str(fp8 / "model.safetensors"))
        _, weights = _loaded(fp8, host)
        w = weights[f"{QKV}.weight"]
        assert torch.equal(w.data.weight.view(torch.uint8),
                           stored[f"{QKV}.weight"].view(torch.uint8))
        want = stored[f"{QKV}.weight_scale"].float().reshape(-1).expand(w.shape[0])
        assert torch.equal(w.data.scale, want)


def test_block_scales_are_requantized_per_channel(dense, host, tmp_path):
    """Block-wise weights are dequantized and quantized again per channel: the result
    is within one more e4m3 rounding of the block-wise weight."""
    fp8 = write_fp8_checkpoint(dense, tmp_path / "fp8", "fp8", "block", BLOCK)
    stored = load_file(str(fp8 / "model.safetensors"))
    method, weights = _loaded(fp8, host)
    q, s = stored[f"{QKV}.weight"], stored[f"{QKV}.weight_scale_inv"]
    grid = s.repeat_interleave(BLOCK[0], 0)[:q.shape[0]].repeat_interleave(BLOCK[1], 1)
    blockwise = q.float() * grid[:, :q.shape[1]]
    got = method.dequantize(weights[f"{QKV}.weight"])
    row_max = blockwise.abs().amax(dim=1, keepdim=True)
    # one e4m3 rounding: 2^-4 relative, 2^-10 of the row's scale for subnormals
    assert ((got - blockwise).abs() <= torch.maximum(blockwise.abs() / 16,
                                                     row_max / 448 / 1024) + 1e-9).all()


def test_activation_and_kv_cache_scales_are_ignored(dense, host, tmp_path):
    fp8 = write_fp8_checkpoint(dense, tmp_path / "fp8", "compressed-tensors", "channel")
    extra = {f"{QKV}.input_scale": torch.ones(1), "model.layers.0.self_attn.k_scale":
             torch.ones(()), "model.layers.0.self_attn.v_scale": torch.ones(())}
    _rewrite(fp8, lambda t: t.update(extra))
    _, weights = _loaded(fp8, host)
    assert not set(extra) & set(weights) and f"{QKV}.weight" in weights


def test_a_dense_checkpoint_is_quantized_at_load(dense, host):
    assert read_layout(dense).source == "dense"
    method, weights = _loaded(dense, host)
    assert isinstance(weights[f"{QKV}.weight"], QuantizedTensor)
    assert not isinstance(weights["model.embed_tokens.weight"], QuantizedTensor)


def _rewrite(fp8: Path, change) -> None:
    path = fp8 / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def _config(fp8: Path, change) -> None:
    config = json.loads((fp8 / "config.json").read_text())
    change(config["quantization_config"])
    (fp8 / "config.json").write_text(json.dumps(config))


def _refused(fp8: Path, host: PluginHost, pattern: str) -> None:
    method = _method(fp8, host)
    with pytest.raises(ModelLoadError, match=pattern):
        method.check()


@pytest.fixture
def channel(dense, tmp_path) -> Path:
    return write_fp8_checkpoint(dense, tmp_path / "fp8", "compressed-tensors", "channel")


def test_a_missing_scale_is_refused(channel, host):
    _rewrite(channel, lambda t: t.pop(f"{QKV}.weight_scale"))
    _refused(channel, host, rf"'{QKV}.weight'.* is F8_E4M3 but its scale "
                            rf"'{QKV}.weight_scale' is missing")


def test_a_scale_of_the_wrong_shape_is_refused(channel, host):
    _rewrite(channel, lambda t: t.update({f"{QKV}.weight_scale": torch.ones(3, 1)}))
    _refused(channel, host, r"has shape \[3, 1\]; for the weight of shape \[64, 64\] a "
                            r"scale is one of \[64, 1\], \[64\], \[\], \[1\], \[1, 1\]")


def test_a_block_scale_needs_the_declared_block(dense, host, tmp_path):
    fp8 = write_fp8_checkpoint(dense, tmp_path / "fp8", "fp8", "block", BLOCK)
    _config(fp8, lambda q: q.update(weight_block_size=[16, 16]))
    _refused(fp8, host, r"has shape \[2, \d\]; .* \[4, \d\] \(per channel, per tensor, "
                        r"blocks of 16x16\)")


def test_a_scale_that_is_not_float_is_refused(channel, host):
    _rewrite(channel, lambda t: t.update({f"{QKV}.weight_scale": torch.ones(64, 1,
                                                                           dtype=torch.int32)}))
    _refused(channel, host, r"weight_scale'.* has dtype I32; the fp8 method reads F8_E4M3 "
                            r"weights with F32/BF16/F16 scales")
    _rewrite(channel, lambda t: t.update({f"{QKV}.weight_scale": torch.ones(
        64, 1, dtype=torch.float8_e4m3fn)}))
    _refused(channel, host, r"weight_scale'.* has dtype F8_E4M3; weight scales must be "
                            r"F32/BF16/F16")


def test_an_unknown_dtype_is_refused(channel, host):
    _rewrite(channel, lambda t: t.update({f"{QKV}.weight": t[f"{QKV}.weight"].to(
        torch.float8_e5m2)}))
    _refused(channel, host, r"q_proj.weight'.* has dtype F8_E5M2; the fp8 method reads F8_E4M3")
    _rewrite(channel, lambda t: t.update({
        f"{QKV}.weight": t[f"{QKV}.weight"].float().to(torch.float8_e4m3fn),
        "model.norm.weight": torch.ones(64, dtype=torch.int8)}))
    _refused(channel, host, r"'model.norm.weight'.* has dtype I8; the fp8 method reads F8_E4M3")


def test_a_scale_without_its_fp8_weight_is_refused(channel, host):
    _rewrite(channel, lambda t: t.update({f"{QKV}.weight": t[f"{QKV}.weight"].bfloat16()}))
    _refused(channel, host, r"weight_scale'.* is a weight scale, but .*q_proj.weight' is not an "
                            r"F8_E4M3 weight \(BF16\)")


def test_fp8_weights_without_a_declared_layout_are_refused(channel, host):
    config = json.loads((channel / "config.json").read_text())
    del config["quantization_config"]
    (channel / "config.json").write_text(json.dumps(config))
    _refused(channel, host, r"is F8_E4M3, but config.json declares no quantization_config")


@pytest.mark.parametrize("change,pattern", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int"),
     r"group 'group_0' with 4-bit int weights"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group"),
     r"'group' weight scales"),
    (lambda q: q.update(quant_method="awq"), r"declares quant_method 'awq'; the fp8 "
                                             r"quantization method reads float8 e4m3"),
])
def test_quantizations_it_does_not_read_are_refused(channel, host, change, pattern):
    _config(channel, change)
    _refused(channel, host, pattern)


def test_a_non_finite_scale_is_refused_when_read(channel, host):
    _rewrite(channel, lambda t: t[f"{QKV}.weight_scale"].__setitem__(0, float("nan")))
    method = _method(channel, host)
    method.check()  # headers are fine
    with pytest.raises(ModelLoadError, match=rf"weight '{QKV}.weight': weight scales must be "
                                             "finite and positive"):
        dict(method.iterate_weights())


def test_an_empty_directory_is_refused(host, dense, tmp_path):
    import dataclasses

    facts = dataclasses.replace(load_model_facts(dense, host), model_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="no weights in"):
        Fp8Method(facts).check()


def test_the_lm_head_is_quantized_only_when_asked(host, tmp_path):
    from lmkit_plugins.quantization.fp8_options import Fp8Options

    untied = make_tiny_model(tmp_path / "untied")
    config = json.loads((untied / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (untied / "config.json").write_text(json.dumps(config))
    _rewrite(untied, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    facts = load_model_facts(untied, host)
    plain = dict(Fp8Method(facts).iterate_weights())
    assert not isinstance(plain["lm_head.weight"], QuantizedTensor)
    asked = dict(Fp8Method(facts, options=Fp8Options(quantize_lm_head=True)).iterate_weights())
    assert isinstance(asked["lm_head.weight"], QuantizedTensor)
    assert not isinstance(asked["model.embed_tokens.weight"], QuantizedTensor)
