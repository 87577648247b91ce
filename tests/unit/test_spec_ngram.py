"""The ``ngram`` proposer: prompt lookup against a brute-force reference, incremental
histories, options, registration and the proposer conformance suite."""

from __future__ import annotations

import random

import numpy as np
import pytest
from lmkit.api import ProposerInput
from lmkit.config.schema import LMKitConfig
from lmkit.errors import ConfigError
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack
from lmkit.testing.spec_decode import check_spec_proposer
from lmkit_plugins.spec import NgramOptions
from lmkit_plugins.spec.ngram import NgramProposer, find_drafts


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup one token at a time: longest suffix first, latest match first."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def run(histories: list[list[int]], k: int, min_n: int, max_n: int) -> list[list[int]]:
    width = max(map(len, histories))
    tokens = np.full((len(histories), width + 3), 7, dtype=np.int64)  # junk past the end
    for i, h in enumerate(histories):
        tokens[i, :len(h)] = h
    lens = np.array([len(h) for h in histories], dtype=np.int64)
    drafts, counts = find_drafts(tokens, lens, k, min_n, max_n)
    return [d[:c] for d, c in zip(drafts.tolist(), counts.tolist(), strict=True)]


def proposer(k=4, min_n=2, max_n=4) -> NgramProposer:
    config = LMKitConfig.model_validate({"speculative": {"backend": "ngram",
                                                         "num_speculative_tokens": k}})
    return NgramProposer(config, NgramOptions(prompt_lookup_min=min_n, prompt_lookup_max=max_n))


def test_drafts_what_followed_the_suffix():
    assert run([[1, 2, 3, 4, 5, 1, 2]], 3, 1, 3) == [[3, 4, 5]]
    # the continuation stops at the end of the history
    assert run([[1, 2, 3, 1, 2]], 5, 1, 3) == [[3, 1, 2]]
    # no earlier occurrence, and a history too short to have one
    assert run([[1, 2, 3, 4], [9]], 3, 1, 3) == [[], []]


def test_longest_suffix_wins_then_latest_occurrence():
    # "8 1 2" occurs once (followed by 5); "1 2" occurs later (followed by 6)
    h = [8, 1, 2, 5, 0, 1, 2, 6, 8, 1, 2]
    assert run([h], 1, 2, 3) == [[5]]
    assert run([h], 1, 2, 2) == [[6]]
    # among equal lengths the latest earlier occurrence: 1 2 -> 4 (not 3)
    assert run([[1, 2, 3, 1, 2, 4, 1, 2]], 2, 2, 2) == [[4, 1]]


def test_min_n_rejects_short_matches():
    assert run([[5, 1, 9, 1]], 2, 2, 4) == [[]]
    assert run([[5, 1, 9, 1]], 2, 1, 4) == [[9, 1]]


def test_matches_the_reference_on_random_batches():
    rng = random.Random(0)
    for trial in range(40):
        vocab = rng.choice([2, 3, 5, 50])
        histories = [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
                     for _ in range(rng.randint(1, 9))]
        k, min_n = rng.randint(1, 6), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        got = run(histories, k, min_n, max_n)
        want = [reference(h, k, min_n, max_n) for h in histories]
        assert got == want, (trial, histories, k, min_n, max_n)


def test_proposer_keeps_histories_incrementally():
    rng = random.Random(1)
    p, fresh = proposer(), proposer()
    phrase = [rng.randrange(100) for _ in range(9)]
    hist = {f"r{i}": (phrase * 3)[: 10 + i] for i in range(12)}  # grows the row buffer
    for step in range(5):
        ids = sorted(hist)
        got = p.propose(ProposerInput(ids, [hist[r] for r in ids], 4, None)).draft_token_ids
        want = [reference(hist[r], 4, 2, 4) for r in ids]
        assert got == want
        for r in ids:  # accept a few tokens (the true continuation or a surprise)
            hist[r] = hist[r] + (phrase[:2] if step % 2 else [rng.randrange(100)])
        if step == 2:
            p.remove_requests({"r0", "r5", "unknown"})
            hist["r0"] = [3, 4, 3]  # the same id comes back with another history
    long = (phrase * 200)[:1500]  # longer than the buffer's width
    assert p.propose(ProposerInput(["big"], [long], 4)).draft_token_ids == \
        fresh.propose(ProposerInput(["big"], [long], 4)).draft_token_ids == [long[-9:-5]]


def test_history_that_changed_is_recopied():
    p = proposer(k=2)
    p.propose(ProposerInput(["a"], [[1, 2, 3, 1, 2]], 2))
    assert p.propose(ProposerInput(["a"], [[4, 5, 6, 4, 5]], 2)).draft_token_ids == [[6, 4]]
    assert p.propose(ProposerInput(["a"], [[4, 5]], 2)).draft_token_ids == [[]]


def test_options_are_validated_at_config_time():
    with pytest.raises(ValueError, match="must not exceed"):
        NgramOptions(prompt_lookup_min=5, prompt_lookup_max=3)
    host = PluginHost.load(env={})
    cfg = LMKitConfig.model_validate({"speculative": {
        "backend": "ngram", "options": {"prompt_lookup_max": 3, "prompt_lookup_mni": 1}}})
    with pytest.raises(ConfigError, match="prompt_lookup_mni"):
        resolve_stack(cfg, host)
    cfg = LMKitConfig.model_validate({"speculative": {
        "backend": "ngram", "options": {"prompt_lookup_max": 3, "prompt_lookup_min": 1}}})
    stack = resolve_stack(cfg, host)
    assert stack.get("speculative").name == "ngram"
    assert stack.options["speculative"].prompt_lookup_max == 3


def test_passes_the_proposer_conformance_suite():
    reg = PluginHost.load(env={}).registry.get("speculative", "ngram")
    results = check_spec_proposer(reg)  # end to end: tests/unit/test_spec_engine.py
    assert results.pop("end to end").startswith("not applicable")
    assert "incremental updates" in results and set(results.values()) == {"passed"}
