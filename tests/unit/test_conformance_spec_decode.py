"""The spec-proposer conformance suite against a small prompt-lookup proposer: it
passes; proposers that draft too many tokens, draw at random, mutate their input or
draft invalid ids fail with the batch named."""

from __future__ import annotations

import random

import pytest
from lmkit.api import Proposal, Spec, SpecProposer
from lmkit.testing import ConformanceFailure
from lmkit.testing.spec_decode import check_spec_proposer


class PromptLookup(SpecProposer):
    """Finds the last earlier occurrence of the final two tokens; drafts what followed."""

    def __init__(self, config, options=None):
        self.k = config.speculative.num_speculative_tokens

    def draft(self, tokens: list[int], k: int) -> list[int]:
        if len(tokens) < 3:
            return []
        tail = tokens[-2:]
        for start in range(len(tokens) - 3, -1, -1):
            if tokens[start:start + 2] == tail:
                return tokens[start + 2:start + 2 + k]
        return []

    def propose(self, batch):
        return Proposal([self.draft(t, batch.num_spec_tokens) for t in batch.token_ids])


class OneTooMany(PromptLookup):
    def draft(self, tokens, k):
        return (tokens * (k + 2))[: k + 1] if tokens else []


class Random(PromptLookup):
    def draft(self, tokens, k):
        return [random.randrange(1000) for _ in range(k)]


class Mutates(PromptLookup):
    def draft(self, tokens, k):
        tokens.append(0)
        return []


class StaleIndex(PromptLookup):
    """Indexes each request's first history only: misses tokens added later."""

    def __init__(self, config, options=None):
        super().__init__(config, options)
        self.first: dict[int, list[int]] = {}

    def propose(self, batch):
        drafts = []
        for i, tokens in enumerate(batch.token_ids):
            known = self.first.setdefault(i, list(tokens))
            drafts.append(self.draft(known + [tokens[-1]] if len(tokens) > len(known) else
                                     list(tokens), batch.num_spec_tokens))
        return Proposal(drafts)


class NegativeIds(PromptLookup):
    def draft(self, tokens, k):
        return [-1] if tokens else []


def spec(cls) -> Spec:
    return Spec(name=cls.__name__, target=lambda: cls)


def test_prompt_lookup_passes():
    results = check_spec_proposer(spec(PromptLookup))
    assert results == {"constructor signature": "passed", "valid drafts": "passed", "deterministic": "passed",
                       "inputs untouched": "passed", "incremental updates": "passed",
                       "remove_requests": "passed",
                       "end to end": "not applicable: no model_dir given"}


REPETITIVE = "on input: three repetitive histories"


@pytest.mark.parametrize(("cls", "prop", "where", "message"), [
    (OneTooMany, "valid drafts", REPETITIVE, "request 'a' got 2 drafts, over k=1"),
    (Random, "deterministic", REPETITIVE, "drafts differ between calls"),
    (Mutates, "inputs untouched", REPETITIVE, "propose() modified the token lists"),
    (NegativeIds, "valid drafts", REPETITIVE, "got invalid token ids [-1]"),
    (StaleIndex, "incremental updates", "of growing histories (new tokens",
     "after incremental updates; a fresh instance"),
])
def test_broken_proposers_fail(cls, prop, where, message):
    with pytest.raises(ConformanceFailure) as exc:
        check_spec_proposer(spec(cls), only=[prop])
    assert f"fails property {prop!r}" in str(exc.value)
    assert where in str(exc.value) and message in str(exc.value)
