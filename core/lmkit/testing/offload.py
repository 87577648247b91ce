"""Conformance suite for KV offload tiers (:class:`lmkit.api.OffloadManager`).

The manager is built over two layers of KV cache in the layout of the built-in
attention backends (``[2, num_blocks, block_size, num_kv_heads, head_size]``), filled
with random bit patterns (NaN and infinity patterns included), in float32 and
bfloat16. Properties:

* ``round trip bit-exact``: blocks stored under hashes, then loaded into other device
  blocks, come back bit for bit in every layer; blocks outside the load are untouched;
* ``lookup``: the number of *leading* hashes held (0 for none, stopping at the first
  unknown one);
* ``jobs``: ``store``/``load`` return jobs with unique ids, their kind, hashes and
  block ids; ``poll`` reports each job exactly once;
* ``capacity``: ``usage()`` never exceeds the capacity, storing more than fits evicts
  instead of failing, the newest block is kept, and every block ``lookup`` still
  reports loads bit-exact (the tier's capacity must be small, see below);
* ``failed loads``: loading a hash the tier does not hold reports the job as failed;
* ``corrupt entries``: a stored entry damaged behind the tier's back (by the
  ``corrupt`` hook the test provides, e.g. flipping bytes in a disk tier's file)
  loads as a failed job, never as wrong data; other entries still load.

Use :func:`check_offload_manager`, or subclass :class:`OffloadConformance` and define
an ``offload_manager`` fixture returning ``(spec, options)`` with a capacity of at most
a few thousand 2 KiB blocks; override :meth:`OffloadConformance.corrupt` to enable
the corrupt-entry property.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lmkit.testing.failure import (
    CONSTRUCTOR_PROPERTY,
    NotApplicable,
    Target,
    resolve_target,
    run_checks,
    skip_if_not_applicable,
)

SUITE = "offload"
NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 2, 64, 4, 2, 16
MAX_CAPACITY_BLOCKS = 4096
POLL_TIMEOUT_S = 30.0
GEOMETRY = (f"{NUM_LAYERS} layers of [2, {NUM_BLOCKS}, {BLOCK_SIZE}, {NUM_KV_HEADS}, "
            f"{HEAD_SIZE}] KV cache")

Corrupt = Callable[[Any, bytes], None]


def block_hash(i: int, salt: str = "") -> bytes:
    """A deterministic 32-byte content hash for test block ``i``."""
    return hashlib.sha256(f"lmkit-offload-conformance:{salt}:{i}".encode()).digest()


class World:
    """A manager under test over random KV caches."""

    def __init__(self, t: Target, prop: str, dtype: torch.dtype = torch.float32) -> None:
        from lmkit.config.schema import LMKitConfig

        self.t, self.prop, self.dtype = t, prop, dtype
        self.device = _device(t)
        gen = torch.Generator().manual_seed(0)
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
        int_type = torch.int32 if dtype.itemsize == 4 else torch.int16
        info = torch.iinfo(int_type)
        self.caches = [torch.randint(info.min, info.max, shape, generator=gen, dtype=int_type)
                       .view(dtype).to(self.device) for _ in range(NUM_LAYERS)]
        self.original = [c.clone() for c in self.caches]
        config = LMKitConfig.model_validate({"cache": {"block_size": BLOCK_SIZE}})
        self.m = t.build(SUITE, "offload", prop, f"{NUM_LAYERS} layers of {tuple(shape)} "
                         f"{str(dtype).removeprefix('torch.')} KV caches", config, self.caches,
                         options=t.options)
        self.block_bytes = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * dtype.itemsize

    def fail(self, input: str, detail: str) -> AssertionError:
        dtype = str(self.dtype).removeprefix("torch.")
        return self.t.fail(SUITE, self.prop, f"{GEOMETRY}, {dtype}; {input}", detail)

    def wait(self, job: Any, what: str) -> bool:
        """Poll until ``job`` finishes; its success flag. Checks jobs are reported once."""
        deadline = time.monotonic() + POLL_TIMEOUT_S
        while time.monotonic() < deadline:
            for done, ok in self.m.poll():
                if done.job_id == job.job_id:
                    return bool(ok)
                raise self.fail(what, f"poll() reported job {done.job_id} ({done.kind}), which "
                                "is not in flight (reported twice, or never started)")
            self.check_usage(what)
            time.sleep(0.001)
        raise self.fail(what, f"job {job.job_id} was not reported by poll() within "
                        f"{POLL_TIMEOUT_S:.0f} s")

    def check_usage(self, what: str) -> None:
        used, capacity = self.m.usage()
        if used > capacity or used < 0:
            raise self.fail(what, f"usage() is {used} bytes of {capacity}")

    def store(self, hashes: Sequence[bytes], ids: Sequence[int]) -> bool:
        what = f"store of {len(hashes)} block(s) from device blocks {list(ids)[:6]}"
        job = self.m.store(list(hashes), list(ids))
        self.check_job(job, "store", hashes, ids, what)
        return self.wait(job, what)

    def load(self, hashes: Sequence[bytes], ids: Sequence[int]) -> bool:
        what = f"load of {len(hashes)} block(s) into device blocks {list(ids)[:6]}"
        job = self.m.load(list(hashes), list(ids))
        self.check_job(job, "load", hashes, ids, what)
        return self.wait(job, what)

    def check_job(self, job: Any, kind: str, hashes: Sequence[bytes], ids: Sequence[int],
                  what: str) -> None:
        if (job.kind, tuple(job.block_hashes), tuple(job.block_ids)) != (
                kind, tuple(hashes), tuple(ids)):
            raise self.fail(what, f"{kind}() returned {job!r}; expected kind {kind!r} with the "
                            "given hashes and block ids")

    def blocks_equal(self, device_ids: Sequence[int], source_ids: Sequence[int]) -> int | None:
        """The first device block (of ``device_ids``) whose bits differ from the original
        ``source_ids`` block in any layer, or None."""
        for dst, src in zip(device_ids, source_ids, strict=True):
            for cache, orig in zip(self.caches, self.original, strict=True):
                if not torch.equal(_bits(cache[:, dst]), _bits(orig[:, src])):
                    return dst
        return None

    def clear(self, ids: Sequence[int]) -> None:
        for cache in self.caches:
            cache[:, list(ids)] = 0


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32 if x.dtype.itemsize == 4 else torch.int16).cpu()


def _device(t: Target) -> torch.device:
    claimed = t.caps_values("device")
    if claimed is None or "cpu" in claimed:
        return torch.device("cpu")
    if "cuda" in claimed and torch.cuda.is_available():
        return torch.device("cuda")
    raise NotApplicable(f"{t.name} runs on {', '.join(sorted(claimed))} only")


def round_trip(t: Target) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        w = World(t, "round trip bit-exact", dtype)
        hashes, src, dst = [block_hash(i) for i in range(8)], list(range(1, 9)), list(range(20, 28))
        if not w.store(hashes, src):
            raise w.fail("store of 8 blocks", "the store job failed")
        w.clear(range(NUM_BLOCKS))
        if not w.load(hashes, dst):
            raise w.fail("load of the 8 stored blocks", "the load job failed")
        bad = w.blocks_equal(dst, src)
        if bad is not None:
            raise w.fail(f"store blocks {src}, load them into {dst}",
                         f"device block {bad} differs from what was stored")
        others = [b for b in range(NUM_BLOCKS) if b not in dst]
        if any(bool(c[:, others].view(torch.uint8).any()) for c in w.caches):
            raise w.fail(f"load into blocks {dst}", "a block outside the load was written")
        w.m.close()
        w.m.close()


def lookup(t: Target) -> None:
    w = World(t, "lookup")
    hashes = [block_hash(i) for i in range(4)]
    unknown = block_hash(99, "unknown")
    if w.m.lookup([]) != 0 or w.m.lookup([unknown]) != 0:
        raise w.fail("an empty tier", "lookup([]) and lookup([unknown]) must be 0")
    if not w.store(hashes, [1, 2, 3, 4]):
        raise w.fail("store of 4 blocks", "the store job failed")
    cases = [(hashes, 4), (hashes[:2], 2), ([*hashes[:2], unknown, hashes[2]], 2),
             ([unknown, *hashes], 0), ([hashes[1], hashes[0]], 2)]
    for query, want in cases:
        got = w.m.lookup(query)
        if got != want:
            names = ["unknown" if h == unknown else f"h{hashes.index(h)}" for h in query]
            raise w.fail(f"h0-h3 stored; lookup([{', '.join(names)}])",
                         f"returned {got}; the number of leading hashes held is {want}")


def jobs(t: Target) -> None:
    w = World(t, "jobs")
    a = w.m.store([block_hash(1)], [1])
    b = w.m.store([block_hash(2)], [2])
    if a.job_id == b.job_id:
        raise w.fail("two stores", f"both jobs have id {a.job_id}")
    pending, deadline = {a.job_id, b.job_id}, time.monotonic() + POLL_TIMEOUT_S
    while pending and time.monotonic() < deadline:
        for job, _ in w.m.poll():
            if job.job_id not in pending:
                raise w.fail("two stores", f"poll() reported job {job.job_id} twice or unasked")
            pending.discard(job.job_id)
        time.sleep(0.001)
    if pending:
        raise w.fail("two stores", f"jobs {sorted(pending)} were never reported by poll()")
    if w.m.poll():
        raise w.fail("two finished stores", "poll() reported jobs again")


def capacity(t: Target) -> None:
    w = World(t, "capacity")
    used, cap = w.m.usage()
    max_blocks = cap // w.block_bytes
    if max_blocks > MAX_CAPACITY_BLOCKS:
        raise NotApplicable(f"capacity {cap} bytes holds {max_blocks} blocks; give the tier "
                            f"options with at most {MAX_CAPACITY_BLOCKS} blocks of "
                            f"{w.block_bytes} bytes to test eviction")
    total = max_blocks + 8
    batch = 8
    for start in range(0, total, batch):
        idx = list(range(start, min(start + batch, total)))
        w.store([block_hash(i, "cap") for i in idx], [1 + i % 32 for i in idx])
    w.check_usage(f"after storing {total} blocks into a tier of {max_blocks}")
    newest = block_hash(total - 1, "cap")
    if w.m.lookup([newest]) != 1:
        raise w.fail(f"{total} blocks stored into a tier of {max_blocks}",
                     "the most recently stored block is not held")
    held = [i for i in range(total) if w.m.lookup([block_hash(i, "cap")]) == 1]
    if len(held) > max_blocks:
        raise w.fail(f"{total} blocks stored", f"{len(held)} blocks held, over the capacity "
                     f"of {max_blocks} blocks ({cap} bytes)")
    w.clear(range(NUM_BLOCKS))
    for i in held[-8:]:
        if not w.load([block_hash(i, "cap")], [40]):
            raise w.fail(f"load of held block {i}", "lookup reports it held but its load failed")
        if w.blocks_equal([40], [1 + i % 32]) is not None:
            raise w.fail(f"load of held block {i}", "it came back with different bits")


def failed_load(t: Target) -> None:
    w = World(t, "failed loads")
    if w.load([block_hash(7, "never-stored")], [5]):
        raise w.fail("load of a hash never stored", "the job reported success")


def corrupt_entries(t: Target, corrupt: Corrupt | None) -> None:
    if corrupt is None:
        raise NotApplicable("no corrupt hook: override OffloadConformance.corrupt (or pass "
                            "corrupt=) to damage a stored entry of this tier")
    w = World(t, "corrupt entries")
    hashes = [block_hash(i, "corrupt") for i in range(3)]
    if not w.store(hashes, [1, 2, 3]):
        raise w.fail("store of 3 blocks", "the store job failed")
    corrupt(w.m, hashes[1])
    w.clear(range(NUM_BLOCKS))
    if w.load([hashes[1]], [10]) and w.blocks_equal([10], [2]) is not None:
        raise w.fail("block h1 corrupted, then loaded",
                     "the load reported success with different bits (wrong data)")
    if not w.load([hashes[2]], [11]) or w.blocks_equal([11], [3]) is not None:
        raise w.fail("block h1 corrupted, then h2 loaded", "an intact entry no longer loads")


def _checks(t: Target, corrupt: Corrupt | None) -> dict[str, Callable[[], None]]:
    return {CONSTRUCTOR_PROPERTY: lambda: World(t, CONSTRUCTOR_PROPERTY).m.close(),
            "round trip bit-exact": lambda: round_trip(t), "lookup": lambda: lookup(t),
            "jobs": lambda: jobs(t), "capacity": lambda: capacity(t),
            "failed loads": lambda: failed_load(t),
            "corrupt entries": lambda: corrupt_entries(t, corrupt)}


def check_offload_manager(manager: Any, options: Any = None, corrupt: Corrupt | None = None,
                          only: Iterable[str] | None = None) -> dict[str, str]:
    """Run every offload property against ``manager`` (a Spec, Registration or
    OffloadManager subclass built as ``cls(config, kv_caches, options=...)``).

    :param corrupt: ``corrupt(manager, block_hash)`` damages a stored entry behind
        the tier's back; without it the corrupt-entry property is not applicable.
    :raises ConformanceFailure: naming the first failing property and its input.
    """
    t = resolve_target(manager, options)
    return run_checks(_checks(t, corrupt), set(only) if only is not None else None)


class OffloadConformance:
    """pytest base class: one test per offload property. Define an
    ``offload_manager`` fixture returning ``(spec, options)`` (or the spec or class)."""

    def corrupt(self, manager: Any, block_hash: bytes) -> None:
        """Damage the stored entry ``block_hash`` of ``manager`` (override to enable
        the corrupt-entry property)."""
        raise NotImplementedError

    def _check(self, offload_manager: Any, prop: str) -> None:
        hook = None if type(self).corrupt is OffloadConformance.corrupt else self.corrupt
        skip_if_not_applicable(_checks(resolve_target(offload_manager), hook)[prop])

    def test_constructor_signature(self, offload_manager: Any) -> None:
        self._check(offload_manager, CONSTRUCTOR_PROPERTY)

    def test_round_trip(self, offload_manager: Any) -> None:
        self._check(offload_manager, "round trip bit-exact")

    def test_lookup(self, offload_manager: Any) -> None:
        self._check(offload_manager, "lookup")

    def test_jobs(self, offload_manager: Any) -> None:
        self._check(offload_manager, "jobs")

    def test_capacity(self, offload_manager: Any) -> None:
        self._check(offload_manager, "capacity")

    def test_failed_loads(self, offload_manager: Any) -> None:
        self._check(offload_manager, "failed loads")

    def test_corrupt_entries(self, offload_manager: Any) -> None:
        self._check(offload_manager, "corrupt entries")
