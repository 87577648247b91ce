"""xgrammar-specific behaviour over the byte tokenizer (one token per byte, EOS 256):
every constraint kind, refusals with their reasons, the terminated state, batch filling
and the bitmask kernel against lmkit's torch reference."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from lmkit.errors import InvalidRequestError
from lmkit.sample.bitmask import allocate_bitmask, apply_token_bitmask, unpack_bitmask
from lmkit.testing.tiny_model import make_byte_tokenizer

pytest.importorskip("xgrammar")
from lmkit_plugins.structured import XGrammarOptions  # noqa: E402
from lmkit_plugins.structured.json_schema_check import unsupported_keywords  # noqa: E402
from lmkit_plugins.structured.json_schema_rewrite import rewrite_short_strings  # noqa: E402
from lmkit_plugins.structured.xgrammar_backend import XGrammarBackend  # noqa: E402

EOS, VOCAB = 256, 320


@pytest.fixture(scope="module")
def backend():
    return XGrammarBackend(make_byte_tokenizer(), VOCAB, options=XGrammarOptions())


def ids(text: str) -> list[int]:
    return list(text.encode())


def allowed(grammar) -> set[int]:
    mask = allocate_bitmask(1, VOCAB)
    grammar.fill_bitmask(mask, 0)
    return set(unpack_bitmask(mask, VOCAB)[0].nonzero().flatten().tolist())


def complete(backend, kind, spec, text) -> bool:
    g = backend.compile(kind, spec)
    return g.accept_tokens(ids(text)) and EOS in allowed(g)


@pytest.mark.parametrize(("kind", "spec", "good", "bad"), [
    ("json", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                      "maximum": 5}}, "required": ["n"]},
     '{"n":3}', '{"n":7}'),
    ("json", '{"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}', '["a","b"]',
     '["a","b","a"]'),
    ("json_object", True, '{"k":{"z":[true]}}', "[1]"),
    ("regex", r"[0-9]{3}-[a-z]{2}", "123-ab", "12-ab"),
    ("grammar", 'root ::= "(" [a-c]+ ")"', "(abc)", "(abd)"),
    ("grammar", 'start: "x" NUM\nNUM: /[0-9]+/', "x42", "y42"),
    ("choice", ['say "hi"', "back\\slash", "new\nline"], 'say "hi"', "say"),
])
def test_each_kind_accepts_its_language_only(backend, kind, spec, good, bad):
    assert complete(backend, kind, spec, good)
    assert not complete(backend, kind, spec, bad)


def test_choice_covers_every_alternative(backend):
    choices = ['say "hi"', "back\\slash", "new\nline", "ünï"]
    assert all(complete(backend, "choice", choices, c) for c in choices)


def test_structural_tag_constrains_the_tagged_part(backend):
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f>"],
        "tags": [{"begin": "<f>", "content": {"type": "json_schema", "json_schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
            "end": "</f>"}]}}
    g = backend.compile("structural_tag", tag)
    assert g.accept_tokens(ids('free text <f>{"a": 1}</f>'))
    assert not backend.compile("structural_tag", tag).accept_tokens(ids('<f>{"a": "x"'))


@pytest.mark.parametrize(("kind", "spec", "message"), [
    ("regex", "a(b", "The parenthesis is not closed"),
    ("json", {"type": "no-such-type"}, 'Unsupported type "no-such-type"'),
    ("json", {"properties": {"x": {"$ref": "#/$defs/missing"}}}, "missing"),
    ("json", "{oops", "not valid JSON"),
    ("grammar", 'root ::= "a" |', "EBNF parser error"),
    ("choice", [], "non-empty list"),
    ("structural_tag", {"type": "nonsense"}, "structural_tag"),
    ("xml", "<a/>", "does not support 'xml' constraints"),
])
def test_malformed_constraints_are_invalid_requests(backend, kind, spec, message):
    with pytest.raises(InvalidRequestError, match=message) as exc:
        backend.compile_shared(kind, spec)
    assert exc.value.param == "structured_outputs"
    assert ".cc:" not in str(exc.value)  # xgrammar's log prefix is stripped


@pytest.mark.parametrize(("schema", "keyword", "where"), [
    ({"type": "array", "uniqueItems": True}, "uniqueItems", "#"),
    ({"properties": {"a": {"not": {"type": "string"}}}}, "not", "#/properties/a"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if", "#"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "allOf", "#"),
    ({"items": {"type": "string", "pattern": "^a+$", "maxLength": 3}}, "maxLength", "#/items"),
    ({"type": "string", "format": "email", "minLength": 3}, "minLength", "#"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "#"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "multipleOf", "#"),
    ({"$defs": {"d": {"dependentRequired": {"a": ["b"]}}}}, "dependentRequired", "#/$defs/d"),
])
def test_keywords_xgrammar_would_ignore_are_refused(backend, schema, keyword, where):
    assert (keyword, where) in [(k, p) for k, p, _ in unsupported_keywords(schema)]
    with pytest.raises(InvalidRequestError, match=re.escape(f"keyword '{keyword}' (at {where})")):
        backend.compile_shared("json", schema)


def test_property_names_that_look_like_keywords_are_fine(backend):
    schema = {"type": "object", "properties": {"not": {"type": "integer"},
                                               "if": {"type": "boolean"}}}
    assert unsupported_keywords(schema) == []
    assert complete(backend, "json", schema, '{"not":1,"if":true}')
    assert unsupported_keywords({"allOf": [{"type": "integer"}],
                                 "type": "integer", "multipleOf": 3}) == []


def test_a_terminated_grammar_allows_only_stop_tokens_and_rolls_back(backend):
    g = backend.compile("regex", "ab")
    assert g.accept_tokens(ids("ab") + [EOS]) and g.is_terminated()
    assert allowed(g) == {EOS}
    assert g.accept_tokens([EOS]) and not g.accept_tokens(ids("a"))
    g.rollback(2)  # the extra EOS, then the matcher's
    assert not g.is_terminated() and allowed(g) == {EOS}
    g.rollback(1)
    assert allowed(g) == {ord("b")}


def test_compact_json_by_default_flexible_on_request():
    tokenizer = make_byte_tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact = XGrammarBackend(tokenizer, VOCAB, options=XGrammarOptions())
    flexible = XGrammarBackend(tokenizer, VOCAB,
                               options=XGrammarOptions(whitespace_flexible=True))
    assert not complete(compact, "json", schema, '{ "a": 1 }')
    assert complete(flexible, "json", schema, '{ "a": 1 }')


def test_batch_fill_equals_one_by_one(backend):
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string"}}})
    prefixes = ["", '{"', '{"s":"ab', '{"s":"ab"', '{"s":"ab"}', "{}"]
    grammars = []
    for p in prefixes:
        g = backend.compile("json", schema)
        assert g.accept_tokens(ids(p))
        grammars.append(g)
    assert grammars[4].accept_tokens([EOS])  # one terminated grammar in the batch
    one = allocate_bitmask(len(grammars) + 2, VOCAB)
    for row, g in enumerate(grammars, 2):
        g.fill_bitmask(one, row)
    batch = allocate_bitmask(len(grammars) + 2, VOCAB)
    backend.fill_bitmasks(grammars, batch, list(range(2, len(grammars) + 2)))
    assert torch.equal(one, batch)


def test_kernel_matches_the_torch_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 333, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 11), dtype=torch.int32, generator=g)
    expected = logits.clone()
    apply_token_bitmask(expected, bitmask, [0, 3])
    XGrammarBackend.apply_token_bitmask(logits, bitmask, [0, 3])
    assert torch.equal(logits, expected)


def test_short_string_rewrites_stop_at_a_budget():
    """Each pattern costs compile time (0.4 s for maxLength 64 with a 49k vocabulary):
    past the budget of summed bounds the strings keep their keywords."""
    from lmkit_plugins.structured.json_schema_rewrite import REWRITE_BUDGET, SHORT_STRING_MAX

    short = {"type": "string", "maxLength": SHORT_STRING_MAX}
    n = 3 * REWRITE_BUDGET // SHORT_STRING_MAX
    schema = {"type": "object", "properties": {f"p{i}": short for i in range(n)}}
    props = rewrite_short_strings(schema)["properties"]
    rewritten = [k for k, v in props.items() if "pattern" in v]
    assert rewritten == [f"p{i}" for i in range(REWRITE_BUDGET // SHORT_STRING_MAX)]
    assert all(props[f"p{i}"] == short for i in range(len(rewritten), n))
    assert rewrite_short_strings(schema, budget=10 ** 6)["properties"]["p0"] == props["p0"]


def test_short_string_bounds_compile_as_an_equivalent_pattern(backend):
    bounded = {"type": "string", "minLength": 2, "maxLength": 4}
    schema = {"type": "object", "properties": {"s": bounded, "t": {"anyOf": [bounded]}},
              "required": ["s"], "additionalProperties": False}
    rewritten = rewrite_short_strings(schema)
    assert rewritten["properties"]["s"] == {"type": "string", "pattern": "^[\\s\\S]{2,4}$"}
    assert rewritten["properties"]["t"]["anyOf"][0] == rewritten["properties"]["s"]
    assert schema["properties"]["s"] == bounded  # a copy
    for kept in ({"type": "string", "maxLength": 1000}, {"maxLength": 3, "pattern": "^a+$"},
                 {"maxLength": 3, "format": "date"}):
        assert rewrite_short_strings(kept) == kept
    rng = random.Random(0)
    pieces = ["a", "b", " ", "é", '\\"', "\\\\", "\\n", "\\u00e9", "\\t", "\\/", '"']
    seen = set()
    for _ in range(400):
        body = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        doc = '{"s":"' + body + '"}'
        try:
            value = json.loads(doc)
            jsonschema.validate(value, schema)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        accepted = complete(backend, "json", schema, doc)
        assert not accepted or valid, doc  # never accepts what the schema refuses
        if valid and all(c in "ab é" for c in body):
            assert accepted, doc  # and accepts plain strings of every allowed length
            seen.add(len(value["s"]))
    assert seen == {2, 3, 4}
