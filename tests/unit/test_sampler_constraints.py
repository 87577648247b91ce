"""allowed_token_ids and bad_words in the sampler (crafted logits, with and without
drafts), their validation in SamplingParams and the frontend, and bad-word tokenization."""

from __future__ import annotations

import pytest
import torch
from lmkit.api.sampling_params import SamplingParams
from lmkit.errors import InvalidRequestError
from lmkit.frontend.processor import InputProcessor, tokenize_bad_words
from lmkit.sample.metadata import SamplingMetadata, bad_words_banned
from lmkit.sample.sampler import Sampler
from lmkit.spec_decode.rows import DraftExtendedTokens, is_plain_greedy

CPU = torch.device("cpu")
V = 8


def build(params, outputs=None, vocab=V) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[0]] * n, outputs or [[]] * n, [None] * n,
                                  [None] * n, vocab, CPU)


def test_allowed_token_ids_mask_every_other_token_greedy_and_random():
    logits = torch.arange(V, dtype=torch.float32).repeat(3, 1)  # argmax 7 everywhere
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[2, 5]),
              SamplingParams(temperature=1.0, allowed_token_ids=[1]),
              SamplingParams(temperature=0.0)]
    md = build(params)
    assert md.needs_logit_adjustment and md.allowed_rows.tolist() == [0, 1]
    for _ in range(5):
        assert Sampler()(logits, md).sampled_token_ids.tolist() == [5, 1, 7]
    assert logits[0, 7] == 7.0  # the caller's logits are not modified


def test_allowed_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(InvalidRequestError, match="allowed_token_ids names token id 9"):
        build([SamplingParams(allowed_token_ids=[1, 9])])


@pytest.mark.parametrize(("output", "banned"), [
    ([], [4]), ([1], [4, 2]), ([1, 2], [4, 3]), ([3, 1, 2], [4, 3]), ([2, 1], [4, 2]),
    ([2, 2], [4])])
def test_bad_words_ban_the_last_token_after_a_matching_prefix(output, banned):
    words = [[4], [1, 2, 3], [1, 2]]  # one token: always; else after the other tokens
    assert bad_words_banned(words, output) == banned


def test_bad_words_in_the_sampler_at_every_draft_position():
    """A request with drafts [1, 2]: row 0 sees output [5], row 1 [5, 1], row 2 [5, 1, 2].
    Bad word (1, 2) bans 2 only at row 1; (1, 2, 6) bans 6 only at row 2."""
    logits = torch.zeros(3, V)
    logits[:, 2] = 3.0  # argmax 2 everywhere, then 6, then 1
    logits[:, 6] = 2.0
    logits[:, 1] = 1.0
    p = SamplingParams(temperature=0.0, bad_words_token_ids=[[1, 2], [1, 2, 6]])
    outputs = [[5], DraftExtendedTokens([5], [1, 2], 1), DraftExtendedTokens([5], [1, 2], 2)]
    md = build([p] * 3, outputs)
    assert list(zip(md.banned_rows.tolist(), md.banned_token_ids.tolist(),
                    strict=True)) == [(1, 2), (2, 6)]
    rows = Sampler()(logits, md).sampled_token_ids.tolist()
    assert rows == [2, 6, 2]
    # verification: draft 1 at row 0 is rejected (target 2), so the output is [2]
    out = Sampler().sample_requests(logits, md, [[1, 2]])
    assert out.token_ids == [[2]] and out.num_accepted == [0]
    out = Sampler().sample_requests(logits, md, [[2, 6]])  # both accepted, bonus 2
    assert out.token_ids == [[2, 6, 2]]


def test_constraints_leave_the_plain_greedy_path():
    assert is_plain_greedy(SamplingParams(temperature=0.0), 0)
    for kw in (dict(allowed_token_ids=[1]), dict(bad_words_token_ids=[[1]]),
               dict(logits_processors=["x"])):
        assert not is_plain_greedy(SamplingParams(temperature=0.0, **kw), 0)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids must be non-negative token ids"),
    (dict(bad_words=[""]), "bad_words must be non-empty strings"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids must be non-empty lists"),
    (dict(logits_processors=[""]), "logits_processors must be names"),
    (dict(extra_args=[1]), "extra_args must be a mapping"),
])
def test_sampling_params_validate_the_new_fields(kw, message):
    with pytest.raises(InvalidRequestError, match=message) as exc:
        SamplingParams(**kw)
    assert exc.value.param == next(iter(kw))


def test_sampling_params_normalise_single_strings():
    p = SamplingParams(bad_words="no", logits_processors="a")
    assert p.bad_words == ["no"] and p.logits_processors == ["a"]


class Tok:
    """Words tokenize to one id per character, a leading space to id 0."""

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return [0 if c == " " else ord(c) - 96 for c in text]


def test_bad_words_tokenize_as_is_and_after_a_space():
    assert tokenize_bad_words(Tok(), ["ab", " c"]) == [[1, 2], [0, 1, 2], [3], [0, 3]]


def test_frontend_tokenizes_bad_words_and_checks_ids():
    proc = InputProcessor(Tok(), max_model_len=64, eos_token_id=None, vocab_size=27)
    req = proc.make_request("r", [1, 2], SamplingParams(bad_words=["ab"],
                                                         bad_words_token_ids=[[5]]))
    assert req.sampling_params.bad_words_token_ids == [[5], [1, 2], [0, 1, 2]]
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids has token ids outside "
                       r"the vocabulary \[0, 27\): \[30\]"):
        proc.make_request("r", [1], SamplingParams(allowed_token_ids=[30]))
    with pytest.raises(InvalidRequestError, match="unknown logits processor 'x'; known: none"):
        proc.make_request("r", [1], SamplingParams(logits_processors=["x"]))
