"""The built-in offload tiers pass the offload conformance suite: ``cpu`` (LRU and ARC),
``disk``, and ``cpu+disk`` (a one-block host pool, so that stores spill to disk)."""

from __future__ import annotations

import time

import pytest
from lmkit.plugin_host.manager import PluginHost
from lmkit.testing.offload import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
    OffloadConformance,
)

# the suite's geometry in float32 (bfloat16 blocks are half as big)
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * 4
FILE_BYTES = BLOCK_BYTES + 128


def gib(num_bytes: int) -> float:
    return num_bytes / 2**30


@pytest.fixture(scope="module")
def host():
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})


def damage_file(manager, block_hash: bytes) -> None:
    """Flip a payload byte of ``block_hash``'s file, once it is written."""
    disk = getattr(manager, "disk", manager)
    deadline = time.monotonic() + 30
    while block_hash in disk.writes and time.monotonic() < deadline:
        disk.poll()
        time.sleep(0.001)
    path = disk.files.path_of(block_hash)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


class TestCPUTierLRU(OffloadConformance):
    @pytest.fixture
    def offload_manager(self, host):
        return host.registry.get("offload", "cpu").spec, {"size_gb": gib(40 * BLOCK_BYTES)}


class TestCPUTierARC(OffloadConformance):
    @pytest.fixture
    def offload_manager(self, host):
        return host.registry.get("offload", "cpu").spec, {"size_gb": gib(40 * BLOCK_BYTES),
                                                          "eviction": "arc"}


class TestDiskTier(OffloadConformance):
    @pytest.fixture
    def offload_manager(self, host, tmp_path):
        return host.registry.get("offload", "disk").spec, {"size_gb": gib(40 * FILE_BYTES),
                                                           "path": str(tmp_path)}

    def corrupt(self, manager, block_hash):
        damage_file(manager, block_hash)


class TestCPUDiskTier(OffloadConformance):
    @pytest.fixture
    def offload_manager(self, host, tmp_path):
        return host.registry.get("offload", "cpu+disk").spec, {
            "cpu_size_gb": gib(BLOCK_BYTES), "disk_size_gb": gib(40 * FILE_BYTES),
            "path": str(tmp_path)}

    def corrupt(self, manager, block_hash):
        assert not manager.cpu.holds(block_hash), "the one-block host pool should have spilled it"
        damage_file(manager, block_hash)
