"""The ``fp8`` method in the stack and in the engine, on the CPU.

The registered ``fp8`` runs on CUDA only; this module also registers it for the CPU
as ``fp8_cpu`` (a test plugin, ``plugins=[__name__]``: ``device: cpu``, float32
allowed), where its layers compute with the torch references of the two kernels. So
the whole path runs here: ``auto`` choosing it for an FP8 checkpoint (and not for a
dense one), option and dtype errors, and a tiny model's greedy tokens equal to the
dense model carrying the dequantized FP8 weights (decode-sized steps: the weight-only
product). The compiled kernels are checked on the GPU (tests/gpu/test_fp8_gpu.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from lmkit import LLM, SamplingParams  # noqa: E402
from lmkit.api import ConfigError, ModelLoadError, hookimpl  # noqa: E402
from lmkit.config import LMKitConfig  # noqa: E402
from lmkit.loading.model_facts import load_model_facts  # noqa: E402
from lmkit.plugin_host.manager import PluginHost  # noqa: E402
from lmkit.plugin_host.resolve import ResolvedStack, resolve_stack  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402
from lmkit.worker.model_build import quantization_method  # noqa: E402
from lmkit_plugins import models as builtin_models  # noqa: E402
from lmkit_plugins.quantization.fp8_write import (  # noqa: E402
    write_dequantized,
    write_fp8_checkpoint,
)

LMKIT_PLUGIN_API = ">=1.0,<2"
CPU_NAME = "fp8_cpu"
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _fp8_spec():
    specs: list = []
    builtin_models.register_quantization_methods(specs.append)
    return next(s for s in specs if s.name == "fp8")


@hookimpl
def register_quantization_methods(register):
    spec = _fp8_spec()
    caps = dataclasses.replace(spec.caps, values={
        **spec.caps.values, "device": {"cpu"}, "dtype": {"float32", "bfloat16", "float16"}})
    register(dataclasses.replace(spec, name=CPU_NAME, needs_cuda=False, caps=caps))


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.load([__name__], env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fp8-engine") / "dense", vocab_size=320)


def _config(backend: str, device: str = "cpu", **options) -> LMKitConfig:
    cfg = LMKitConfig()
    cfg.executor.device = device
    cfg.quantization.backend = backend
    cfg.quantization.options = options
    return cfg


def test_the_spec_declares_formats_devices_dtypes_and_kernels(host):
    spec = host.registry.get("quantization", "fp8").spec
    assert spec.needs_cuda and spec.caps.values["device"] == {"cuda"}
    assert spec.caps.values["weight_format"] == {"safetensors", "compressed-tensors", "fp8"}
    assert spec.caps.values["dtype"] == {"bfloat16", "float16"}
    assert {"F8_E4M3", "kernel:fp8_gemv_triton", "kernel:scaled_mm_rowwise"} <= spec.caps.features


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_auto_picks_the_method_for_a_declared_fp8_checkpoint(host, fmt):
    assert resolve_stack(_config("auto"), host, weight_format=fmt).names()[
        "quantization"] == CPU_NAME


def test_auto_leaves_a_dense_checkpoint_dense_but_a_named_method_quantizes_it(host):
    assert resolve_stack(_config("auto"), host, weight_format="safetensors").get(
        "quantization") is None
    assert resolve_stack(_config(CPU_NAME), host, weight_format="safetensors").names()[
        "quantization"] == CPU_NAME


def test_fp8_on_the_cpu_is_refused_with_what_to_use(host):
    with pytest.raises(ConfigError, match=r"--quantization fp8 runs FP8 e4m3 weights on CUDA "
                                          r"GPUs .* use --quantization gguf .* or none"):
        host.hook.configure(config=_config("fp8"))
    with pytest.raises(ConfigError, match=r"quantization 'fp8'.*device cpu not supported"):
        resolve_stack(_config("fp8"), host, weight_format="safetensors")


@pytest.mark.parametrize("options,pattern", [
    ({"gemv_max_rows": 17}, r"gemv_max_rows.*less than or equal to 16"),
    ({"gemv_block_k": 100}, r"gemv_block_k.*power of two from 64 to 4096, got 100"),
    ({"gemv_block_n": 8}, r"gemv_block_n.*must be 16, 32 or 64, got 8"),
    ({"gemv_num_warps": 6}, r"gemv_num_warps.*must be 4 or 8, got 6"),
    ({"gemv_num_stages": 0}, r"gemv_num_stages.*greater than or equal to 1"),
    ({"block": 1}, r"options.block: unknown field; known fields: gemv_max_rows, gemv_block_n, "
                    r"gemv_block_k, gemv_num_warps, gemv_num_stages, gemv_row_kernel, "
                    r"gemv_row_tiles"),
    ({"gemv_row_tiles": [16, 300, 4]}, r"gemv_row_tiles.*block_k must be a power of two up "
                                       r"to 4096, got 300"),
    ({"gemv_row_tiles": [16, 512, 2]}, r"gemv_row_tiles.*warps must be 4 or 8, got 2"),
    ({"gemv_row_fold_block_n": 24}, r"gemv_row_fold_block_n.*must be a power of two up to "
                                     r"256, got 24"),
    ({"gemv_row_pipeline": True, "gemv_row_kernel": False},
     r"gemv_row_pipeline is an option of the one-row kernel, which gemv_row_kernel=false "
     r"turns off; set gemv_row_kernel to true or drop gemv_row_pipeline"),
])
def test_option_errors(host, options, pattern):
    with pytest.raises(ConfigError, match=r"invalid options for quantization 'fp8_cpu'[\s\S]*"
                                          + pattern):
        resolve_stack(_config(CPU_NAME, **options), host, weight_format="fp8")


def test_model_dtypes_the_methods_do_not_compute_in_are_refused(host, dense):
    facts = load_model_facts(dense, host)
    fp8 = ResolvedStack("cuda", "float32", {"quantization": host.registry.get(
        "quantization", "fp8")}, {"quantization": None})
    with pytest.raises(ModelLoadError, match=r"quantization 'fp8' computes in bfloat16 or "
                                             r"float16 but the model dtype is float32; use "
                                             r"--dtype bfloat16, or --quantization none"):
        quantization_method(fp8, facts)
    gguf = ResolvedStack("cpu", "bfloat16", {"quantization": host.registry.get(
        "quantization", "gguf")}, {"quantization": None})
    with pytest.raises(ModelLoadError, match=r"'gguf' computes in float32 but the model dtype "
                                             r"is bfloat16; use --dtype float32 \(or auto"):
        quantization_method(gguf, facts)


def test_quantized_checkpoints_without_a_method_are_refused(host, dense, tmp_path):
    fp8 = write_fp8_checkpoint(dense, tmp_path / "fp8", "compressed-tensors", "channel")
    none = ResolvedStack("cpu", "float32", {"quantization": None}, {"quantization": None})
    with pytest.raises(ModelLoadError, match=r"holds quantized weights \(compressed-tensors, "
                                             r"declared by config.json's quantization_config\)"
                                             r".*use --quantization auto"):
        quantization_method(none, load_model_facts(fp8, host))
    assert quantization_method(none, load_model_facts(dense, host)) is None


def _greedy(model_dir: Path, quantization: str) -> tuple[str | None, list[list[int]]]:
    """The method the engine chose, and its greedy tokens."""
    prompts = [[5, 17, 42, 99, 7], [250, 3, 3, 8]]  # 9 prefill rows, 2 per decode step
    with LLM(str(model_dir), dtype="float32", attention="torch", device="cpu",
             plugins=[__name__], quantization=quantization) as llm:
        used = llm.engine.stack.names()["quantization"]
        outs = llm.generate(prompts, PARAMS)
    return used, [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow  # two engines per case: about 10 s here
@pytest.mark.parametrize("layout", ["dense", "compressed-tensors"])
def test_greedy_tokens_equal_the_dequantized_dense_model(dense, tmp_path, layout):
    """A dense checkpoint quantized at load (named method) and a compressed-tensors one
    (``auto``) give the tokens of the dense model holding their dequantized weights."""
    if layout == "dense":
        model, choice = dense, CPU_NAME
    else:
        model = write_fp8_checkpoint(dense, tmp_path / "fp8", "compressed-tensors", "channel")
        choice = "auto"
    reference = write_dequantized(model, tmp_path / "dequantized")
    used, got = _greedy(model, choice)
    assert used == CPU_NAME
    assert _greedy(reference, "none") == (None, got)
