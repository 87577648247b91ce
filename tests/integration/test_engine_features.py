"""Prefix caching, sampling, streaming, stop strings and errors through the offline API."""

from __future__ import annotations

import pytest
from lmkit import LLM, SamplingParams
from lmkit.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError

pytestmark = pytest.mark.slow  # loads SmolLM2 once per module (about 6 s)


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    with LLM(str(smollm2_dir), dtype="float32", block_size=16) as engine:
        yield engine


def test_prefix_cache_hit_skips_prefix_compute(llm):
    tok = llm.tokenizer
    prefix = tok.encode("The history of the printing press begins in antiquity. " * 12)
    a = prefix + tok.encode(" Question one: who?")
    b = prefix + tok.encode(" Question two: when did it spread to other countries?")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([a], params)
    before = llm.stats()["num_scheduled_tokens"]
    out = llm.generate([b], params)[0]
    computed = llm.stats()["num_scheduled_tokens"] - before
    block = llm.config.cache.block_size
    assert out.num_cached_tokens >= (len(prefix) // block) * block
    assert out.num_cached_tokens // block >= len(prefix) // block
    # prefill computed only the uncached rest, then one token per decode step
    assert computed == (len(b) - out.num_cached_tokens) + (4 - 1)


def test_seeded_sampling_reproducible_across_batches(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.generate(["Tell me a story about a dragon."], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=n) for n in (5, 9, 13)]
    batch = llm.generate(
        ["Hello!", "Tell me a story about a dragon.", "What is 2+2?", "Name a colour."],
        [others[0], params, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone


def test_n_returns_distinct_samples(llm):
    out = llm.generate(["Write a word that rhymes with cat:"],
                       SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.finished and all(c.finished for c in out.outputs)


def test_streaming_deltas_concatenate_to_final_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=32)
    pieces, last = [], None
    for out in llm.stream("Describe a sunrise over the sea.", params):
        pieces.append(out.outputs[0].delta_text)
        last = out
    assert last is not None and last.finished
    assert "".join(pieces) == last.outputs[0].text
    full = llm.generate(["Describe a sunrise over the sea."], params)[0].outputs[0]
    assert full.text == last.outputs[0].text


def test_stop_strings_never_appear(llm):
    base = llm.generate(["List the numbers from one to ten, in words, separated by commas:"],
                        SamplingParams(temperature=0.0, max_tokens=48))[0].outputs[0].text
    words = [w.strip() for w in base.split(",") if w.strip()]
    assert len(words) >= 3, base
    stop = words[2][:4]
    params = SamplingParams(temperature=0.0, max_tokens=48, stop=[stop])
    streamed = "".join(o.outputs[0].delta_text for o in llm.stream(
        "List the numbers from one to ten, in words, separated by commas:", params))
    out = llm.generate(["List the numbers from one to ten, in words, separated by commas:"],
                       params)[0].outputs[0]
    assert stop not in out.text and stop not in streamed
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == streamed == base[: base.index(stop)]


def test_prompt_longer_than_context_is_rejected(llm):
    too_long = [100] * (llm.config.model.max_model_len + 1)
    with pytest.raises(InvalidRequestError, match="context") as e:
        llm.generate([too_long], SamplingParams(max_tokens=1))
    assert e.value.code == "context_length_exceeded"


def test_max_tokens_below_one_is_rejected():
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_engine_still_serves_after_bad_request(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[10**9]], SamplingParams(max_tokens=2))
    out = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


def test_unknown_model_path_or_alias(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2"):
        LLM("smollm2-135m-instruc")
    with pytest.raises(ModelNotFoundError):
        LLM(str(tmp_path / "nope"))


def test_corrupt_weights_file(tmp_path, smollm2_dir):
    import shutil

    for f in smollm2_dir.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    weights = next(tmp_path.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=weights.name):
        LLM(str(tmp_path))
