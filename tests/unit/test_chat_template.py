"""render_chat: the model's template in a sandbox, message validation, clear errors."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from lmkit.errors import InvalidRequestError, ModelLoadError
from lmkit.text.chat import render_chat

SIMPLE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def tokenizer(template, **extra):
    return SimpleNamespace(chat_template=template, bos_token="<s>", eos_token="</s>",
                           name_or_path="fake/model", **extra)


def test_smollm2_template_matches_transformers(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi! Ça va? 😀"},
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": "And now?"},
    ]
    for add in (True, False):
        want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert render_chat(tok, messages, add_generation_prompt=add) == want
    # Without a system message the template inserts its default one.
    text = render_chat(tok, [{"role": "user", "content": "x"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_globals_tools_and_kwargs_reach_the_template():
    template = ("{{ bos_token }}|{{ strftime_now('%Y') | length }}|{{ tools | tojson }}|"
                "{{ enable_thinking }}|{{ messages[0].name }}")
    out = render_chat(tokenizer(template), [{"role": "user", "content": "é", "name": "bob"}],
                      tools=[{"type": "function", "function": {"name": "f"}}],
                      enable_thinking=False)
    assert out == '<s>|4|[{"type": "function", "function": {"name": "f"}}]|False|bob'


def test_content_parts_are_joined():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]}]
    assert render_chat(tokenizer(SIMPLE), messages) == "<s>[user]a\nb</s>[assistant]"
    assert render_chat(tokenizer(SIMPLE), messages, add_generation_prompt=False) == \
        "<s>[user]a\nb</s>"


@pytest.mark.parametrize("messages, fragment", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], "messages[0] must be an object"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": 3}], "messages[1].content"),
    ([{"role": "user"}], "has no content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text only"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "text must be a string"),
])
def test_bad_messages(messages, fragment):
    with pytest.raises(InvalidRequestError, match=re.escape(fragment)) as exc:
        render_chat(tokenizer(SIMPLE), messages)
    assert exc.value.param == "messages"


def test_assistant_tool_call_may_have_null_content():
    template = "{% for m in messages %}{{ m.role }}:{{ m.content or m.tool_calls[0].id }};{% endfor %}"
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1"}]}]
    assert render_chat(tokenizer(template), msgs, add_generation_prompt=False) == \
        "user:q;assistant:call_1;"


def test_missing_template_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="has no chat template") as exc:
        render_chat(tokenizer(None), [{"role": "user", "content": "x"}])
    assert exc.value.code == "chat_template_missing"
    assert "fake/model" in str(exc.value)


def test_raise_exception_becomes_invalid_request():
    template = ("{% if messages[0].role != 'user' %}"
                "{{ raise_exception('Conversation must start with a user message') }}"
                "{% endif %}ok")
    assert render_chat(tokenizer(template), [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="must start with a user message"):
        render_chat(tokenizer(template), [{"role": "system", "content": "x"}])


def test_sandbox_blocks_escapes_and_mutation():
    escapes = [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{% set ns = namespace(__class__=1) %}{{ ns }}",
    ]
    for template in escapes:
        messages = [{"role": "user", "content": "x"}]
        with pytest.raises(InvalidRequestError):
            render_chat(tokenizer(template), messages)
        assert messages == [{"role": "user", "content": "x"}]


def test_named_templates_and_broken_template():
    named = {"default": "D", "tool_use": "T"}
    msgs = [{"role": "user", "content": "x"}]
    assert render_chat(tokenizer(named), msgs) == "D"
    assert render_chat(tokenizer(named), msgs, tools=[{"type": "function"}]) == "T"
    with pytest.raises(ModelLoadError, match="does not parse"):
        render_chat(tokenizer("{% for m in messages %}"), msgs)
    with pytest.raises(InvalidRequestError, match="tools"):
        render_chat(tokenizer(SIMPLE), msgs, tools="not a list")
