"""The prompt forms the offline API accepts (as vLLM's ``LLM.generate`` does): text,
token ids, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, one or a list;
:func:`as_prompt_list` turns them into text or token-id lists, or raises a clear
``TypeError``."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

Prompt = str | Sequence[int]
# What LLM.generate accepts for one prompt, as vLLM does: text, token ids, or a dict
# {"prompt": text} / {"prompt_token_ids": ids}.
PromptInput = Prompt | Mapping[str, Any]
ACCEPTED_PROMPTS = ("a str, a list of token ids (ints), {'prompt': str}, "
                    "{'prompt_token_ids': [int, ...]}, or a list of these")
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[Prompt]:
    """The prompts of one :meth:`LLM.generate` call, each as text or token ids.

    Accepts one prompt or a list of them; a prompt is a ``str``, a list of token ids
    (a flat list of ints is one prompt), ``{"prompt": str}`` or
    ``{"prompt_token_ids": [int, ...]}`` (vLLM's ``TextPrompt``/``TokensPrompt``).

    :raises TypeError: anything else, naming what was given and what is accepted.
    """
    if isinstance(prompts, (str, Mapping)):
        return [as_prompt(prompts)]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"LLM.generate() got prompts of type {type(prompts).__name__}; "
                        f"accepted: {ACCEPTED_PROMPTS}.")
    seq = list(prompts)
    if seq and all(_is_token_id(t) for t in seq):
        return [as_prompt(seq)]  # one prompt given as token ids
    return [as_prompt(p, index=i) for i, p in enumerate(seq)]


def as_prompt(prompt: PromptInput, index: int | None = None) -> Prompt:
    """One prompt as text or a list of token ids (see :func:`as_prompt_list`).

    :raises TypeError: a prompt of another form; ``index`` names its place in a list.
    """
    where = f"prompt {index}" if index is not None else "a prompt"
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        keys = [k for k in prompt if k in PROMPT_KEYS]
        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if len(keys) != 1 or unknown:
            raise TypeError(
                f"LLM.generate() got {where} as a dict with keys {sorted(map(str, prompt))}; "
                "a prompt dict has exactly one of 'prompt' (text) or 'prompt_token_ids' "
                f"(other vLLM keys are not supported); accepted: {ACCEPTED_PROMPTS}.")
        value = prompt[keys[0]]
        if keys[0] == "prompt" and isinstance(value, str):
            return value
        if keys[0] == "prompt_token_ids" and _is_token_list(value):
            return [int(t) for t in value]
        want = "str" if keys[0] == "prompt" else "list of ints"
        raise TypeError(f"LLM.generate() got {where} with {keys[0]!r} of type "
                        f"{type(value).__name__}; it must be a {want}.")
    if _is_token_list(prompt):
        return [int(t) for t in prompt]
    raise TypeError(f"LLM.generate() got {where} of type {type(prompt).__name__} "
                    f"({_preview(prompt)}); accepted: {ACCEPTED_PROMPTS}.")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_token_list(value: Any) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, (str, bytes))
            and all(_is_token_id(t) for t in value))


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def params_per_prompt(sampling_params: Any, count: int) -> list[Any]:
    """The :class:`SamplingParams` of each of ``count`` prompts: one for all (``None``:
    the defaults) or a list with one per prompt.

    :raises TypeError: anything but a ``SamplingParams`` or a list of them.
    :raises ValueError: a list whose length is not ``count``.
    """
    from lmkit.api.sampling_params import SamplingParams

    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * count
    params = _one_per_prompt(
        sampling_params, count, "sampling params",
        "sampling_params must be a SamplingParams or a list of them (one per prompt)",
        "give one SamplingParams for all prompts or a list of one per prompt.",
        hint="; build one with SamplingParams(...).")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] is a {type(p).__name__} "
                            f"({_preview(p)}), not a SamplingParams.")
    return params


def priorities_per_prompt(priority: Any, count: int) -> list[int]:
    """The priority of each of ``count`` prompts (``None``: all 0).

    :raises TypeError: anything but a list of ints.
    :raises ValueError: a list whose length is not ``count``.
    """
    if priority is None:
        return [0] * count
    values = _one_per_prompt(priority, count, "priorities",
                             "priority must be a list of ints, one per prompt",
                             "give one priority per prompt.")
    bad = [p for p in values if not _is_token_id(p)]  # (an integer, not a bool)
    if bad:
        raise TypeError(f"priority must be a list of ints, one per prompt; got {bad[0]!r} "
                        f"({type(bad[0]).__name__}).")
    return [int(p) for p in values]


def _one_per_prompt(values: Any, count: int, noun: str, expected: str, remedy: str,
                    hint: str = ".") -> list[Any]:
    """``values`` as a list of ``count`` (one per prompt).

    :raises TypeError: not a list or tuple (``expected`` says what is, ``hint`` ends it).
    :raises ValueError: another number of them (``remedy`` says what to give).
    """
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise TypeError(f"{expected}, got {type(values).__name__} ({_preview(values)}){hint}")
    out = list(values)
    if len(out) != count:
        raise ValueError(f"got {count} prompts but {len(out)} {noun}; {remedy}")
    return out
