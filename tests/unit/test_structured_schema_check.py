"""JSON schemas with no finite instance (a self-reference with no way out) are refused in
the frontend; recursive schemas that can end are let through (issue 25)."""

from __future__ import annotations

import pytest
from lmkit.errors import InvalidRequestError
from lmkit.structured.constraint import validate_structured_outputs
from lmkit.structured.schema_check import endless_schema_error

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}

ENDLESS = [
    ({"$ref": "#"}, "'#' at #"),
    ({"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]},
     "at #/properties/c"),
    ({"properties": {"c": {"$ref": "#"}}, "required": ["c"]}, "at #/properties/c"),  # object
    ({"items": {"$ref": "#"}, "minItems": 1}, "at #/items"),
    ({"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}, "#/prefixItems/0"),
    ({"allOf": [{"$ref": "#"}]}, "#/allOf/0"),
    ({"oneOf": [{"$ref": "#"}]}, "#/oneOf/0"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "$ref"),
    ({"$defs": {"node": NODE}, "type": "object", "properties": {"head": {"$ref": "#/$defs/node"}},
      "required": ["head"]}, "#/$defs/node"),
    ({"type": "object", "properties": {"c": False}, "required": ["c"]}, "accepts no value"),
]

FINITE = [
    {"type": "object", "properties": {"c": {"$ref": "#"}}},  # c may be left out
    {"items": {"$ref": "#"}},  # the empty array ends it
    {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
    {"type": ["object", "string"], "properties": {"c": {"$ref": "#"}}, "required": ["c"]},
    {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"},
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"]}}, "$ref": "#/$defs/node"},  # a linked list
    {"$defs": {"node": NODE}, "type": "object", "properties": {"head": {"$ref": "#/$defs/node"}}},
    {"$ref": "#/$defs/missing"},  # the backend names unresolvable references
    {"$ref": "https://example.com/schema"},
    {}, True,
]


@pytest.mark.parametrize(("schema", "where"), ENDLESS)
def test_endless_schemas_are_found_and_named(schema, where):
    message = endless_schema_error(schema)
    assert message is not None and where in message
    with pytest.raises(InvalidRequestError, match="no finite JSON|accepts no value") as info:
        validate_structured_outputs({"json": schema})
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize("schema", FINITE)
def test_schemas_that_can_end_pass(schema):
    assert endless_schema_error(schema) is None
    validate_structured_outputs({"json": schema})


def test_a_long_reference_chain_is_checked_in_linear_time():
    import time

    n = 3000  # each definition refers to the next, listed in the worst order
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}},
                     "required": ["x"]}
    start = time.monotonic()
    assert endless_schema_error({"$defs": defs, "$ref": "#/$defs/d0"}) is not None
    defs[f"d{n}"] = {"type": "integer"}
    assert endless_schema_error({"$defs": defs, "$ref": "#/$defs/d0"}) is None
    assert time.monotonic() - start < 2.0


def test_endless_schemas_compile_to_no_complete_output_in_xgrammar():
    """Why they are refused: the backend's grammar for one accepts no finished JSON
    (xgrammar before 0.2.9 compiles it to a grammar that allows no token; later ones
    refuse it outright)."""
    pytest.importorskip("xgrammar")
    from lmkit.errors import InvalidRequestError
    from lmkit.sample.bitmask import allocate_bitmask, unpack_bitmask
    from lmkit.testing.tiny_model import make_byte_tokenizer
    from lmkit_plugins.structured import XGrammarOptions
    from lmkit_plugins.structured.xgrammar_backend import XGrammarBackend

    backend = XGrammarBackend(make_byte_tokenizer(), 320, options=XGrammarOptions())
    try:
        grammar = backend.compile("json", {"$ref": "#"})
    except InvalidRequestError as e:  # xgrammar 0.2.9 and later refuse it while compiling
        assert "Circular $ref" in str(e)
        return
    mask = allocate_bitmask(1, 320)
    grammar.fill_bitmask(mask, 0)
    assert not unpack_bitmask(mask, 320)[0].any()  # not a single token, not even EOS
