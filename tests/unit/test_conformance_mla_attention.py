"""The MLA attention conformance suite: mla_torch passes it through the pytest base
class; deliberately broken MLA backends fail it with the property and input named."""

from __future__ import annotations

import pytest
import torch
from lmkit.api import Caps, Spec
from lmkit.plugin_host.manager import PluginHost
from lmkit.testing import ConformanceFailure
from lmkit.testing.mla_attention import (
    MLAAttentionConformance,
    MLACase,
    check_mla_attention_backend,
    dense_mla,
)
from lmkit_plugins.attention.mla_torch import MLATorchAttention

CPU_CAPS = Caps({"prefix_caching", "chunked_prefill", "multi_token_query"},
                {"device": {"cpu"}, "dtype": {"float32"}, "attention_kind": {"mla"}})


class TestMLATorchReference(MLAAttentionConformance):
    @pytest.fixture
    def attention_backend(self):
        host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
        return host.registry.get("attention", "mla_torch")


def _spec(cls: type) -> Spec:
    return Spec(name="broken", target=lambda: cls, caps=CPU_CAPS)


class IgnoresScale(MLATorchAttention):
    """Uses 1/sqrt(qk head dim) instead of the scale it was given."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5


class DropsRopeInDecode(MLATorchAttention):
    """The absorbed decode path forgets q_pe . k_pe."""

    def _attend_absorbed(self, g, q_nope, q_pe, kv_cache, w):
        return super()._attend_absorbed(g, q_nope, torch.zeros_like(q_pe), kv_cache, w)


class CachesFirstLayerWeight(MLATorchAttention):
    """Keeps the first kv_b_proj weight it sees for every layer."""

    def run_mla(self, layer, q_nope, q_pe, kv_c, k_pe, kv_cache, w_kv_b):
        self._w = getattr(self, "_w", w_kv_b)
        return super().run_mla(layer, q_nope, q_pe, kv_c, k_pe, kv_cache, self._w)


@pytest.mark.parametrize(("cls", "prop"), [
    (IgnoresScale, "prefill"),
    (DropsRopeInDecode, "decode"),
    (CachesFirstLayerWeight, "prefill"),
])
def test_broken_backends_fail_with_the_property_named(cls, prop):
    with pytest.raises(ConformanceFailure) as e:
        check_mla_attention_backend(_spec(cls), only=[prop])
    assert e.value.prop == prop and "broken" in str(e.value)


def test_absorbed_and_decompressed_forms_agree():
    """The same decode step through the absorbed path and the decompressed one."""
    case = MLACase.of(4, (64, 32, 16, 32), 16, torch.float64, torch.device("cpu"))
    backend = MLATorchAttention(**case.kwargs(None))
    gen = torch.Generator().manual_seed(0)
    kv_c, k_pe = torch.randn(20, 64, generator=gen, dtype=torch.float64), \
        torch.randn(20, 16, generator=gen, dtype=torch.float64)
    q_nope = torch.randn(1, 4, 32, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(1, 4, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(4 * 64, 64, generator=gen, dtype=torch.float64) / 8
    ref = dense_mla(q_nope, q_pe, kv_c, k_pe, w, 19, case.scale)
    from lmkit.testing.attention_world import _Req
    from lmkit.testing.mla_attention import MLAWorld
    world = MLAWorld(backend, case, 8)
    world.reqs[0] = _Req(torch.zeros(19, 1), torch.zeros(19, 1))
    world._ensure_blocks(world.reqs[0], 20)
    blocks = world.reqs[0].blocks
    for p in range(19):
        world.cache.view(-1, 80)[blocks[p // 16] * 16 + p % 16] = torch.cat((kv_c[p], k_pe[p]))
    backend.plan(world.metadata([(0, 1)], {0: 19}))
    absorbed = backend.run_mla(0, q_nope, q_pe, kv_c[19:], k_pe[19:], world.cache, w)
    group = backend._plan.groups[0]
    w3 = w.view(4, 64, 64)
    decompressed = backend._attend_decompressed(group, q_nope, q_pe, world.cache, w3)
    torch.testing.assert_close(absorbed, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(decompressed, ref, rtol=1e-10, atol=1e-10)


def test_mla_torch_refuses_a_sliding_window_and_wrong_widths():
    kwargs = MLACase.of(4, (64, 32, 16, 32), 16, torch.float32, torch.device("cpu")).kwargs(None)
    with pytest.raises(ValueError, match="sliding window"):
        MLATorchAttention(**{**kwargs, "sliding_window": 8})
    with pytest.raises(ValueError, match="kv_lora_rank \\+ qk_rope_head_dim = 80"):
        MLATorchAttention(**{**kwargs, "head_size": 64})
    with pytest.raises(TypeError, match="run_mla"):
        MLATorchAttention(**kwargs).run(0, None, None, None, None)
