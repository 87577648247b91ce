"""Offload tiers copy blocks of MLA latent caches (``[num_blocks, block_size, width]``,
blocks on axis 0) as they do the K/V layout (``[2, num_blocks, ...]``, blocks on axis 1)."""

from __future__ import annotations

import pytest
import torch
from lmkit.api.offload import kv_block_axis, kv_cache_fingerprint
from lmkit.config import LMKitConfig
from lmkit_plugins.offload.copier import BlockCopier


def test_block_axis_of_each_layout():
    assert kv_block_axis((2, 64, 16, 2, 8)) == 1
    assert kv_block_axis((64, 16, 576)) == 0
    with pytest.raises(ValueError, match="neither offloadable layout"):
        kv_block_axis((3, 64, 16, 2))


def test_latent_blocks_round_trip_through_host_rows():
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(12, 4, 40, generator=gen) for _ in range(3)]
    original = [c.clone() for c in caches]
    copier = BlockCopier(caches)
    assert copier.block_shape == (3, 1, 4 * 40) and copier.block_bytes == 3 * 4 * 40 * 4
    host = copier.host_rows(5)
    copier.gather([7, 2, 9], host, [4, 0, 1])
    for layer in range(3):
        torch.testing.assert_close(host[4, layer, 0], original[layer][7].reshape(-1))
        torch.testing.assert_close(host[0, layer, 0], original[layer][2].reshape(-1))
    copier.scatter(host, [4, 0], [3, 10])  # block 7's entries to 3, block 2's to 10
    for layer in range(3):
        assert torch.equal(caches[layer][3], original[layer][7])
        assert torch.equal(caches[layer][10], original[layer][2])
        untouched = [b for b in range(12) if b not in (3, 10)]
        assert torch.equal(caches[layer][untouched], original[layer][untouched])


def test_fingerprint_ignores_the_latent_pool_size(tmp_path):
    config = LMKitConfig.model_validate({"model": {"model": str(tmp_path)}})
    small = [torch.zeros(8, 16, 40)]
    large = [torch.zeros(32, 16, 40)]
    wider = [torch.zeros(8, 16, 48)]
    assert kv_cache_fingerprint(config, small) == kv_cache_fingerprint(config, large)
    assert kv_cache_fingerprint(config, small) != kv_cache_fingerprint(config, wider)
