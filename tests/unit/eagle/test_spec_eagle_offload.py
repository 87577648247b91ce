"""EAGLE heads beside a KV offload tier: the tier carries the head's KV blocks with the
target's. A prefix pushed out of a small device pool comes back with the head's KV: the
head's blocks a load fills hold exactly what the head had written for those tokens when
they were stored (checked block by block, by block hash), greedy outputs are exact, and
every draft equals the one made where the prefix never left the device. The control (a
tier that carries the target's blocks only) fails the block check, so it can fail."""

from __future__ import annotations

import random

import pytest
import torch
from eagle_engine import run_engine
from lmkit import SamplingParams


def _prefix(seed: int) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(97, 123)) for _ in range(28))


P1, P2, P3 = _prefix(1), _prefix(2), _prefix(3)
# one at a time: each prefix pushes the one before out of a 17-block pool of 4 tokens
PROMPTS = [P1 + "ab", P2 + "cd", P3 + "ef", P1 + "gh"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(PROMPTS)
TIER = {"backend": "cpu", "options": {"size_gb": 0.01}}


def _run(tiny, head, monkeypatch, proposer, **kw):
    return run_engine(tiny, head, monkeypatch, PROMPTS, proposer=proposer, params=PARAMS,
                      max_num_seqs=1, **kw)


def _watch_head_blocks(monkeypatch, carry_head: bool) -> dict[str, int]:
    """Wrap the runner's offload worker: record the head's KV of every block the tier
    stores (by hash, as stored), and compare the head's blocks each load fills with the
    record. ``carry_head=False`` builds the tier over the target's caches only."""
    import lmkit.worker.model_runner as model_runner

    build = model_runner.build_offload_worker
    counts = {"loaded": 0, "same": 0}

    def watched(config, stack, caches, groups):
        n = len(groups[-1].layers)  # the head's group is the last one
        head = caches[-n:]
        worker = (build(config, stack, caches, groups) if carry_head
                  else build(config, stack, caches[:-n], groups[:-n]))
        stored: dict[bytes, list[torch.Tensor]] = {}
        start, after_forward = worker.start, worker.after_forward

        def record(hashes, block_ids):
            for h, b in zip(hashes, block_ids, strict=True):
                stored[h] = [c[:, b].clone() for c in head]

        def start_watched(transfers):
            if transfers and transfers.store_hashes:
                record(transfers.store_hashes, transfers.store_block_ids)
            start(transfers)
            for load in transfers.loads if transfers else ():
                for h, b in zip(load.block_hashes, load.block_ids, strict=True):
                    counts["loaded"] += 1
                    counts["same"] += all(torch.equal(c[:, b], s)
                                          for c, s in zip(head, stored[h], strict=True))

        def after_forward_watched(transfers):
            if transfers and transfers.write_hashes:
                record(transfers.write_hashes, transfers.write_block_ids)
            after_forward(transfers)

        worker.start, worker.after_forward = start_watched, after_forward_watched
        return worker

    monkeypatch.setattr(model_runner, "build_offload_worker", watched)
    return counts


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_the_tier_carries_the_heads_kv(tiny, heads, monkeypatch, proposer):
    head = heads[proposer]
    on_device, _ = _run(tiny, head, monkeypatch, proposer, num_blocks=96)
    counts = _watch_head_blocks(monkeypatch, carry_head=True)
    offloaded, stats = _run(tiny, head, monkeypatch, proposer, num_blocks=17, offload=TIER)
    assert stats["offload_loaded_blocks"] >= 5 and stats["offload_failed_loads"] == 0, stats
    assert counts["loaded"] == stats["offload_loaded_blocks"] == counts["same"], counts
    assert stats["spec_num_draft_tokens"] > 0
    # same keys: the same tokens at every step; same values: the same drafts
    assert offloaded == on_device

    counts = _watch_head_blocks(monkeypatch, carry_head=False)  # the control
    _, stats = _run(tiny, head, monkeypatch, proposer, num_blocks=17, offload=TIER)
    assert counts["loaded"] == stats["offload_loaded_blocks"] >= 5
    assert counts["same"] < counts["loaded"], counts


def test_draft_trees_beside_the_tier(tiny, heads, monkeypatch):
    """With a draft tree (accepted nodes moved to a chain's slots before the write-through
    stores): loads bring back the head's KV as stored, outputs and trees stay those made
    where the prefix never left the device."""
    tree = {"tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0]], "k": 5}
    head = heads["eagle3"]
    on_device, _ = _run(tiny, head, monkeypatch, "eagle3", num_blocks=96, **tree)
    counts = _watch_head_blocks(monkeypatch, carry_head=True)
    offloaded, stats = _run(tiny, head, monkeypatch, "eagle3", num_blocks=17, offload=TIER,
                            **tree)
    assert stats["offload_loaded_blocks"] >= 5 and stats["offload_failed_loads"] == 0, stats
    assert counts["loaded"] == stats["offload_loaded_blocks"] == counts["same"], counts
    assert stats["spec_num_draft_tokens"] > 0 and offloaded == on_device


def test_a_head_laid_out_unlike_the_target_is_refused_with_offload():
    from lmkit.errors import ConfigError
    from lmkit.worker.memory import check_head_blocks_offloadable

    target = [torch.zeros(2, 8, 4, 2, 16)]
    check_head_blocks_offloadable(target, [torch.zeros(2, 8, 4, 2, 16)])
    for head in ([torch.zeros(2, 8, 4, 4, 16)], [torch.zeros(2, 8, 4, 2, 16, dtype=torch.half)]):
        with pytest.raises(ConfigError, match=r"the head's cache is \[2, 8, 4, \d, 16\] .*"
                                              r"turn offload off"):
            check_head_blocks_offloadable(target, head)


def test_a_draft_heads_files_count_in_the_disk_fingerprint(tiny, heads, tmp_path):
    """Blocks persisted with one head's KV are never loaded beside another head's."""
    from lmkit.api.offload import kv_cache_fingerprint
    from lmkit.config import LMKitConfig

    caches = [torch.zeros(2, 8, 4, 2, 16)] * 3

    def fingerprint(head=None):
        spec = {"backend": "eagle", "model": str(head)} if head else {}
        return kv_cache_fingerprint(LMKitConfig.model_validate(
            {"model": {"model": str(tiny)}, "speculative": spec}), caches)

    plain, eagle, eagle3 = fingerprint(), fingerprint(heads["eagle"]), fingerprint(heads["eagle3"])
    assert len({plain, eagle, eagle3}) == 3
    assert fingerprint(heads["eagle"]) == eagle
