"""llguidance-specific behaviour: grammar kinds, errors, speculative rollback, bitmask."""

from __future__ import annotations

import json

import pytest
import torch
from lmkit.api import InvalidRequestError
from lmkit.testing.tiny_model import make_byte_tokenizer
from lmkit_llguidance.backend import LLGuidanceBackend
from lmkit_llguidance.plugin import LLGuidanceOptions

EOS = 256


@pytest.fixture(scope="module")
def backend():
    return LLGuidanceBackend(make_byte_tokenizer(), 320, options=LLGuidanceOptions())


def ids(text: str) -> list[int]:
    return list(text.encode())


def allowed(grammar) -> set[int]:
    mask = torch.zeros(1, 10, dtype=torch.int32)
    grammar.fill_bitmask(mask, 0)
    bits = (mask[0].to(torch.int64)[:, None] >> torch.arange(32)) & 1
    return set(bits.reshape(-1).nonzero().flatten().tolist())


def test_json_schema_accepts_a_valid_document_and_ends(backend):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    g = backend.compile("json", json.dumps(schema))
    assert g.accept_tokens(ids('{"name":"Ada","age":36}'))
    assert allowed(g) == {EOS}
    assert g.accept_tokens([EOS]) and g.is_terminated()
    g2 = backend.compile("json", schema)
    assert not g2.accept_tokens(ids('{"name":1'))  # a number where a string is required
    assert g2.accept_tokens(ids('{"name":"x"'))


def test_speculative_drafts_roll_back(backend):
    g = backend.compile("regex", r"[0-9]{3}-[a-z]{2}")
    assert g.accept_tokens(ids("12"))
    assert g.accept_tokens(ids("3-a"))  # drafts accepted by the grammar ...
    g.rollback(3)  # ... then rejected by the target model
    assert allowed(g) == set(ids("0123456789"))
    assert g.accept_tokens(ids("4-zz")) and allowed(g) == {EOS}


def test_gbnf_and_lark_grammars(backend):
    gbnf = 'root ::= "(" [a-c]+ ")"'
    g = backend.compile("grammar", gbnf)
    assert g.accept_tokens(ids("(abc)")) and EOS in allowed(g)
    lark = 'start: "x" NUM\nNUM: /[0-9]+/'
    g = backend.compile("grammar", lark)
    assert not g.accept_tokens(ids("y")) and g.accept_tokens(ids("x42"))


@pytest.mark.parametrize(("kind", "spec", "message"), [
    ("regex", "a(b", "unclosed group"),
    ("json", {"type": "no-such-type"}, "no-such-type"),
    ("choice", [], "non-empty list of strings"),
    ("structural_tag", {}, "does not support 'structural_tag'"),
])
def test_bad_constraints_are_invalid_requests(backend, kind, spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        backend.compile(kind, spec)


def test_bitmask_must_be_a_cpu_int32_tensor(backend):
    g = backend.compile("choice", ["a"])
    with pytest.raises(ValueError, match="CPU int32"):
        g.fill_bitmask(torch.zeros(1, 10, dtype=torch.int64), 0)


def merged_tokenizer():
    """A byte-level BPE with merges trained on JSON text: tokens span several bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"ok": true, "name": "ada"}', '{"ok": false, "count": 12}'] * 50
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_multi_byte_tokens_of_a_trained_bpe():
    tokenizer = merged_tokenizer()
    backend = LLGuidanceBackend(tokenizer, 320, options=LLGuidanceOptions())
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    tokens = tokenizer.encode('{"ok":true}')
    assert any(len(tokenizer.decode([t])) > 1 for t in tokens)  # merged tokens are used
    g = backend.compile("json", schema)
    assert g.accept_tokens(tokens)
    assert tokenizer.eos_token_id in allowed(g)
    g.rollback(len(tokens))
    assert not g.accept_tokens(tokenizer.encode('{"no":true}'))
