"""IncrementalDetokenizer and StreamDetokenizer (tokenizers' DecodeStream): streamed text
equals a full decode, multi-byte safe."""

from __future__ import annotations

import random

import pytest
from lmkit.text.detokenizer import IncrementalDetokenizer
from lmkit.text.stream_detokenizer import StreamDetokenizer, backend_tokenizer, make_detokenizer

TEXTS = [
    "Hello, world! Ça va? Naïve café, résumé, Ångström, żółć.",
    "Emoji: 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 and 🤖 robots.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Mixed: x² + y² = z², π ≈ 3.14159, “quotes” — dashes… 🚀 done",
]


def _stream_detokenizer(tok, prompt, skip_special_tokens=True):
    return StreamDetokenizer(backend_tokenizer(tok), prompt, skip_special_tokens)


@pytest.fixture(params=["python", "decode_stream"])
def make(request):
    """Each detokenizer, built as ``make(tokenizer, prompt_ids, skip_special_tokens)``."""
    return IncrementalDetokenizer if request.param == "python" else _stream_detokenizer


def stream(detok: IncrementalDetokenizer | StreamDetokenizer, ids: list[int], chunk_sizes) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = next(chunk_sizes)
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    return deltas


def one_at_a_time():
    while True:
        yield 1


def random_chunks(seed: int):
    rng = random.Random(seed)
    while True:
        yield rng.randint(1, 4)


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_streaming_matches_full_decode(smollm2_tokenizer, text, make):
    tok = smollm2_tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}],
                                     add_generation_prompt=True)
    if not isinstance(prompt, list):  # transformers 5 returns a BatchEncoding
        prompt = prompt["input_ids"]
    output = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    expected = tok.decode(output, skip_special_tokens=True)
    assert expected == text
    for chunks in (one_at_a_time(), random_chunks(0), random_chunks(1)):
        detok = make(tok, list(prompt))
        deltas = stream(detok, output, chunks)
        assert "".join(deltas) == detok.text == expected
        assert not any("\ufffd" in d for d in deltas)


def test_smollm2_split_characters_are_held_until_complete(smollm2_tokenizer, make):
    tok = smollm2_tokenizer
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's bytes are split over several tokens
    detok = make(tok, [])
    deltas = [detok.push([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_smollm2_special_tokens(smollm2_tokenizer, make):
    tok = smollm2_tokenizer
    ids = tok.encode("Hi there", add_special_tokens=False) + [tok.eos_token_id]
    skip = make(tok, [], skip_special_tokens=True)
    keep = make(tok, [], skip_special_tokens=False)
    for i in ids:
        skip.push([i])
        keep.push([i])
    assert skip.text == "Hi there"
    assert keep.text == "Hi there" + tok.eos_token


def test_decode_window_stays_small(smollm2_tokenizer):
    """Each push decodes a bounded window, not the whole output (O(1) per token)."""
    tok = smollm2_tokenizer
    windows = []

    class Recording:
        def decode(self, ids, **kwargs):
            windows.append(len(ids))
            return tok.decode(ids, **kwargs)

    ids = tok.encode(" ".join(TEXTS) * 3, add_special_tokens=False)
    assert len(ids) > 300
    detok = IncrementalDetokenizer(Recording(), [1, 2, 3, 4, 5, 6, 7])
    for i in ids:
        detok.push([i])
    assert detok.text == tok.decode(ids)
    assert max(windows) <= 12


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A tiny sentencepiece-style BPE: ASCII letters and a few merges in its vocabulary;
    every other character falls back to <0xNN> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzHWé,.!":
        vocab[ch] = len(vocab)
    merges = [("▁", "h"), ("e", "l"), ("el", "l"), ("▁h", "ell")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                   eos_token="</s>")


BYTE_TEXTS = ["hello wörld 日本 😀!", "ok. 👨‍👩‍👧 and ŝ ĉ ĝ, the end", "é日é😀é"]


@pytest.mark.parametrize("text", BYTE_TEXTS)
def test_byte_fallback_streaming_matches_full_decode(byte_fallback_tokenizer, text, make):
    tok = byte_fallback_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    tokens = tok.convert_ids_to_tokens(ids)
    assert any(t.startswith("<0x") for t in tokens)  # really exercises byte fallback
    assert tok.decode(ids) == text
    for chunks in (one_at_a_time(), random_chunks(2)):
        detok = make(tok, [])
        deltas = stream(detok, ids, chunks)
        assert "".join(deltas) == detok.text == text
        assert not any("\ufffd" in d for d in deltas)


def test_byte_fallback_with_prompt_context_keeps_the_leading_space(byte_fallback_tokenizer, make):
    tok = byte_fallback_tokenizer
    prompt = tok.encode("hi", add_special_tokens=False)
    full_ids = tok.encode("hi wörld 日本", add_special_tokens=False)
    assert full_ids[:len(prompt)] == prompt
    output = full_ids[len(prompt):]  # "▁w", ...: decoded alone, the space would be stripped
    assert not tok.decode(output).startswith(" ")
    detok = make(tok, prompt)
    text = "".join(detok.push([i]) for i in output)
    full = tok.decode(prompt + output)
    assert text == full[len(tok.decode(prompt)):] == " wörld 日本"


def test_byte_fallback_bytes_release_one_character(byte_fallback_tokenizer, make):
    tok = byte_fallback_tokenizer
    ids = tok.convert_tokens_to_ids(["a", "<0xE6>", "<0x97>", "<0xA5>", "b"])
    detok = make(tok, [])
    assert [detok.push([i]) for i in ids] == ["a", "", "", "日", "b"]


def test_invalid_bytes_are_released_by_following_text_or_flush(byte_fallback_tokenizer, make):
    tok = byte_fallback_tokenizer
    ff, x = tok.convert_tokens_to_ids(["<0xFF>", "x"])
    detok = make(tok, [])
    assert detok.push([x]) == "x"
    assert detok.push([ff]) == ""
    assert detok.push([x]) == "\ufffdx"  # a real invalid byte, not an unfinished one
    assert detok.push([ff]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""
    assert detok.text == "x\ufffdx\ufffd"


def test_make_detokenizer_uses_decode_stream_for_fast_tokenizers(smollm2_tokenizer):
    from transformers import PreTrainedTokenizerFast

    assert isinstance(make_detokenizer(smollm2_tokenizer, [1, 2]), StreamDetokenizer)

    class OwnDecode(PreTrainedTokenizerFast):  # a class that rewrites decoded text
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    own = OwnDecode(tokenizer_object=smollm2_tokenizer.backend_tokenizer)
    assert isinstance(make_detokenizer(own, [1, 2]), IncrementalDetokenizer)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_with_special_tokens_match_full_decode(smollm2_tokenizer, skip):
    """Random output ids (split characters, special tokens between them), pushed one
    at a time and in chunks: the stream equals a full decode after flush."""
    tok = smollm2_tokenizer
    rng = random.Random(3)
    special = tok.all_special_ids
    ids = [rng.choice(special) if rng.random() < 0.05 else rng.randrange(len(tok))
           for _ in range(1500)]
    expected = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    for chunks in (one_at_a_time(), random_chunks(4)):
        detok = make_detokenizer(tok, [], skip_special_tokens=skip)
        text = "".join(stream(detok, ids, chunks)) + detok.flush()
        assert text == detok.text == expected


def test_decode_stream_flush_releases_an_unfinished_character(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("ok 😀", add_special_tokens=False)
    detok = make_detokenizer(tok, [])
    text = "".join(detok.push([i]) for i in ids[:-1])  # the emoji's last byte never comes
    assert text == "ok"
    tail = detok.flush()
    assert text + tail == tok.decode(ids[:-1]) and tail.endswith("\ufffd")
    assert detok.flush() == ""


def test_decode_stream_prompt_ending_inside_a_character(smollm2_tokenizer):
    """A token-id prompt cut inside a multi-byte character: the context is trimmed to a
    whole character, so the prompt's text never leaks into the output."""
    tok = smollm2_tokenizer
    ids = tok.encode("Hi 你好 there", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = make_detokenizer(tok, ids[:cut])
    text = "".join(detok.push([i]) for i in ids[cut:]) + detok.flush()
    assert text.endswith("好 there") and "Hi" not in text
