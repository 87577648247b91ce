"""Chat template rendering: OpenAI-style messages -> the model's prompt text.

The template is the model's own (``tokenizer.chat_template``), rendered in Jinja's
immutable sandbox with the globals Hugging Face templates expect (``raise_exception``,
``strftime_now``, the special tokens, ``add_generation_prompt``, ``tools``). Requests
supply data only, never template code.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from lmkit.errors import InvalidRequestError, ModelLoadError


def _bad(message: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param="messages", code=code)


def _text_of_parts(parts: list[Any], index: int) -> str:
    """Join an OpenAI content-part list of text parts (``{"type": "text", "text": ...}``)."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"messages[{index}].content[{j}] has type {kind!r}; this model takes "
                       "text only, as strings or parts {\"type\": \"text\", \"text\": ...}")
        if not isinstance(part.get("text"), str):
            raise _bad(f"messages[{index}].content[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat and return a plain copy whose ``content`` fields are strings.

    Each message is a dict with a non-empty string ``role`` and a ``content`` that is a
    string or a list of text parts (joined with newlines). ``content`` may be null only
    on an assistant message carrying ``tool_calls``. Other keys (``name``,
    ``tool_calls``, ``tool_call_id``) pass through to the template.

    Raises:
        InvalidRequestError: naming the first offending message and field.
    """
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {\"role\": ..., \"content\": ...}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object with 'role' and 'content', "
                       f"got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role must be a non-empty string such as 'user', "
                       f"'assistant' or 'system'; got {role!r}")
        content = message.get("content")
        if isinstance(content, list):
            content = _text_of_parts(content, i)
        elif content is None:
            if not message.get("tool_calls"):
                raise _bad(f"messages[{i}] ({role}) has no content; give 'content' as a "
                           "string (it may be null only with 'tool_calls')")
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts, "
                       f"got {type(content).__name__}")
        checked.append({**message, "content": content})
    return checked


def _select_template(tokenizer: Any, tools: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates, e.g. {"default": ..., "tool_use": ...}
        named = template
        template = named.get("tool_use") if tools and "tool_use" in named else named.get("default")
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise InvalidRequestError(
            f"the model's tokenizer ({name}) has no chat template, so chat messages cannot be "
            "turned into a prompt; send a plain prompt (completions) instead, or use a chat "
            "(instruct) model", param="messages", code="chat_template_missing")
    return template


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which templates do not expect.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore names (no route to Python internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for key in attrs:
                Namespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key: str, value: Any) -> None:
            Namespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key: Any) -> None:
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates may not set underscore attributes ({key!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       namespace=Namespace)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ModelLoadError(f"the model's chat template does not parse (line {exc.lineno}: "
                             f"{exc.message}); fix chat_template in the tokenizer files") from exc


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                tools: Any = None, **kwargs: Any) -> str:
    """Render ``messages`` with the tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with ``chat_template`` and special tokens.
        messages: OpenAI-style messages (see :func:`validate_messages`).
        add_generation_prompt: end with the assistant turn's opening, so the model
            answers.
        tools: optional list of tool JSON schemas (dicts), passed to the template.
        **kwargs: extra template variables (e.g. ``enable_thinking=False``).

    Returns:
        The prompt text (special tokens as text; tokenize without adding them again).

    Raises:
        InvalidRequestError: bad messages or tools, a template that rejects the chat
            (``raise_exception``), or a tokenizer without a chat template.
        ModelLoadError: the model's template itself does not parse.
    """
    import jinja2

    checked = validate_messages(messages)
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
        raise InvalidRequestError("tools must be a list of JSON-schema objects",
                                  param="tools", code="invalid_value")
    compiled = _compile(_select_template(tokenizer, tools))
    variables = {
        **(getattr(tokenizer, "special_tokens_map", None) or {}),
        "bos_token": getattr(tokenizer, "bos_token", None) or "",
        "eos_token": getattr(tokenizer, "eos_token", None) or "",
        **kwargs,
    }
    try:
        return compiled.render(messages=checked, tools=tools,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as exc:
        # raise_exception() in the template, or the chat lacks something it needs.
        raise _bad(f"the model's chat template rejected these messages: {exc}",
                   code="invalid_chat") from exc
    except (TypeError, KeyError, ValueError) as exc:
        raise _bad(f"the model's chat template could not render these messages ({exc}); "
                   "check the roles and contents it expects", code="invalid_chat") from exc
