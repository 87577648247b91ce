"""KV cache specs and groups: grouping layers by spec, page bytes from the backend's
layout, memory summed over groups, per-layer cache shapes, the checks on a model's
groups, and what the specs need of the attention backend."""

from __future__ import annotations

import pytest
import torch
from lmkit.api import (
    FullAttentionSpec,
    KVCacheGroup,
    MLALatentSpec,
    SlidingWindowSpec,
    build_kv_cache_groups,
)
from lmkit.api.kv_cache_spec import check_kv_cache_groups, spec_of_backend, specs_needs
from lmkit.errors import ModelLoadError
from lmkit.loading.model_facts import kv_specs_needs
from lmkit.worker import memory
from lmkit_plugins.attention.torch_ref import TorchAttention


def _backend(window: int | None = None, dtype: torch.dtype = torch.float32,
             head_size: int = 8) -> TorchAttention:
    return TorchAttention(num_heads=4, num_kv_heads=2, head_size=head_size, scale=0.5,
                          dtype=dtype, device=torch.device("cpu"), block_size=4,
                          sliding_window=window)


def test_equal_specs_form_one_group_in_first_layer_order():
    specs = [FullAttentionSpec(), SlidingWindowSpec(window=8), FullAttentionSpec(),
             SlidingWindowSpec(window=8), SlidingWindowSpec(window=4)]
    made = []

    def make(spec):
        made.append(spec)
        return _backend(spec.window if isinstance(spec, SlidingWindowSpec) else None)

    groups = build_kv_cache_groups(specs, make)
    assert [g.layers for g in groups] == [(0, 2), (1, 3), (4,)]
    assert made == [FullAttentionSpec(), SlidingWindowSpec(window=8), SlidingWindowSpec(window=4)]
    assert groups[1].attn.sliding_window == 8 and groups[0].attn.sliding_window is None
    check_kv_cache_groups(groups, 5)


def test_page_bytes_come_from_the_backend_shape_and_dtype():
    full = KVCacheGroup(FullAttentionSpec(), (0, 1, 2), _backend())
    # [2, 1 block, 4 tokens, 2 kv heads, 8] float32
    assert full.page_bytes == 2 * 4 * 2 * 8 * 4
    assert full.bytes_per_block == 3 * full.page_bytes
    half = KVCacheGroup(SlidingWindowSpec(window=3), (3,), _backend(3, torch.bfloat16, 16))
    assert half.page_bytes == 2 * 4 * 2 * 16 * 2
    assert memory.kv_bytes_per_block([full, half]) == 3 * 512 + 512


def test_allocation_gives_each_layer_its_groups_layout():
    groups = (KVCacheGroup(FullAttentionSpec(), (0, 2), _backend()),
              KVCacheGroup(SlidingWindowSpec(window=3), (1,), _backend(3, torch.bfloat16, 16)))
    caches = memory.allocate_kv_caches(groups, 5, torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [(2, 5, 4, 2, 8), (2, 5, 4, 2, 16),
                                                (2, 5, 4, 2, 8)]
    assert [c.dtype for c in caches] == [torch.float32, torch.bfloat16, torch.float32]
    assert all(not c.any() for c in caches)


def test_spec_of_a_built_backend():
    assert spec_of_backend(_backend()) == FullAttentionSpec()
    assert spec_of_backend(_backend(7)) == SlidingWindowSpec(window=7)
    with pytest.raises(ValueError, match="at least 1"):
        SlidingWindowSpec(window=0)


@pytest.mark.parametrize("groups, match", [
    (lambda: (KVCacheGroup(FullAttentionSpec(), (0, 1), _backend()),
              KVCacheGroup(SlidingWindowSpec(window=2), (1,), _backend(2))), "already|group 0"),
    (lambda: (KVCacheGroup(FullAttentionSpec(), (0,), _backend()),), r"layers \[1\]"),
    (lambda: (KVCacheGroup(SlidingWindowSpec(window=2), (0, 1), _backend()),),
     "built for full_attention"),
])
def test_inconsistent_groups_are_refused(groups, match):
    with pytest.raises(ValueError, match=match):
        check_kv_cache_groups(groups(), 2)


def test_specs_need_the_features_of_their_kinds():
    needs = specs_needs([FullAttentionSpec(), SlidingWindowSpec(window=4)])
    assert needs.features == {"sliding_window"} and needs.values["attention_kind"] == "mha"
    assert specs_needs([MLALatentSpec(latent_size=576)]).values["attention_kind"] == "mla"
    with pytest.raises(ModelLoadError, match="'mha' and 'mla'"):
        kv_specs_needs((FullAttentionSpec(), MLALatentSpec(latent_size=576)), "X", 2)
    with pytest.raises(ModelLoadError, match="one spec per layer"):
        kv_specs_needs((FullAttentionSpec(),), "X", 2)
