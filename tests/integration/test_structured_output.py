"""Structured output end to end on SmolLM2-135M-Instruct (CPU) with the ``xgrammar``
backend: 24 JSON schemas plus regex, choice and EBNF constraints, greedy and sampled in
one batch, every output parsed and validated; under preemption; with draft tokens
(bitmask rows per draft position, rejected drafts rolled back), given by hand and by the
ngram proposer; n > 1, streaming, stop strings, ignore_eos; and refusals."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from lmkit import LLM, SamplingParams
from lmkit.errors import InvalidRequestError

pytestmark = pytest.mark.slow  # SmolLM2 with grammars, up to 8 s per test

pytest.importorskip("xgrammar")

NAME = {"type": "string", "minLength": 1, "maxLength": 12}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": list(props) if required is None else required}


def integer(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


SCHEMAS = {
    "person": obj({"name": NAME, "age": integer(0, 120)}),
    "city": obj({"city": NAME, "country": NAME, "population_millions": integer(0, 50)}),
    "book": obj({"title": {"type": "string", "maxLength": 20}, "year": integer(1500, 2025),
                 "genre": {"enum": ["fiction", "science", "history", "poetry"]}}),
    "color": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "shop status": obj({"is_open": {"type": "boolean"}, "reason": {"type": "string",
                                                                   "maxLength": 16}}),
    "tag list": obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                              "minItems": 1, "maxItems": 3}}),
    "score list": obj({"scores": {"type": "array", "items": integer(0, 100), "minItems": 2,
                                  "maxItems": 4}}),
    "address": obj({"name": NAME, "address": obj({
        "street": {"type": "string", "maxLength": 16},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    "ticket": obj({"id": integer(1, 999), "note": {"type": "string", "maxLength": 10}},
                  required=["id"]),
    "product code": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    "temperature": obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60},
                        "unit": {"const": "C"}}),
    "rating": obj({"stars": integer(1, 5), "recommend": {"type": "boolean"}}),
    "point": obj({"x": integer(-10, 10), "y": integer(-10, 10)}),
    "order": obj({"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": obj(
        {"name": {"type": "string", "maxLength": 8}, "qty": integer(1, 9)})}}),
    "date": obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    "email": obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    "value": obj({"value": {"anyOf": [integer(0, 99), {"type": "string", "maxLength": 6}]}}),
    "profile": obj({"middle_name": {"type": ["string", "null"], "maxLength": 8},
                    "age": integer(0, 99)}),
    "matrix": obj({"rows": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": integer(0, 9)}}}),
    "pet owner": {"$defs": {"pet": obj({"kind": {"enum": ["cat", "dog"]},
                                        "age": integer(0, 30)})},
                  **obj({"owner": NAME, "pet": {"$ref": "#/$defs/pet"}})},
    "weather": obj({"sky": {"enum": ["sunny", "cloudy", "rainy"]}, "wind_kmh": integer(0, 200),
                    "alerts": {"type": "array", "items": {"enum": ["storm", "heat", "flood"]},
                               "maxItems": 2}}),
    "nested": obj({"a": obj({"b": obj({"c": integer(0, 9)})})}),
    "word": obj({"word": {"type": "string", "pattern": "^[a-z]{3,6}$"}}),
    "price": obj({"item": {"type": "string", "maxLength": 10},
                  "price": {"type": "number", "minimum": 0, "exclusiveMaximum": 1000}}),
}
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["Paris", "London", "Berlin"]
EBNF = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,20} "."'
EBNF_RE = r"(yes|no) because [a-z ]{3,20}\."
MAX_TOKENS = 80


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def check(kind: str, spec, text: str) -> None:
    """Raise unless ``text`` satisfies the constraint."""
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "choice":
        assert text in spec, text
    else:
        assert re.fullmatch(spec, text), (spec, text)


CASES = [("json", s, f"Reply with a JSON object describing a {n}.") for n, s in SCHEMAS.items()]
CASES += [("regex", REGEX, "Give me a phone number."), ("choice", CHOICES,
          "What is the capital of France?"), ("grammar", EBNF, "Is the sky blue?")]


def constraint(kind, spec) -> dict:
    return {kind: spec}


def oracle(kind, spec):
    return (kind, EBNF_RE if kind == "grammar" else spec)


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    with LLM(str(smollm2_dir), dtype="float32", max_num_seqs=64, max_model_len=512) as engine:
        yield engine


def test_every_output_parses_and_validates_greedy_and_sampled(llm):
    convs, params, cases = [], [], []
    for mode in ("greedy", "sampled"):
        for i, (kind, spec, prompt) in enumerate(CASES):
            sampling = dict(temperature=0.0) if mode == "greedy" else dict(temperature=1.0,
                                                                            seed=i)
            convs.append(chat(prompt))
            params.append(SamplingParams(max_tokens=MAX_TOKENS,
                                         structured_outputs=constraint(kind, spec), **sampling))
            cases.append((mode, kind, spec))
    assert len([c for c in cases if c[1] == "json"]) >= 40  # 24 schemas x 2 modes
    outs = llm.chat(convs, params)
    for (mode, kind, spec), out in zip(cases, outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (mode, kind, spec, c.text)
        check(*oracle(kind, spec), c.text)
    stats = llm.stats()
    assert stats["num_constrained_requests"] == 0 and stats["num_grammars_compiling"] == 0
    assert stats["grammar_cache_entries"] == len(CASES)  # compiled once, shared by both modes


def test_grammar_state_survives_preemption(smollm2_dir):
    # 62-token prompts take 4 blocks each: two requests leave one block free, so the
    # second block boundary either crosses preempts the other (recomputed later)
    with LLM(str(smollm2_dir), dtype="float32", block_size=16, num_blocks=10,
             max_model_len=128) as small:
        names = ["person", "order", "weather", "address", "matrix", "book"]
        params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=64,
                                 structured_outputs={"json": SCHEMAS[n]})
                  for i, n in enumerate(names)]
        filler = "Describe it carefully, with realistic values, in one compact line. " * 4
        outs = small.generate([f"Request {i}. {filler}JSON for a {n}: "
                               for i, n in enumerate(names)], params)
        assert small.stats()["num_preemptions"] > 0
    for name, out in zip(names, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name])


def run_with_drafts(llm, prompt: str, params: SamplingParams, drafts_for) -> list[int]:
    """Drive the engine step by step, giving the request ``drafts_for(tokens so far)`` as
    its draft tokens before every step (what a proposer would do)."""
    engine = llm.engine
    _, ids = llm.input_processor.tokenize(None, chat(prompt))
    engine.add_request(llm.input_processor.make_request("drafted", ids, params))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        request = engine.scheduler.requests.get("drafted")
        if request is not None and request.num_computed_tokens == request.num_tokens - 1:
            request.spec_token_ids = drafts_for(tokens)
    return tokens


def test_draft_positions_get_their_own_rows_and_rejected_drafts_roll_back(llm):
    schema = SCHEMAS["order"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured_outputs={"json": schema})
    prompt = "Reply with a JSON object describing an order."
    reference = llm.chat(chat(prompt), params)[0].outputs[0].token_ids
    bad = llm.tokenizer.encode("!!", add_special_tokens=False)[0]  # never valid in JSON here

    def drafts_for(tokens):  # two right tokens, then one the grammar forbids, then a right one
        right = reference[len(tokens):len(tokens) + 4]
        return (right[:2] + [bad] + right[3:4]) if len(right) >= 4 else right

    steps_before = llm.stats()["num_steps"]
    tokens = run_with_drafts(llm, prompt, params, drafts_for)
    num_steps = llm.stats()["num_steps"] - steps_before
    assert tokens == list(reference)  # lossless: same greedy output as without drafts
    assert num_steps < len(reference)  # accepted drafts emitted several tokens per step
    jsonschema.validate(json.loads(llm.tokenizer.decode(tokens, skip_special_tokens=True)),
                        schema)


def test_ngram_speculation_on_constrained_requests_is_lossless(llm, smollm2_dir):
    docs = {"order": {"items": [{"name": "apple", "qty": 3}, {"name": "pear", "qty": 2}]},
            "address": {"name": "Ada", "address": {"street": "Main Street 1", "zip": "90210"}},
            "weather": {"sky": "rainy", "wind_kmh": 12, "alerts": ["storm", "flood"]}}
    convs = [chat(f"Repeat this JSON exactly: {json.dumps(d, separators=(',', ':'))}")
             for d in docs.values()]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                             structured_outputs={"json": SCHEMAS[n]}) for n in docs]
    reference = [o.outputs[0].token_ids for o in llm.chat(convs, params)]
    with LLM(str(smollm2_dir), dtype="float32", max_num_seqs=8, max_model_len=512,
             speculative="ngram", num_speculative_tokens=4) as spec:
        outs = spec.chat(convs, params)
        stats = spec.stats()
    assert [o.outputs[0].token_ids for o in outs] == reference
    for name, out in zip(docs, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name])
    assert stats["spec_num_accepted_tokens"] > 0  # the copies were drafted and accepted


def test_n_streaming_and_stop_strings(llm):
    schema = SCHEMAS["rating"]
    out = llm.chat(chat("Rate a movie as JSON."), SamplingParams(
        n=3, temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
        structured_outputs={"json": schema}))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), schema)
    pieces = []
    for part in llm.stream(messages=chat("Describe a person as JSON."), sampling_params=
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                          structured_outputs={"json": SCHEMAS["person"]})):
        pieces.append(part.outputs[0].delta_text)
    jsonschema.validate(json.loads("".join(pieces)), SCHEMAS["person"])
    cut = llm.chat(chat("Give me a phone number."), SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, stop=["-"], structured_outputs={"regex": REGEX}))
    assert re.fullmatch(r"[0-9]{3}", cut[0].outputs[0].text)
    assert cut[0].outputs[0].finish_reason == "stop"


def test_a_terminated_grammar_ends_the_request_even_with_ignore_eos(llm):
    out = llm.chat(chat("Pick a city."), SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
        structured_outputs={"choice": CHOICES}))[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop"
    assert len(out.token_ids) < MAX_TOKENS


@pytest.mark.parametrize(("constraint", "message"), [
    ({"regex": "a(b"}, "parenthesis is not closed"),
    ({"json": {"type": "array", "uniqueItems": True}}, "keyword 'uniqueItems'"),
    ({"grammar": "root ::= "}, "EBNF parser error"),
    ({"json": {"type": "object"}, "regex": "x"}, "exactly one constraint"),
])
def test_bad_constraints_raise_and_the_engine_goes_on(llm, constraint, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate("Hello", SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert llm.generate("Hello", SamplingParams(max_tokens=4))[0].finished


def test_structured_output_off_is_a_clear_error(smollm2_dir):
    with LLM(str(smollm2_dir), dtype="float32", structured_output="none") as plain:
        with pytest.raises(InvalidRequestError, match="structured_output.backend is 'none'"):
            plain.generate("Hello", SamplingParams(structured_outputs={"regex": "a"}))


def test_cli_generate_with_a_json_schema_file(smollm2_dir, tmp_path):
    from lmkit.cli.main import build_app
    from typer.testing import CliRunner

    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(SCHEMAS["person"]))
    result = CliRunner().invoke(build_app(), [
        "generate", "Describe a person as JSON.", "--model", str(smollm2_dir),
        "--json-schema", str(schema_file), "--temperature", "0", "--max-tokens", "60"])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(result.stdout.strip()), SCHEMAS["person"])
