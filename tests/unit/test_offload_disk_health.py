"""The disk tier under hostile or stuck storage: a read past its deadline is a miss and
marks the tier unhealthy until it returns (lookups answer 0 meanwhile); a FIFO at a
block's path is a miss without blocking; block files verify only under the key that
wrote them; and where that key comes from (key file, ``LMKIT_OFFLOAD_KEY``, per process)."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest
import torch
from lmkit.api import ConfigError
from lmkit.config.schema import LMKitConfig
from lmkit.offload.worker import OffloadWorker
from lmkit_plugins.offload.disk_key import KEY_ENV, derive_key, process_secret, resolve_key
from lmkit_plugins.offload.disk_tier import DiskTier
from lmkit_plugins.offload.options import DiskTierOptions
from lmkit_plugins.offload.stacked import CPUDiskTier

NUM_BLOCKS, BLOCK_SIZE = 8, 4
SECRET = "a deployment secret of enough bytes"


def h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


def make_caches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 16, generator=gen) for _ in range(2)]


def make_tier(path, caches=None, **options) -> DiskTier:
    config = LMKitConfig.model_validate({"cache": {"block_size": BLOCK_SIZE}})
    return DiskTier(config, caches if caches is not None else make_caches(),
                    DiskTierOptions(path=str(path), size_gb=0.01, **options))


def wait(tier, job, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for done, ok in tier.poll():
            if done.job_id == job.job_id:
                return ok
        time.sleep(0.002)
    raise AssertionError(f"job {job.job_id} not reported within {timeout_s} s")


def store_written(tier, hashes, ids) -> None:
    """Store blocks and wait until their files are on disk."""
    assert wait(tier, tier.store(hashes, ids))
    assert not tier.writes


def block(caches, i: int) -> list[torch.Tensor]:
    return [c[:, i].clone() for c in caches]


@pytest.fixture(autouse=True)
def _no_key_env(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


def test_read_past_deadline_is_a_miss_and_the_tier_unhealthy_until_it_returns(
        tmp_path, monkeypatch):
    caches = make_caches()
    tier = make_tier(tmp_path, caches, read_timeout_s=0.2)
    worker = OffloadWorker(tier, "disk", tier.block_bytes)
    store_written(tier, [h(1)], [1])
    release = threading.Event()
    read = tier.files.read

    def stuck_read(block_hash, payload_bytes):
        release.wait(30)  # a disk that does not answer
        return read(block_hash, payload_bytes)

    monkeypatch.setattr(tier.files, "read", stuck_read)
    before = block(caches, 5)
    started = time.monotonic()
    assert wait(tier, tier.load([h(1)], [5])) is False
    assert 0.2 <= time.monotonic() - started < 5
    health = tier.health()
    assert not health.healthy and "read_timeout_s" in health.reason
    stats = worker.stats()
    assert stats["offload_unhealthy"] == 1 and stats["offload_read_timeouts"] == 1
    assert tier.lookup([h(1)]) == 0, "a stuck tier is not offered to the engine"
    release.set()  # the read returns: its late result must not reach block 5
    deadline = time.monotonic() + 10
    while not tier.health().healthy and time.monotonic() < deadline:
        time.sleep(0.002)
    assert tier.health().healthy and worker.stats()["offload_unhealthy"] == 0
    tier.poll()
    assert all(torch.equal(a, b) for a, b in zip(block(caches, 5), before, strict=True))
    assert tier.lookup([h(1)]) == 1
    assert wait(tier, tier.load([h(1)], [6])) is True  # the file itself was fine
    assert all(torch.equal(a, b) for a, b in zip(block(caches, 6), block(caches, 1),
                                                  strict=True))
    worker.close()


def test_reads_not_started_by_the_deadline_are_skipped(tmp_path, monkeypatch):
    """One io thread, a 1 s deadline and no poll meanwhile: the second read outlasts the
    deadline, so the third would start after it and is skipped; the load is a timed-out
    miss, no file counts as bad or is deleted, and the tier is healthy once the reads
    are done."""
    tier = make_tier(tmp_path, read_timeout_s=1.0, io_threads=1)
    hashes = [h(1), h(2), h(3)]
    store_written(tier, hashes, [1, 2, 3])
    read = tier.files.read
    calls = []

    def slow_read(block_hash, payload_bytes):
        calls.append(block_hash)
        time.sleep(1.2 if block_hash == h(2) else 0.0)
        return read(block_hash, payload_bytes)

    monkeypatch.setattr(tier.files, "read", slow_read)
    job = tier.load(hashes, [5, 6, 7])
    time.sleep(1.5)
    assert wait(tier, job) is False
    assert calls == hashes[:2]
    assert tier.stats()["read_timeouts"] == 1 and tier.stats()["bad_files"] == 0
    assert tier.health().healthy and tier.lookup(hashes) == 3
    assert all(tier.files.path_of(b).is_file() for b in hashes)
    tier.close()


def test_close_does_not_wait_for_a_stuck_read(tmp_path, monkeypatch):
    tier = make_tier(tmp_path, read_timeout_s=0.1)
    store_written(tier, [h(1)], [1])
    release = threading.Event()
    monkeypatch.setattr(tier.files, "read", lambda *_: release.wait(30))
    assert wait(tier, tier.load([h(1)], [5])) is False
    started = time.monotonic()
    tier.close()
    assert time.monotonic() - started < 5
    release.set()


def test_cpu_disk_tier_skips_a_stuck_disk(tmp_path):
    config = LMKitConfig.model_validate({"cache": {"block_size": BLOCK_SIZE}})
    caches = make_caches()
    block_gb = sum(c[:, 0].numel() * 4 for c in caches) / 2**30
    from lmkit_plugins.offload.options import CPUDiskTierOptions

    tier = CPUDiskTier(config, caches, CPUDiskTierOptions(
        cpu_size_gb=block_gb, disk_size_gb=0.01, path=str(tmp_path)))
    assert wait(tier, tier.store([h(1)], [1])) and wait(tier, tier.store([h(2)], [2]))
    assert tier.lookup([h(1), h(2)]) == 2  # h(1) spilled to disk, h(2) in host memory
    tier.disk._reads[0] = time.monotonic() - 60  # a read hung for a minute
    assert not tier.health().healthy
    assert tier.lookup([h(1)]) == 0 and tier.lookup([h(2)]) == 1
    del tier.disk._reads[0]
    assert tier.health().healthy and tier.lookup([h(1)]) == 1
    tier.close()


def run_bounded(fn, timeout_s: float = 10.0):
    """``fn()`` in a daemon thread; fails the test if it has not returned in time."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"blocked for over {timeout_s} s"
    return result[0]


def test_fifo_at_block_path_is_a_miss_without_blocking(tmp_path):
    caches = make_caches()
    tier = make_tier(tmp_path, caches)
    store_written(tier, [h(1)], [1])
    path = tier.files.path_of(h(1))
    path.unlink()
    os.mkfifo(path)
    assert run_bounded(lambda: wait(tier, tier.load([h(1)], [5]))) is False
    assert tier.stats()["bad_files"] == 1 and tier.health().healthy
    assert not path.exists(), "the FIFO is removed"
    assert tier.lookup([h(1)]) == 0
    tier.close()


def test_blocks_verify_only_under_the_key_that_wrote_them(tmp_path, monkeypatch):
    caches = make_caches()
    monkeypatch.setenv(KEY_ENV, SECRET)
    first = make_tier(tmp_path, caches)
    store_written(first, [h(1)], [1])
    first.close()
    again = make_tier(tmp_path, caches)  # same key (a restart of the deployment): a hit
    assert again.lookup([h(1)]) == 1 and wait(again, again.load([h(1)], [5])) is True
    again.close()
    monkeypatch.setenv(KEY_ENV, SECRET + " but another one")
    other = make_tier(tmp_path, caches)  # another key: its startup scan skips the file
    assert other.lookup([h(1)]) == 0
    assert wait(other, other.load([h(1)], [6])) is False
    store_written(other, [h(1)], [1])  # and the block is written again under its key
    assert wait(other, other.load([h(1)], [6])) is True
    other.close()


def test_key_sources(tmp_path):
    root = tmp_path / "kv"
    per_process = resolve_key(None, root, env={})
    assert not per_process.persistent and per_process.key == derive_key(process_secret())
    assert per_process.key == resolve_key(None, root, env={}).key, "one key per process"
    from_env = resolve_key(None, root, env={KEY_ENV: SECRET})
    assert from_env.persistent and from_env.key == derive_key(SECRET.encode())
    assert SECRET not in repr(from_env) and str(from_env.key) not in repr(from_env)
    key_file = tmp_path / "offload.key"
    key_file.write_text(SECRET + "\n")
    key_file.chmod(0o600)
    from_file = resolve_key(str(key_file), root, env={KEY_ENV: "ignored: the file wins"})
    assert from_file.persistent and from_file.key == from_env.key


@pytest.mark.parametrize("case, message", [
    ("missing", "cannot be read"),
    ("readable", "chmod 600"),
    ("inside", "inside the offload folder"),
    ("short", "at least 16"),
    ("directory", "not a regular file"),
])
def test_bad_key_files_are_refused(tmp_path, case, message):
    root = tmp_path / "kv"
    root.mkdir()
    key_file = (root if case == "inside" else tmp_path) / "offload.key"
    if case == "directory":
        key_file.mkdir()
    elif case != "missing":
        key_file.write_text("short" if case == "short" else SECRET)
        key_file.chmod(0o644 if case == "readable" else 0o600)
    with pytest.raises(ConfigError, match=message):
        resolve_key(str(key_file), root, env={})


def test_short_env_key_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=f"{KEY_ENV}.*at least 16"):
        resolve_key(None, tmp_path, env={KEY_ENV: "hunter2"})


@pytest.mark.parametrize("unhealthy, status, code", [(0.0, "ok", 200), (1.0, "unhealthy", 503)])
def test_health_endpoint_reports_a_stuck_tier(unhealthy, status, code):
    from types import SimpleNamespace

    from lmkit.serve.app import build_app
    from starlette.testclient import TestClient

    config = LMKitConfig.model_validate({"model": {"model": "tiny"}})
    client = TestClient(build_app(config))  # no lifespan: no engine is started
    client.app.state.lmkit.llm = SimpleNamespace(
        is_healthy=True, dead_reason=None, stats={"offload_unhealthy": unhealthy},
        engine_stats=[{"offload_unhealthy": unhealthy}])
    resp = client.get("/health")
    assert resp.status_code == code and resp.json()["status"] == status
    if code == 503:
        assert "read_timeout_s" in resp.json()["error"]
