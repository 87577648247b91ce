"""KV offload on CUDA: the tiers' asynchronous copies (side stream, page-locked host
pool) are bit-exact and ordered against the compute stream, and tier hits in the
engine give the same greedy outputs as device prefix-cache hits."""

from __future__ import annotations

import hashlib
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from lmkit.config.schema import LMKitConfig  # noqa: E402
from lmkit_plugins.offload.cpu_tier import CPUTier  # noqa: E402
from lmkit_plugins.offload.disk_tier import DiskTier  # noqa: E402
from lmkit_plugins.offload.options import (  # noqa: E402
    CPUDiskTierOptions,
    CPUTierOptions,
    DiskTierOptions,
)
from lmkit_plugins.offload.stacked import CPUDiskTier  # noqa: E402

CUDA = torch.device("cuda")
# 4 layers of [2, 256 blocks, 16 tokens, 8 KV heads, 128] bf16: a block is 32 KiB of K
# and 32 KiB of V per layer, 256 KiB in all (a host block holds every layer's)
LAYERS, BLOCKS = 4, 256
SHAPE = (2, BLOCKS, 16, 8, 128)
BLOCK_BYTES = LAYERS * 2 * 16 * 8 * 128 * 2


def gib(num_blocks: int) -> float:
    """The size_gb of a pool of ``num_blocks`` blocks."""
    return num_blocks * BLOCK_BYTES / 2**30


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def caches(seed: int = 0) -> list:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen, device=CUDA, dtype=torch.bfloat16)
            for _ in range(LAYERS)]


def wait(tier, job) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for done, ok in tier.poll():
            if done.job_id == job.job_id:
                return ok
        time.sleep(0.001)
    raise AssertionError(f"job {job} never finished")


def wait_all(tier, *jobs) -> bool:
    """Whether every one of ``jobs`` succeeded (``wait`` drops the other jobs it polls)."""
    left, ok = {job.job_id for job in jobs}, True
    deadline = time.monotonic() + 60
    while left and time.monotonic() < deadline:
        for done, success in tier.poll():
            if done.job_id in left:
                left.discard(done.job_id)
                ok = ok and success
        time.sleep(0.001)
    assert not left, f"jobs {left} never finished"
    return ok


def make(kind: str, kv, tmp_path):
    config = LMKitConfig()
    if kind == "cpu":
        return CPUTier(config, kv, CPUTierOptions(size_gb=gib(1024)))
    if kind == "disk":
        return DiskTier(config, kv, DiskTierOptions(size_gb=gib(1024), path=str(tmp_path)))
    # a host level of 48 blocks: most of a 128-block store spills to disk
    return CPUDiskTier(config, kv, CPUDiskTierOptions(cpu_size_gb=gib(48),
                                                      disk_size_gb=gib(1024),
                                                      path=str(tmp_path)))


def test_block_geometry():
    """The sizes below are in blocks of BLOCK_BYTES; a wrong guess made the two
    sequence tests fail (a 4x larger pool than meant, and loads of unstored hashes)."""
    tier = CPUTier(LMKitConfig(), caches(), CPUTierOptions(size_gb=gib(64)))
    assert tier.copier.block_bytes == BLOCK_BYTES and tier.num_slots == 64
    tier.close()


def test_cpu_tier_pool_is_page_locked():
    tier = CPUTier(LMKitConfig(), caches(), CPUTierOptions(size_gb=0.1))
    assert tier.pinned and tier.pool.is_pinned()
    tier.close()


@pytest.mark.parametrize("kind", ["cpu", "disk", "cpu+disk"])
def test_store_reads_before_the_blocks_are_overwritten(kind, tmp_path):
    """Store 128 blocks, then at once overwrite them on the compute stream (as the
    step's forward does): the tier must hold the old contents; loading them into other
    blocks gives them back bit for bit, and blocks outside the load are untouched."""
    kv = caches()
    original = [c.clone() for c in kv]
    tier = make(kind, kv, tmp_path)
    src, dst = list(range(1, 129)), list(range(128, 256))
    job = tier.store([h(i) for i in src], src)
    for cache in kv:  # queued right behind the store's read on the current stream
        cache[:, 1:129].fill_(7.0)
    assert wait(tier, job)
    for cache in kv:
        cache.zero_()
    job = tier.load([h(i) for i in src], dst)
    assert wait(tier, job)
    torch.cuda.synchronize()
    for cache, orig in zip(kv, original, strict=True):
        assert torch.equal(cache[:, dst].view(torch.int16), orig[:, src].view(torch.int16))
        assert not cache[:, :128].any()
    tier.close()


def test_many_interleaved_jobs_stay_ordered(tmp_path):
    """Stores and loads issued back to back without waiting, reusing the same device
    blocks, each reading what the previous one left."""
    kv = caches(1)
    tier = make("cpu", kv, tmp_path)
    expected = {}
    jobs = []

    def ids_of(round_: int) -> list[int]:  # rounds 0, 4, 8 reuse blocks 1-32, ...
        return list(range(1 + (round_ % 4) * 32, 1 + (round_ % 4) * 32 + 32))

    for round_ in range(12):
        ids = ids_of(round_)
        for cache in kv:
            cache[:, ids].fill_(float(round_))
        expected[round_] = [c[:, ids].clone() for c in kv]
        jobs.append(tier.store([h(1000 * round_ + i) for i in ids], ids))
    torch.cuda.synchronize()
    for round_ in range(12):
        job = tier.load([h(1000 * round_ + i) for i in ids_of(round_)], list(range(200, 232)))
        assert wait(tier, job)
        for cache, want in zip(kv, expected[round_], strict=True):
            assert torch.equal(cache[:, 200:232], want)
    tier.close()


def test_host_slots_reused_across_directions():
    """A load issued right behind the store that wrote its host slots (not polled yet)
    reads the stored data; a store that evicts the slots a load is still reading does
    not overwrite them first."""
    kv = caches(2)
    # 64 host blocks: storing 64 new ones evicts everything held
    tier = CPUTier(LMKitConfig(), kv, CPUTierOptions(size_gb=gib(64)))
    ids = list(range(1, 65))
    want = [c[:, ids].clone() for c in kv]
    tier.store([h(i) for i in ids], ids)
    load = tier.load([h(i) for i in ids], list(range(100, 164)))  # no wait in between
    for cache in kv:  # new contents for the next store, after the load's read
        cache[:, ids].add_(1.0)
    tier.store([h(1000 + i) for i in ids], ids)  # evicts (reuses) every slot just loaded
    assert wait(tier, load)
    torch.cuda.synchronize()
    for cache, w in zip(kv, want, strict=True):
        assert torch.equal(cache[:, 100:164], w)
    assert tier.lookup([h(1000 + i) for i in ids]) == 64 and tier.lookup([h(1)]) == 0
    tier.close()


@pytest.mark.parametrize("kind", ["cpu", "cpu+disk"])
def test_load_now_orders_the_current_stream_after_the_copy(kind, tmp_path):
    """A same-step load: work queued on the compute stream right after ``load_now``
    (the step's forward) sees the loaded blocks, with no wait on the host; blocks the
    tier no longer holds are refused without a copy."""
    kv = caches(3)
    tier = make(kind, kv, tmp_path)
    src = list(range(1, 41))  # fits the host level of cpu+disk
    want = [c[:, src].clone() for c in kv]
    tier.store([h(i) for i in src], src)
    for cache in kv:  # after the store's read
        cache[:, src].zero_()
    assert tier.resident([h(i) for i in src]) == len(src)
    job = tier.load_now([h(i) for i in src], list(range(201, 241)))
    assert job is not None
    seen = [c[:, 201:241].clone() for c in kv]  # queued on the current stream, no sync
    torch.cuda.synchronize()
    for got, w in zip(seen, want, strict=True):
        assert torch.equal(got.view(torch.int16), w.view(torch.int16))
    assert wait(tier, job)
    assert tier.load_now([h(1), h(99999)], [250, 251]) is None
    assert tier.resident([h(1), h(99999), h(2)]) == 1
    tier.close()


@pytest.mark.parametrize("order", ["same", "reversed"])
def test_load_now_into_blocks_the_step_stores(order, tmp_path):
    """The engine's hit step: a store of evicted blocks, then at once a same-step load
    into those very blocks (told of the store, so that it waits per staging chunk
    rather than for the whole store). Small staging buffers make both run in 8 chunks.
    The store must get the old contents, the compute stream the loaded ones."""
    kv = caches(4)
    tier = make("cpu", kv, tmp_path)
    tier.copier.staging_rows = 16
    evicted, other = list(range(0, 128)), list(range(128, BLOCKS))  # ids < BLOCKS (256)
    tier.store([h(5000 + i) for i in other], other)  # the prefix coming back
    loaded = [c[:, other].clone() for c in kv]
    torch.cuda.synchronize()
    old = [c[:, evicted].clone() for c in kv]
    store = tier.store([h(i) for i in evicted], evicted)
    targets = evicted if order == "same" else evicted[::-1]
    job = tier.load_now([h(5000 + i) for i in other], targets, after_store=store)
    seen = [c[:, targets].clone() for c in kv]  # the step's forward, queued at once
    assert wait_all(tier, store, job)
    torch.cuda.synchronize()
    for got, want in zip(seen, loaded, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    for cache in kv:
        cache[:, other].zero_()
    back = tier.load([h(i) for i in evicted], other)
    assert wait(tier, back)
    torch.cuda.synchronize()
    for cache, want in zip(kv, old, strict=True):
        assert torch.equal(cache[:, other].view(torch.int16), want.view(torch.int16))
    tier.close()


def test_engine_tier_hits_match_device_cache_hits(tmp_path):
    from lmkit import LLM, SamplingParams
    from lmkit.testing.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2)
    gen = torch.Generator().manual_seed(0)
    p1, p2, p3 = (torch.randint(0, 256, (240,), generator=gen).tolist() for _ in range(3))
    prompts = [p1 + [1], p2 + [2], p3 + [3], p1 + [4, 5], p2 + [6]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = dict(dtype="bfloat16", block_size=16, max_model_len=256)

    def run(**kw):
        with LLM(str(model), **engine, **kw) as llm:
            outs = [llm.generate([p], params)[0] for p in prompts]
            return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs], \
                llm.stats()

    big, big_cached, big_stats = run(num_blocks=200)
    for tier, options in (("cpu", {"size_gb": 0.01}),
                          ("cpu+disk", {"cpu_size_gb": 0.001, "disk_size_gb": 0.01,
                                        "path": str(tmp_path / "kv")})):
        small, small_cached, stats = run(num_blocks=20, offload=tier,
                                         **{"offload.options": options})
        assert small == big, tier
        assert small_cached == big_cached, tier
        assert stats["offload_loaded_blocks"] > 0 and stats["offload_failed_loads"] == 0
        if tier == "cpu":  # every hit computed in the step of its load: no extra step
            assert stats["num_steps"] == big_stats["num_steps"], stats
