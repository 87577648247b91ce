"""The MLA attention backends without a GPU: registration (no heavy imports),
``lmkit plugins list``, refusals with reasons (no CUDA, no FlashInfer, an MHA model),
their options, and their rank under ``auto`` (below the ordinary backends, so a model
that does not declare its attention kind never gets them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from lmkit.api import Needs
from lmkit.cli.main import build_app
from lmkit.errors import NoBackendError
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.spec import module_present
from lmkit_plugins.attention.mla_options import (
    MLAFlashInferAttentionOptions,
    MLATritonAttentionOptions,
)
from pydantic import ValidationError
from typer.testing import CliRunner

ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
MLA_NEEDS = {"device": "cuda", "dtype": "bfloat16", "attention_kind": "mla"}
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                                   reason="checks the machine without CUDA")


def _run(*args: str):
    return CliRunner().invoke(build_app(env=ENV), list(args), env=ENV)


def test_registered_with_the_mla_attention_kind_without_importing_them():
    host = PluginHost.load(env=ENV)
    for name in ("mla_triton", "mla_flashinfer"):
        spec = host.registry.get("attention", name).spec
        assert spec.caps.values["attention_kind"] == frozenset({"mla"})
        assert {"multi_token_query", "prefix_caching", "chunked_prefill",
                "cuda_graphs"} <= spec.caps.features
        assert spec.needs_cuda
        assert spec.priority < host.registry.get("attention", "triton").spec.priority
    # in a fresh interpreter: other test modules of a session import the backends
    code = ("import sys; from lmkit.plugin_host.manager import PluginHost; "
            "PluginHost.load(env={'LMKIT_DISABLE_PLUGIN_AUTOLOAD': '1'}); "
            "print(sorted(m for m in sys.modules if m.startswith('lmkit_plugins.attention.mla')"
            " or m in ('triton', 'flashinfer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "['lmkit_plugins.attention.mla_options']", out


def test_an_mha_model_is_refused_with_the_reason():
    host = PluginHost.load(env=ENV)
    spec = host.registry.get("attention", "mla_triton").spec
    assert spec.caps.why_not(Needs(values={"attention_kind": "mha"})) == [
        "attention_kind mha not supported (supports: mla)"]
    assert spec.caps.why_not(Needs(values=MLA_NEEDS)) == []


def test_mla_flashinfer_claims_only_deepseeks_latent_width():
    """FlashInfer's MLA kernels exist for kv_lora_rank 512 + rope 64: a model of another
    latent width is refused before loading (and auto passes it by); mla_triton serves it."""
    host = PluginHost.load(env=ENV)
    flashinfer = host.registry.get("attention", "mla_flashinfer").spec
    triton = host.registry.get("attention", "mla_triton").spec
    other = Needs(values={**MLA_NEEDS, "head_size": 288})
    assert flashinfer.caps.why_not(other) == ["head_size 288 not supported (supports: 576)"]
    assert flashinfer.caps.why_not(Needs(values={**MLA_NEEDS, "head_size": 576})) == []
    assert triton.caps.why_not(other) == []


@needs_no_cuda
def test_asking_for_mla_triton_without_cuda_is_refused_with_the_reason():
    host = PluginHost.load(env=ENV)
    with pytest.raises(NoBackendError) as exc:
        host.registry.select("attention", "mla_triton", Needs(values=MLA_NEEDS))
    message = str(exc.value)
    assert "attention 'mla_triton'" in message and "no CUDA device" in message
    result = _run("config", "check", "--attn", "mla_triton")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "mla_triton" in result.stderr and "no CUDA device" in result.stderr


@needs_no_cuda
def test_plugins_list_shows_the_mla_backends_and_why_they_cannot_run():
    result = _run("plugins", "list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    triton_line = next(x for x in lines if " mla_triton " in x)
    flashinfer_line = next(x for x in lines if " mla_flashinfer " in x)
    assert "no CUDA device" in triton_line and "no CUDA device" in flashinfer_line
    if not module_present("flashinfer"):
        assert "missing module 'flashinfer'" in flashinfer_line
    data = json.loads(_run("plugins", "list", "--json").stdout)
    names = {s["name"] for s in data["specs"]["attention"]}
    assert {"mla_triton", "mla_flashinfer"} <= names


def test_options_are_validated():
    assert MLATritonAttentionOptions().absorbed_max_query_len == 8
    with pytest.raises(ValidationError):
        MLATritonAttentionOptions(absorbed_max_query_len=17)
    with pytest.raises(ValidationError):
        MLAFlashInferAttentionOptions(backend="cutlass")
    with pytest.raises(ValidationError):
        MLATritonAttentionOptions(workspace_mb=1)


def test_mla_flashinfer_constructs_with_its_own_options(monkeypatch):
    """mla_flashinfer subclasses mla_triton with other options; building it must not
    assume mla_triton's (an assert on them broke every DeepSeek run on flashinfer, found
    on the H100). FlashInfer itself is replaced by a recording stand-in."""
    import types

    from lmkit.testing.mla_attention import MLACase
    from lmkit_plugins.attention.mla_flashinfer import MLAFlashInferAttention

    made = []
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = lambda workspace, backend: made.append(backend)
    package = types.ModuleType("flashinfer")
    package.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    case = MLACase.of(16, (512, 128, 64, 128), 16, torch.bfloat16, torch.device("cpu"))
    options = MLAFlashInferAttentionOptions(workspace_mb=1, backend="fa2")
    backend = MLAFlashInferAttention(**case.kwargs(options))
    assert backend.options is options and made == ["fa2"]
