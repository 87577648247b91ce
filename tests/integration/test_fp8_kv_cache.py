"""``cache.kv_cache_dtype: fp8`` in the engine (CPU): the cache is allocated in float8
e4m3 and holds four times the float32 blocks in the same memory; on a model whose
argmax is decided by attention (the copy circuit: a wrong K/V read flips it) greedy
outputs follow the float32 cache's (scales 1.0 and measured) and stay the same
through cached prefixes, chunked prefill and preemption, on both CPU backends; the KV
offload tier carries FP8 blocks back intact; a checkpoint's scales are used, scales are
measured at load when asked; every way to ask for it wrongly is refused with the
reason."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from lmkit import LLM, SamplingParams
from lmkit.api import ModelBuildContext
from lmkit.api.kv_cache_spec import one_kv_cache_group
from lmkit.config import LMKitConfig, load_config
from lmkit.errors import ConfigError, ModelLoadError, NoBackendError
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack
from lmkit.testing.tiny_model import make_tiny_model
from lmkit.worker.model_build import kv_cache_groups
from lmkit_plugins.attention.torch_ref import TorchAttention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from copy_circuit_model import llama_config, write_copy_circuit_model  # noqa: E402

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def circuit_dir(tmp_path_factory):
    config = llama_config(2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=512,
                          max_positions=16384)
    return write_copy_circuit_model(tmp_path_factory.mktemp("circuit"), config, device="cpu")


def _prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(70)]  # a prefix two prompts share
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 41, 150)]
    prompts += [shared + [1, 2], shared + [3]]
    return [{"prompt_token_ids": p} for p in prompts]


def _greedy(model_dir: Path, preempted: bool = False, **engine) -> list[list[int]]:
    with LLM(str(model_dir), max_model_len=256, **engine) as llm:
        if engine.get("kv_cache_dtype") == "fp8":
            caches = llm.engine.executor.runner.kv_caches
            assert caches and all(c.dtype == FP8 for c in caches)
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), GREEDY)]
        assert (llm.stats()["num_preemptions"] > 0) == preempted
        return tokens


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of positions where two sets of greedy outputs agree."""
    pairs = [(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_fp8_cache_follows_float32_on_the_copy_circuit(circuit_dir, attention):
    want = _greedy(circuit_dir, attention=attention, num_blocks=200)
    # the circuit copies the previous token: its outputs alternate, so they test something
    assert want[1][:4] == [want[1][0], want[1][1]] * 2 and want[1][0] != want[1][1]
    # e4m3 keeps 3 mantissa bits: late in the 150-token prompt a copy may flip; a wrong
    # slot, block or scale flips nearly every one
    fp8 = _greedy(circuit_dir, attention=attention, num_blocks=200, kv_cache_dtype="fp8")
    assert _agreement(fp8, want) >= 0.9
    measured = _greedy(circuit_dir, attention=attention, num_blocks=200, kv_cache_dtype="fp8",
                       **{"cache.kv_cache_scales": "calibrate"})
    assert _agreement(measured, want) >= 0.9
    # chunked prefill (16-token budget) and preemption (a pool of 20 blocks for all five)
    # store and read the same FP8 values
    assert _greedy(circuit_dir, True, attention=attention, kv_cache_dtype="fp8",
                   num_blocks=20, max_num_batched_tokens=16) == fp8


def test_fp8_cache_holds_four_times_the_float32_blocks(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    blocks = {}
    for kv_dtype in ("auto", "fp8"):
        with LLM(str(model), kv_cache_dtype=kv_dtype, kv_cache_memory_gb=0.002) as llm:
            runner = llm.engine.executor.runner
            blocks[kv_dtype] = runner.num_blocks
            assert runner.kv_caches[0].element_size() == (1 if kv_dtype == "fp8" else 4)
    assert blocks["fp8"] == 4 * blocks["auto"]


def test_offload_tier_carries_fp8_blocks(circuit_dir):
    block, prefix_len = 16, 150
    rng = random.Random(7)
    prefixes = [[rng.randrange(256) for _ in range(prefix_len)] for _ in range(3)]
    # one prefix, two that push it out of the device pool, then the first one again
    prompts = [{"prompt_token_ids": p + [i]} for i, p in enumerate(prefixes + prefixes[:1])]
    engine = dict(kv_cache_dtype="fp8", block_size=block, num_blocks=18, max_model_len=256)
    outs = {}
    for offload in ("none", "cpu"):
        with LLM(str(circuit_dir), offload=offload, **engine,
                 **({"offload.options": {"size_gb": 0.01}} if offload == "cpu" else {})) as llm:
            results = [llm.generate([p], GREEDY)[0] for p in prompts]
            outs[offload] = [list(r.outputs[0].token_ids) for r in results]
            if offload == "cpu":
                stats = llm.stats()
                assert results[3].num_cached_tokens == prefix_len // block * block
                assert stats["offload_loaded_blocks"] >= prefix_len // block
                assert stats["offload_bytes_loaded"] == stats["offload_loaded_blocks"] * (
                    2 * 2 * block * 2 * 64)  # layers x K/V x tokens x KV heads x dims, 1 byte
    assert outs["cpu"] == outs["none"]


# ---------------------------------------------------------------- refusals


def test_an_unknown_kv_cache_dtype_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype"):
        load_config(None, {"cache.kv_cache_dtype": "int4"}, {})


def test_a_named_backend_without_fp8_kv_cache_is_refused_before_loading():
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})

    def config(attention: str) -> LMKitConfig:
        return LMKitConfig.model_validate({
            "cache": {"kv_cache_dtype": "fp8"}, "attention": {"backend": attention},
            "executor": {"device": "cpu"}})

    assert resolve_stack(config("auto"), host).names()["attention"] == "cpu"
    assert resolve_stack(config("torch"), host).names()["attention"] == "torch"
    with pytest.raises(NoBackendError, match="does not support fp8_kv_cache"):
        resolve_stack(config("mla_torch"), host)


class _NoFp8(TorchAttention):
    supports_fp8_kv_cache = False


def _backend(cls=TorchAttention, **kw):
    return cls(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25, dtype=torch.float32,
               device=torch.device("cpu"), block_size=16, **kw)


def test_a_backend_without_fp8_support_refuses_the_dtype_when_built():
    with pytest.raises(ValueError, match="_NoFp8 cannot store its KV cache in torch.float8"):
        _backend(_NoFp8, kv_cache_dtype=FP8)
    assert not _backend(_NoFp8).fp8_kv_cache  # the model's dtype: fine
    built = _backend(kv_cache_dtype=FP8)
    assert built.fp8_kv_cache and (built.k_scale, built.v_scale) == (1.0, 1.0)


def test_page_bytes_and_model_written_kv_follow_the_cache_dtype():
    plain = one_kv_cache_group(_backend(), 2)[0]
    fp8 = one_kv_cache_group(_backend(kv_cache_dtype=FP8), 2)[0]
    assert plain.page_bytes == 4 * fp8.page_bytes == 2 * 16 * 2 * 16 * 4

    class Writes(TorchAttention):
        supports_model_kv_write = True

    def ctx(kv_dtype):
        return ModelBuildContext(dtype=torch.bfloat16, device=torch.device("cpu"),
                                 block_size=16, attention_cls=Writes, kv_cache_dtype=kv_dtype)

    assert ctx(None).model_may_write_kv() and ctx(torch.bfloat16).model_may_write_kv()
    assert not ctx(FP8).model_may_write_kv()  # the backend quantizes what it writes


def test_a_model_that_does_not_pass_the_kv_cache_dtype_is_refused():
    class Forgetful:  # builds its backend without kv_cache_dtype
        def kv_cache_groups(self, num_layers):
            return one_kv_cache_group(_backend(), num_layers)

    assert kv_cache_groups(Forgetful(), None, 2)  # nothing asked: fine
    with pytest.raises(ModelLoadError, match="Forgetful built its attention backend with "
                                             "torch.float32.*kv_cache_dtype=ctx.kv_cache_dtype"):
        kv_cache_groups(Forgetful(), None, 2, FP8)



# ---------------------------------------------------------------- checkpoint scales


def _save_scales(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(directory / "kv_scales.safetensors"))


def test_checkpoint_kv_scales_are_read_in_both_layouts(tmp_path):
    from lmkit.loading.kv_scales import read_kv_scales

    assert read_kv_scales(tmp_path) == {}  # no checkpoint: no scales
    _save_scales(tmp_path, {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        # the older layout, one scale per KV head: the largest is used
        "model.layers.3.self_attn.k_proj.output_scale": torch.tensor([0.1, 0.3]),
        "model.layers.3.self_attn.v_proj.output_scale": torch.tensor([0.2, 0.05]),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2)})
    got = read_kv_scales(tmp_path)
    assert got.keys() == {0, 3} and got[0] == (0.5, 0.25)
    assert got[3] == pytest.approx((0.3, 0.2))
    _save_scales(tmp_path, {"model.layers.1.self_attn.k_scale": torch.tensor(0.5)})
    with pytest.raises(ModelLoadError, match="layer 1 have a key or a value scale but not"):
        read_kv_scales(tmp_path)
    _save_scales(tmp_path, {"model.layers.1.self_attn.k_scale": torch.tensor(-1.0),
                            "model.layers.1.self_attn.v_scale": torch.tensor(1.0)})
    with pytest.raises(ModelLoadError, match="k_scale is -1.0; scales must be positive"):
        read_kv_scales(tmp_path)


def test_fp8_cache_uses_the_checkpoints_scales_per_layer(circuit_dir, tmp_path):
    import shutil

    model = Path(shutil.copytree(circuit_dir, tmp_path / "scaled"))
    scales = {0: (0.5, 0.25), 1: (2.0, 1.0)}
    _save_scales(model, {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(s)
                         for i, pair in scales.items() for kv, s in zip("kv", pair, strict=True)})
    want = _greedy(circuit_dir, attention="torch", num_blocks=200)
    with LLM(str(model), attention="torch", num_blocks=200, max_model_len=256,
             kv_cache_dtype="fp8") as llm:
        attn = llm.engine.executor.runner.model.attn
        assert attn.layer_kv_scales == scales
        assert attn.kv_scales(1) == (2.0, 1.0) and attn.kv_scales(5) == (1.0, 1.0)
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), GREEDY)]
        assert _agreement(tokens, want) >= 0.9
    # a bf16/float32 cache loads the same checkpoint and leaves its scales alone
    assert _greedy(model, attention="torch", num_blocks=200) == want


def test_scales_come_from_the_checkpoint_or_are_measured_when_asked(circuit_dir, tmp_path):
    import shutil

    def layer_scales(model, **engine):
        with LLM(str(model), attention="torch", num_blocks=200, max_model_len=256,
                 kv_cache_dtype="fp8", **engine) as llm:
            attn = llm.engine.executor.runner.model.attn
            tokens = [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), GREEDY)]
            return dict(attn.layer_kv_scales), tokens

    def mode(name):
        return {"cache.kv_cache_scales": name}

    want = _greedy(circuit_dir, attention="torch", num_blocks=200)
    assert layer_scales(circuit_dir)[0] == {}  # auto, none in the checkpoint: 1.0
    measured, tokens = layer_scales(circuit_dir, **mode("calibrate"))
    assert measured.keys() == {0, 1} and _agreement(tokens, want) >= 0.9
    assert all(0 < s != 1.0 for pair in measured.values() for s in pair)
    assert layer_scales(circuit_dir, **mode("calibrate"))[0] == measured  # deterministic
    model = Path(shutil.copytree(circuit_dir, tmp_path / "scaled"))
    _save_scales(model, {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.5)
                         for i in range(2) for kv in "kv"})
    assert layer_scales(model)[0] == {0: (0.5, 0.5), 1: (0.5, 0.5)}
    assert layer_scales(model, **mode("calibrate"))[0] == measured
    assert layer_scales(model, **mode("none"))[0] == {}
