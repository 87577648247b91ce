"""KV offload in the engine (tiny random model, CPU): prefixes pushed out of a small
device pool come back from the tier with greedy outputs identical to recomputing them;
tier capacity limits hold; the disk tier survives a restart; damaged, truncated,
forged (valid layout, unkeyed checksum, another block's KV) and symlinked block files
and FIFOs are misses that recompute, never wrong output or a hang."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time

import pytest
from lmkit import LLM, SamplingParams
from lmkit.kv_cache.hashing import hash_block_tokens
from lmkit.testing.tiny_model import make_tiny_model

BLOCK = 16
PREFIX = 15 * BLOCK  # 240 tokens: one prefix nearly fills the device pool
ENGINE = dict(block_size=BLOCK, num_blocks=20, max_model_len=256)  # 19 usable blocks
# tiny model: 2 layers x K,V x 16 tokens x 2 KV heads x head size 16 x float32
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-offload"))


def prefix(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(PREFIX)]


P1, P2, P3 = prefix(1), prefix(2), prefix(3)
# P1 first, then two other prefixes that push it out of the device pool, then P1 again
PROMPTS = [P1 + [1, 2, 3], P2 + [4, 5], P3 + [6], P1 + [7, 8, 9, 10], P2 + [11]]


def generate(llm: LLM, prompts=PROMPTS) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs, one request at a time (so that each one's prefix is evicted)."""
    outs = [llm.generate([p], PARAMS)[0] for p in prompts]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def reference(model_dir):
    """Outputs without offload: every pushed-out prefix is recomputed."""
    with LLM(str(model_dir), **ENGINE) as llm:
        tokens, cached = generate(llm)
        assert cached[3] < PREFIX // 2, "the device pool was meant to lose P1"
        return tokens


def tier_options(name: str, path, blocks: int = 200) -> dict:
    size = blocks * (BLOCK_BYTES + 128) / 2**30
    return {"cpu": {"size_gb": size}, "disk": {"size_gb": size, "path": str(path)},
            "cpu+disk": {"cpu_size_gb": size / 4, "disk_size_gb": size,
                         "path": str(path)}}[name]


def offload_llm(model_dir, name: str, options: dict) -> LLM:
    return LLM(str(model_dir), offload=name, **ENGINE, **{"offload.options": options})


@pytest.mark.parametrize("tier", ["cpu", "disk", "cpu+disk"])
def test_tier_hits_match_recompute(model_dir, reference, tier, tmp_path):
    with offload_llm(model_dir, tier, tier_options(tier, tmp_path)) as llm:
        tokens, cached = generate(llm)
        stats = llm.stats()
    assert tokens == reference
    assert stats["offload_stored_blocks"] > 0
    assert stats["offload_loaded_blocks"] >= PREFIX // BLOCK - 4, stats
    assert stats["offload_failed_loads"] == 0
    assert cached[3] == PREFIX, "P1's whole prefix should have come back from the tier"
    assert stats["offload_bytes_loaded"] == stats["offload_loaded_blocks"] * BLOCK_BYTES


def test_arc_eviction_matches_recompute(model_dir, reference):
    with offload_llm(model_dir, "cpu", {"size_gb": 0.001, "eviction": "arc"}) as llm:
        tokens, _ = generate(llm)
        assert llm.stats()["offload_loaded_blocks"] > 0
    assert tokens == reference


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_capacity_limit(model_dir, reference, tier, tmp_path):
    capacity_blocks = 6
    options = tier_options(tier, tmp_path, blocks=capacity_blocks)
    with offload_llm(model_dir, tier, options) as llm:
        tokens, _ = generate(llm)
        stats = llm.stats()
    assert tokens == reference
    assert stats["offload_evictions"] > 0
    assert stats["offload_used_bytes"] <= stats["offload_capacity_bytes"]
    assert stats["offload_capacity_bytes"] // (BLOCK_BYTES + (128 if tier == "disk" else 0)) \
        == capacity_blocks
    if tier == "disk":
        files = [p for p in tmp_path.rglob("*") if p.is_file()]
        assert 0 < len(files) <= capacity_blocks
        assert not [p for p in files if not p.name.endswith(".kv")], "temporary files left"


def block_files(root, prompt: list[int]) -> list:
    """The disk tier's files of ``prompt``'s full blocks, in order."""
    (subdir,) = [p for p in root.iterdir() if p.is_dir()]
    paths, parent = [], None
    for i in range(len(prompt) // BLOCK):
        parent = hash_block_tokens(parent, prompt[i * BLOCK:(i + 1) * BLOCK])
        h = parent.hex()
        paths.append(subdir / h[:2] / h[2:4] / f"{h}.kv")
    return paths


@pytest.fixture
def filled_disk(model_dir, tmp_path):
    """A disk tier directory holding P1's blocks, written by an engine now shut down."""
    with offload_llm(model_dir, "disk", tier_options("disk", tmp_path)) as llm:
        generate(llm, PROMPTS[:3])
    assert all(p.is_file() for p in block_files(tmp_path, P1)), "P1 should be on disk"
    return tmp_path


def test_disk_tier_survives_restart(model_dir, reference, filled_disk):
    with offload_llm(model_dir, "disk", tier_options("disk", filled_disk)) as llm:
        tokens, cached = generate(llm, [PROMPTS[3]])
        stats = llm.stats()
    assert tokens == [reference[3]]
    assert cached == [PREFIX]
    assert stats["offload_loaded_blocks"] == PREFIX // BLOCK
    assert stats["offload_failed_loads"] == 0


def damage(path, how: str, tmp_path) -> None:
    if how == "forged":
        # another block's KV under this block's header, stamped as a forger without the
        # key would: a valid layout and an unkeyed BLAKE2b of the bytes the MAC covers
        from lmkit_plugins.offload.disk_files import HEADER_SIZE, MAC_COVERS

        other = next(p for p in path.parent.parent.parent.rglob("*.kv") if p != path)
        header = bytearray(path.read_bytes()[:HEADER_SIZE])
        payload = other.read_bytes()[HEADER_SIZE:]
        header[MAC_COVERS:MAC_COVERS + 32] = hashlib.blake2b(
            bytes(header[:MAC_COVERS]) + payload, digest_size=32).digest()
        path.write_bytes(bytes(header) + payload)
    elif how == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif how == "corrupted":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
    elif how == "symlinked":
        # a valid file of the same block, but outside the cache root: must not be followed
        outside = tmp_path / "outside.kv"
        outside.write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(outside)
    elif how == "symlinked-dir":
        # the hashed subdirectory replaced by a link to a copy of itself outside the root
        import shutil

        outside = tmp_path / "outside-dir"
        shutil.copytree(path.parent, outside)
        shutil.rmtree(path.parent)
        path.parent.symlink_to(outside)


def generate_bounded(llm: LLM, prompts, timeout_s: float = 60.0):
    """:func:`generate` in a daemon thread; fails the test if it blocks (a hang)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(generate(llm, prompts)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"the engine blocked for over {timeout_s} s"
    assert result, "generate raised (see the thread's traceback above)"
    return result[0]


@pytest.mark.parametrize("how", ["corrupted", "truncated", "forged", "fifo", "symlinked",
                                 "symlinked-dir"])
def test_damaged_files_are_misses(model_dir, reference, filled_disk, how, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    with offload_llm(model_dir, "disk", tier_options("disk", filled_disk)) as llm:
        # damaged after the engine indexed the directory: caught when loaded
        damage(block_files(filled_disk, P1)[5], how, outside)
        tokens, cached = generate_bounded(llm, [PROMPTS[3]])
        stats = llm.stats()
    assert tokens == [reference[3]]
    assert stats["offload_failed_loads"] == 1
    assert stats["offload_bad_files"] >= 1
    assert stats["offload_unhealthy"] == 0
    assert cached == [0], "a failed load is recomputed, not half used"


def test_damaged_files_found_at_startup_are_misses(model_dir, reference, filled_disk,
                                                   tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    files = block_files(filled_disk, P1)
    damage(files[0], "truncated", outside)
    damage(files[1], "symlinked", outside)
    with offload_llm(model_dir, "disk", tier_options("disk", filled_disk)) as llm:
        tokens, cached = generate(llm, [PROMPTS[3]])
        stats = llm.stats()
    assert tokens == [reference[3]]
    assert stats["offload_load_jobs"] == 0  # the index never held the damaged blocks
    assert not files[0].exists(), "a file of the wrong size is removed at startup"


def steps_of(llm: LLM, prompt: list[int]) -> tuple[list[int], int, int]:
    """Greedy output, cached prompt tokens and engine steps of ``prompt`` alone."""
    before = llm.stats()["num_steps"]
    tokens, cached = generate(llm, [prompt])
    return tokens[0], cached[0], llm.stats()["num_steps"] - before


@pytest.mark.parametrize("tier, extra_steps", [("cpu", 0), ("cpu+disk", 0), ("disk", 1)])
def test_tier_hit_is_computed_in_the_step_of_its_load(model_dir, reference, tier, extra_steps,
                                                      tmp_path):
    """A prefix held in host memory is loaded and its suffix computed in one step: the
    first token comes as soon as when the prefix is recomputed (one prefill step, then
    a step per further token). A disk read takes one step more."""
    with offload_llm(model_dir, tier, tier_options(tier, tmp_path, blocks=400)) as llm:
        generate(llm, PROMPTS[:3])
        tokens, cached, steps = steps_of(llm, PROMPTS[3])
        stats = llm.stats()
    assert tokens == reference[3]
    assert cached == PREFIX and stats["offload_loaded_blocks"] >= PREFIX // BLOCK
    assert steps == len(reference[3]) + extra_steps


def test_refused_same_step_load_is_recomputed(model_dir, reference, monkeypatch):
    """The tier refuses a same-step load (as when a store pushed the blocks out since
    the lookup), after scribbling over its destination blocks: the step that computed
    the request on them is thrown away, and the request comes back through an
    asynchronous load with the right output."""
    import torch
    from lmkit_plugins.offload.cpu_tier import CPUTier

    refused = []

    def refuse_once(self, block_hashes, block_ids, after_store=None):
        if refused:
            return original(self, block_hashes, block_ids, after_store)
        refused.append(list(block_ids))
        for cache in self.copier.caches:  # [2, blocks, E]
            cache[:, list(block_ids)] = torch.randn_like(cache[:, list(block_ids)])
        return None

    original = CPUTier.load_now
    monkeypatch.setattr(CPUTier, "load_now", refuse_once)
    with offload_llm(model_dir, "cpu", tier_options("cpu", None, blocks=400)) as llm:
        generate(llm, PROMPTS[:3])
        tokens, cached, steps = steps_of(llm, PROMPTS[3])
        stats = llm.stats()
    assert refused, "the hit was meant to take the same-step path"
    assert tokens == reference[3]
    assert stats["offload_failed_loads"] == 1
    assert cached == PREFIX, "the retry loads the prefix (asynchronously)"
    assert steps == len(reference[3]) + 2  # the step thrown away, the load's step


def test_stuck_read_is_a_miss_and_marks_the_engine_unhealthy(model_dir, reference, filled_disk,
                                                             monkeypatch):
    """A read that does not return (a hung disk) fails its load at the deadline: the
    request recomputes with the right output, and the engine reports the tier unhealthy
    (and stops offering it) until the read returns."""
    from lmkit_plugins.offload.disk_files import BlockDirectory

    stuck_name = block_files(filled_disk, P1)[5].stem
    release = threading.Event()
    read = BlockDirectory.read

    def hung_read(self, block_hash, payload_bytes):
        if block_hash.hex() == stuck_name:
            release.wait(60)
        return read(self, block_hash, payload_bytes)

    monkeypatch.setattr(BlockDirectory, "read", hung_read)
    options = {**tier_options("disk", filled_disk), "read_timeout_s": 0.5}
    try:
        with offload_llm(model_dir, "disk", options) as llm:
            tokens, cached = generate_bounded(llm, [PROMPTS[3]])
            stats = llm.stats()
            again, _ = generate_bounded(llm, [PROMPTS[3]])
            jobs = llm.stats()["offload_load_jobs"]
            release.set()
            deadline = time.monotonic() + 10
            while llm.stats()["offload_unhealthy"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert llm.stats()["offload_unhealthy"] == 0, "healthy once the read returned"
    finally:
        release.set()
    assert tokens == [reference[3]] and again == [reference[3]]
    assert cached == [0], "the timed-out load is recomputed"
    assert stats["offload_read_timeouts"] == 1 and stats["offload_failed_loads"] == 1
    assert stats["offload_unhealthy"] == 1
    assert jobs == stats["offload_load_jobs"], "no load from a stuck tier"
