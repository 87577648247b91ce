"""allowed_token_ids, bad_words and a logits-processor plugin through ``LLM`` on the
tiny random model (byte tokenizer: token id = byte, 256 = EOS), with and without
speculative decoding. The plugin is a real distribution (tests/fixtures/dists/
lmkit-testplugin-logits) found through the ``lmkit`` entry-point group."""

from __future__ import annotations

import pytest
from lmkit import LLM, SamplingParams
from lmkit.errors import InvalidRequestError
from lmkit.testing.tiny_model import make_tiny_model

PROMPTS = ["abcabcabcabc", "hello world, hello world", "xyz"]
SPEC = dict(speculative="ngram", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-sampler"))


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), max_model_len=256) as engine:
        yield engine


def tokens(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_only_those_are_sampled(llm, temperature):
    allowed = [ord("q"), ord("r"), 7]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=12, ignore_eos=True,
                            allowed_token_ids=allowed)
    outs = tokens(llm, params)
    assert all(len(o) == 12 and set(o) <= set(allowed) for o in outs)
    free = tokens(llm, SamplingParams(temperature=temperature, seed=3, max_tokens=12,
                                      ignore_eos=True))
    assert any(not set(o) <= set(allowed) for o in free)  # the constraint did something


LETTERS = list(range(ord("a"), ord("z") + 1))  # one token per letter


def test_bad_words_are_never_generated(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                            allowed_token_ids=LETTERS)
    first = tokens(llm, greedy)[0]
    # ban a two-letter word the unconstrained output contains, and its first letter
    word, single = bytes(first[3:5]).decode(), bytes(first[:1]).decode()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                            allowed_token_ids=LETTERS, bad_words=[word, single])
    out = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    assert first[0] not in out
    pairs = list(zip(out, out[1:], strict=False))
    assert (first[3], first[4]) not in pairs
    assert out != first


def test_bad_words_with_speculative_decoding_match_plain(model_dir, llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                            bad_words=["bc", "o"], allowed_token_ids=LETTERS)
    plain = tokens(llm, params)
    with LLM(str(model_dir), max_model_len=256, **SPEC) as spec:
        assert tokens(spec, params) == plain
        assert spec.stats()["spec_num_draft_tokens"] > 0
    for out in plain:
        assert ord("o") not in out
        assert (ord("b"), ord("c")) not in set(zip(out, out[1:], strict=False))


def test_unknown_token_ids_and_empty_lists_are_refused(llm):
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids has token ids outside "
                       r"the vocabulary \[0, 320\): \[999\]"):
        llm.generate(["a"], SamplingParams(allowed_token_ids=[1, 999]))
    with pytest.raises(InvalidRequestError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(InvalidRequestError, match="bad_words must be non-empty strings"):
        SamplingParams(bad_words=["ok", ""])
