"""Write-through offload stores (``offload.store_policy``), tiny random model on CPU:
full blocks are held by the tier right after the step that computed them, before any
eviction; their eviction later copies nothing; outputs equal recomputing."""

from __future__ import annotations

import pytest
import test_offload as base
from lmkit import LLM
from test_offload import BLOCK, BLOCK_BYTES, ENGINE, P1, P2, PARAMS, PREFIX, generate, tier_options

model_dir, reference = base.model_dir, base.reference  # the fixtures, shared


def engine(model_dir, tier: str, options: dict, policy: str = "write_through") -> LLM:
    return LLM(str(model_dir), offload=tier, **ENGINE,
               **{"offload.options": options, "offload.store_policy": policy})


def test_blocks_are_held_right_after_their_prefill(model_dir, tmp_path):
    with engine(model_dir, "cpu", tier_options("cpu", tmp_path)) as llm:
        llm.generate([P1 + [1, 2, 3]], PARAMS)
        stats = llm.stats()
        assert stats["offload_stored_blocks"] == 0, "nothing was evicted yet"
        num_full = (PREFIX + 3 + PARAMS.max_tokens - 1) // BLOCK  # 15 prompt + 0 decode
        assert stats["offload_written_blocks"] == num_full
        assert stats["offload_copied_out_blocks"] == num_full
        assert stats["offload_used_bytes"] == num_full * BLOCK_BYTES
        llm.generate([P2 + [4, 5]], PARAMS)  # pushes P1's blocks out of the device pool
        after = llm.stats()
    assert after["offload_stored_blocks"] > 0, "P2 should have evicted P1's blocks"
    # the evictions copied nothing: every copy out was a write-through of a new block
    assert after["offload_copied_out_blocks"] == after["offload_written_blocks"]


@pytest.mark.parametrize("tier", ["cpu", "cpu+disk"])
def test_write_through_hits_match_recompute(model_dir, reference, tier, tmp_path):
    with engine(model_dir, tier, tier_options(tier, tmp_path)) as llm:
        tokens, cached = generate(llm)
        stats = llm.stats()
    assert tokens == reference
    assert cached[3] == PREFIX, "P1's whole prefix should have come back from the tier"
    assert stats["offload_written_blocks"] > 0 and stats["offload_failed_loads"] == 0
    if tier == "cpu":
        assert stats["offload_copied_out_blocks"] == stats["offload_written_blocks"]


def test_write_through_in_a_small_tier_matches_recompute(model_dir, reference):
    """The tier evicts (LRU) what write-through fills it with; evictions of blocks it
    dropped are stored again on eviction."""
    with engine(model_dir, "cpu", {"size_gb": 20 * BLOCK_BYTES / 2**30}) as llm:
        tokens, _ = generate(llm)
        stats = llm.stats()
    assert tokens == reference
    assert stats["offload_evictions"] > 0 and stats["offload_failed_loads"] == 0


def test_on_evict_policy_stores_only_evictions(model_dir, reference, tmp_path):
    with engine(model_dir, "cpu", tier_options("cpu", tmp_path), "on_evict") as llm:
        tokens, cached = generate(llm)
        stats = llm.stats()
    assert tokens == reference and cached[3] == PREFIX
    assert stats["offload_written_blocks"] == 0
    assert stats["offload_copied_out_blocks"] > 0
