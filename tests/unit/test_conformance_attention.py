"""The attention conformance suite: the torch reference passes it through the pytest
base class; deliberately broken backends fail it with the property and input named."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from lmkit.api import Caps, Spec
from lmkit.plugin_host.manager import PluginHost
from lmkit.testing import ConformanceFailure
from lmkit.testing.attention import AttentionConformance, check_attention_backend
from lmkit_plugins.attention.torch_ref import TorchAttention

CPU_CAPS = Caps({"prefix_caching", "chunked_prefill", "multi_token_query", "sliding_window"},
                {"device": {"cpu"}, "dtype": {"float32"}})


class TestTorchReference(AttentionConformance):
    @pytest.fixture
    def attention_backend(self):
        host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
        return host.registry.get("attention", "torch")


class DropsCachedPrefix(TorchAttention):
    """Writes the cache but attends only to the tokens of the current step."""

    def plan(self, metadata):
        super().plan(metadata)
        self._qsl = metadata.query_start_loc_cpu.tolist()

    def run(self, layer, q, k, v, kv_cache):
        super().run(layer, q, k, v, kv_cache)
        out, group = torch.empty_like(q), self.num_heads // self.num_kv_heads
        for a, b in zip(self._qsl, self._qsl[1:], strict=False):
            qq = q[a:b].transpose(0, 1)
            kk = k[a:b].repeat_interleave(group, 1).transpose(0, 1)
            vv = v[a:b].repeat_interleave(group, 1).transpose(0, 1)
            out[a:b] = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                      scale=self.scale).transpose(0, 1)
        return out


class InterleavedGQA(TorchAttention):
    """Maps query head h to KV head h % num_kv_heads instead of h // group."""

    def run(self, layer, q, k, v, kv_cache):
        n, hkv, d = q.shape[0], self.num_kv_heads, self.head_size
        g = self.num_heads // hkv
        regrouped = q.view(n, g, hkv, d).transpose(1, 2).reshape(n, self.num_heads, d)
        out = super().run(layer, regrouped, k, v, kv_cache)
        return out.view(n, hkv, g, d).transpose(1, 2).reshape(n, self.num_heads, d)


class IgnoresWindow(TorchAttention):
    """Claims sliding_window but attends to the whole context."""

    def __init__(self, **kwargs):
        kwargs["sliding_window"] = None
        super().__init__(**kwargs)


class WritesKVItself(TorchAttention):
    """Opts in to model-written K/V: ``run(..., kv_written=True)`` skips the write."""

    supports_model_kv_write = True

    def kv_write_slots(self):
        return self._plan.slot_mapping

    def run(self, layer, q, k, v, kv_cache, *, kv_written=False):
        if not kv_written:
            return super().run(layer, q, k, v, kv_cache)
        slots, flat = self._plan.slot_mapping, kv_cache.view(2, -1, *k.shape[1:])
        saved = flat[:, slots].clone()
        out = super().run(layer, q, k, v, kv_cache)  # rewrites the same values
        assert torch.equal(flat[:, slots], saved), "the model's K/V were not in the cache"
        return out


class OffByOneSlots(WritesKVItself):
    """Hands the model slots one past the ones its kernels read."""

    def kv_write_slots(self):
        return self._plan.slot_mapping + 1


def spec(cls, caps=CPU_CAPS):
    return Spec(name=cls.__name__.lower(), target=lambda: cls, caps=caps)


def test_torch_reference_passes_every_applicable_property():
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    results = check_attention_backend(host.registry.get("attention", "torch"))
    assert results["prefill over a cached prefix"] == "passed"
    assert results["dtypes"] == "passed"
    assert results["logits soft cap"] == "passed"
    assert results["cuda graphs"].startswith("not applicable")
    assert results["in-place decode metadata"].startswith("not applicable")


def test_a_backend_that_drops_the_cached_prefix_fails_with_the_input():
    s = spec(DropsCachedPrefix)
    assert check_attention_backend(s, only=["prefill"]) == {"prefill": "passed"}
    with pytest.raises(ConformanceFailure) as exc:
        check_attention_backend(s, only=["prefill over a cached prefix"])
    msg = str(exc.value)
    assert "'dropscachedprefix' fails property 'prefill over a cached prefix'" in msg
    assert "heads 8/2 (query/kv), head_size 64, block_size 16, float32 on cpu" in msg
    assert "step 2 (prefills over cached prefixes): [req 1: context 32, query 9" in msg
    assert "max abs error" in msg


def test_wrong_gqa_head_mapping_fails_but_mha_and_mqa_pass():
    s = spec(InterleavedGQA)
    with pytest.raises(ConformanceFailure, match="(?s)fails property 'decode'.*heads 8/2.*head 1"):
        check_attention_backend(s, only=["decode"])
    with pytest.raises(ConformanceFailure, match="heads 8/2") as exc:
        check_attention_backend(s, only=["GQA and head sizes"])
    assert "heads 4/4" not in str(exc.value)  # MHA ran first and passed


def test_a_claimed_feature_that_is_ignored_fails():
    with pytest.raises(ConformanceFailure, match="fails property 'sliding window'"):
        check_attention_backend(spec(IgnoresWindow), only=["sliding window"])


def test_an_unclaimed_feature_must_be_refused():
    caps = Caps({"prefix_caching", "chunked_prefill"}, {"device": {"cpu"}, "dtype": {"float32"}})
    with pytest.raises(ConformanceFailure, match="does not claim 'sliding_window', yet"):
        check_attention_backend(spec(TorchAttention, caps), only=["unclaimed features refused"])
    results = check_attention_backend(spec(TorchAttention, caps), only=[
        "sliding window", "multi-token decode queries", "prefill over a cached prefix"])
    assert results["prefill over a cached prefix"] == "passed"
    assert results["sliding window"] == "not applicable: torchattention does not claim " \
        "'sliding_window'"
    assert results["multi-token decode queries"].startswith("not applicable")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine case")
def test_a_cuda_only_backend_is_not_applicable_on_cpu():
    cuda_only = Caps({"prefix_caching"}, {"device": {"cuda"}, "dtype": {"bfloat16"}})
    results = check_attention_backend(spec(TorchAttention, cuda_only))
    assert results["prefill"] == ("not applicable: torchattention runs on cuda only and this "
                                  "machine has no CUDA device")
    assert all(r.startswith("not applicable") for r in results.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["triton", "flashinfer", "flash_attn"])
def test_gpu_backends_pass_including_cuda_graph_replay(name):
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    reg = host.registry.get("attention", name)
    if reg.spec.unavailable_reasons():
        pytest.skip("; ".join(reg.spec.unavailable_reasons()))
    results = check_attention_backend(reg)
    assert results["cuda graphs"] == "passed"
    in_place = results["in-place decode metadata"]  # triton declares it
    if reg.spec.load().supports_in_place_decode_metadata:
        assert in_place == "passed"
    else:
        assert in_place.startswith("not applicable")
    assert results["prefill over a cached prefix"] == "passed"
    if name == "flashinfer":
        assert results["logits soft cap"] == "passed"
    if name == "flash_attn":  # claims every feature the suite checks but these two
        assert [p for p, r in results.items() if r != "passed"] == [
            "logits soft cap", "tree mask"], results
    if name == "triton":
        assert results["tree mask"] == "passed"


def test_model_written_kv_is_checked_for_backends_that_opt_in():
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    torch_ref = check_attention_backend(host.registry.get("attention", "torch"),
                                        only=["model-written K/V"])
    assert torch_ref == {"model-written K/V": "not applicable: torch does not declare "
                                              "supports_model_kv_write"}
    assert check_attention_backend(spec(WritesKVItself), only=["model-written K/V"]) == {
        "model-written K/V": "passed"}
    with pytest.raises(ConformanceFailure, match="(?s)fails property 'model-written K/V'.*"
                                                 "differs from the step's slot_mapping"):
        check_attention_backend(spec(OffByOneSlots), only=["model-written K/V"])


def test_a_backend_that_cannot_soft_cap_refuses_a_cap():
    # cpu's C decode kernel does not soft-cap: it claims no logits_soft_cap and raises
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    results = check_attention_backend(host.registry.get("attention", "cpu"), only=[
        "unclaimed features refused", "logits soft cap"])
    assert results["unclaimed features refused"] == "passed"
    assert results["logits soft cap"].startswith("not applicable")
    caps = Caps({"sliding_window"}, {"device": {"cpu"}, "dtype": {"float32"}})
    with pytest.raises(ConformanceFailure, match="does not claim 'logits_soft_cap', yet"):
        check_attention_backend(spec(TorchAttention, caps), only=["unclaimed features refused"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_place_decode_metadata_catches_a_plan_that_copies_its_buffers():
    """A backend declaring ``supports_in_place_decode_metadata`` whose plan keeps a copy
    of ``seq_lens`` (so a graph replayed without a new plan attends over stale context
    lengths) fails the property; the real triton backend passes it (above)."""
    from dataclasses import replace

    from lmkit_plugins.attention.triton_backend import TritonAttention

    class StaleTriton(TritonAttention):
        def plan(self, metadata):
            super().plan(metadata)
            self._plan = replace(self._plan, seq_lens=self._plan.seq_lens.clone())

    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    reg = host.registry.get("attention", "triton")
    if reg.spec.unavailable_reasons():
        pytest.skip("; ".join(reg.spec.unavailable_reasons()))
    spec = Spec(name="stale_triton", target=lambda: StaleTriton, options=reg.spec.options,
                caps=reg.spec.caps)
    with pytest.raises(ConformanceFailure, match="in-place decode metadata"):
        check_attention_backend(spec, only=["in-place decode metadata"])


FP8_CAPS = Caps({"prefix_caching", "chunked_prefill", "fp8_kv_cache"},
                {"device": {"cpu"}, "dtype": {"float32", "bfloat16"}})


class IgnoresValueScale(TorchAttention):
    """Stores an FP8 cache but reads values back without their scale."""

    def _attend(self, g, q, kv_cache, scales=(1.0, 1.0)):
        return super()._attend(g, q, kv_cache, (scales[0], 1.0))


class ClaimsFp8Only(TorchAttention):
    supports_fp8_kv_cache = False


def test_fp8_kv_cache_property_passes_the_reference_and_fails_a_lost_scale():
    assert check_attention_backend(spec(TorchAttention, FP8_CAPS), only=["fp8 KV cache"]) == {
        "fp8 KV cache": "passed"}
    with pytest.raises(ConformanceFailure, match="(?s)fails property 'fp8 KV cache'.*"
                                                 "float8_e4m3fn cache with scales"):
        check_attention_backend(spec(IgnoresValueScale, FP8_CAPS), only=["fp8 KV cache"])
    with pytest.raises(ConformanceFailure, match="does not declare supports_fp8_kv_cache"):
        check_attention_backend(spec(ClaimsFp8Only, FP8_CAPS), only=["fp8 KV cache"])
    # claimed nowhere: the class must refuse the dtype (the base constructor does)
    caps = Caps({"sliding_window", "logits_soft_cap"}, {"device": {"cpu"}, "dtype": {"float32"}})
    assert check_attention_backend(spec(ClaimsFp8Only, caps), only=[
        "unclaimed features refused"]) == {"unclaimed features refused": "passed"}
    with pytest.raises(ConformanceFailure, match="does not claim 'fp8_kv_cache', yet"):
        check_attention_backend(spec(TorchAttention, caps), only=["unclaimed features refused"])


TREE_CAPS = Caps({"multi_token_query", "tree_mask"}, {"device": {"cpu"}, "dtype": {"float32"}})


class IgnoresTreeMask(TorchAttention):
    """Declares trees but plans every step causally (drops the tree metadata)."""

    def plan(self, metadata):
        super().plan(replace(metadata, tree_region=None, tree_region_cpu=None, tree_mask=None))


class ClaimsTreesOnly(TorchAttention):
    supports_tree_mask = False


class ReadsOnlyTheStepsTree(TorchAttention):
    """Builds tree masks as if the region held only the step's own tokens."""

    def plan(self, metadata):
        md = metadata
        if md.tree_region_cpu is not None:
            q_lens = md.query_start_loc_cpu[1:] - md.query_start_loc_cpu[:-1]
            shrunk = torch.minimum(md.tree_region_cpu, q_lens.to(torch.int32))
            md = replace(md, tree_region=shrunk, tree_region_cpu=shrunk)
        super().plan(md)


def test_tree_mask_property_runs_for_torch_and_cpu():
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    for name in ("torch", "cpu"):  # (cpu: tree steps of single-token queries too)
        reg = host.registry.get("attention", name)
        assert "tree_mask" in reg.spec.caps.features
        assert check_attention_backend(reg, only=["tree mask"]) == {"tree mask": "passed"}
    unclaimed = check_attention_backend(spec(TorchAttention), only=["tree mask"])
    assert unclaimed == {"tree mask": "not applicable: torchattention does not claim "
                                      "'tree_mask'"}


def test_a_backend_that_ignores_the_tree_fails_the_tree_mask_property():
    with pytest.raises(ConformanceFailure, match="(?s)fails property 'tree mask'.*"
                                                 r"step 2 \(verify trees\).*region 64"):
        check_attention_backend(spec(IgnoresTreeMask, TREE_CAPS), only=["tree mask"])
    with pytest.raises(ConformanceFailure, match="(?s)fails property 'tree mask'.*"
                                                 r"step 3 \(draft the next level\)"):
        check_attention_backend(spec(ReadsOnlyTheStepsTree, TREE_CAPS), only=["tree mask"])
    with pytest.raises(ConformanceFailure, match="does not declare supports_tree_mask"):
        check_attention_backend(spec(ClaimsTreesOnly, TREE_CAPS), only=["tree mask"])


def _tree_metadata(device="cpu"):
    """A one-request step of two tree nodes over a context of three keys."""
    from lmkit.api import AttentionMetadata

    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        num_reqs=1, num_actual_tokens=2, max_query_len=2, max_seq_len=5,
        query_start_loc=torch.tensor([0, 2], **i32), seq_lens=torch.tensor([5], **i32),
        block_tables=torch.tensor([[1]], **i32),
        slot_mapping=torch.tensor([19, 20], dtype=torch.int64, device=device),
        query_start_loc_cpu=torch.tensor([0, 2], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([5], dtype=torch.int32),
        tree_region=torch.tensor([2], **i32), tree_region_cpu=torch.tensor([2], dtype=torch.int32),
        tree_mask=torch.tensor([1, 3], dtype=torch.int64, device=device))


def test_backends_without_tree_support_refuse_a_tree_step():
    """A backend that does not declare ``supports_tree_mask`` raises when planned with
    tree metadata instead of attending causally: the reference's subclasses (mla_torch
    among them) through its plan, the CUDA backends first thing in theirs."""
    import importlib

    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    md = _tree_metadata()
    kwargs = dict(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25, dtype=torch.float32,
                  device=torch.device("cpu"), block_size=16)
    with pytest.raises(ValueError, match="ClaimsTreesOnly cannot attend draft trees"):
        ClaimsTreesOnly(**kwargs).plan(md)
    mla = host.registry.get("attention", "mla_torch").spec.load()
    assert "tree_mask" not in host.registry.get("attention", "mla_torch").spec.caps.features
    backend = mla(num_heads=4, num_kv_heads=1, head_size=80, scale=0.1, dtype=torch.float32,
                  device=torch.device("cpu"), block_size=16, kv_lora_rank=64,
                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    with pytest.raises(ValueError, match="MLATorchAttention cannot attend draft trees"):
        backend.plan(md)
    for name, target in (("flashinfer", "flashinfer_backend:FlashInferAttention"),
                         ("flash_attn", "flash_attn_backend:FlashAttnAttention"),
                         ("mla_triton", "mla_triton:MLATritonAttention"),
                         ("mla_flashinfer", "mla_flashinfer:MLAFlashInferAttention")):
        assert "tree_mask" not in host.registry.get("attention", name).spec.caps.features
        module, cls_name = target.split(":")
        try:
            cls = getattr(importlib.import_module(f"lmkit_plugins.attention.{module}"),
                          cls_name)
        except ImportError:
            continue  # (its library is missing here: it is never built either)
        assert not cls.supports_tree_mask
        with pytest.raises(ValueError, match="cannot attend draft trees"):
            cls.plan(object.__new__(cls), md)  # refused before any state is read
    TorchAttention(**kwargs).plan(md)  # the reference takes it


def test_tree_metadata_that_breaks_the_contract_is_refused():
    kwargs = dict(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25, dtype=torch.float32,
                  device=torch.device("cpu"), block_size=16)
    md = _tree_metadata()
    for region in (1, 65, 6):  # shorter than the query, above MAX_TREE_REGION, the context
        r = torch.tensor([region], dtype=torch.int32)
        with pytest.raises(ValueError, match=f"request 0: tree region {region} does not fit"):
            TorchAttention(**kwargs).plan(replace(md, tree_region=r, tree_region_cpu=r))
    with pytest.raises(ValueError, match="not tree_region and tree_region_cpu"):
        TorchAttention(**kwargs).plan(replace(md, tree_region_cpu=None))
