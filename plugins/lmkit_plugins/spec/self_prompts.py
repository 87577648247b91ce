"""``lmkit spec write-prompts MODEL --out FILE``: a chat prompt set written by the target
model itself, for ``lmkit spec train-eagle --prompts`` where no dataset is at hand.

A chat model given its template's opening of a user turn, and nothing after it, goes on
with what a user would write there (the observation behind Magpie, Xu et al. 2024).
Sampling that opening many times gives user prompts drawn from the model's own idea of
its traffic: a spread of requests no hand-written template list reaches, in the
distribution the model was tuned on. A draft head trained on the model's answers to
them is trained where it will serve.

A sampled prompt is kept when the model closed the turn itself (stopped at the token
that ends a user turn, or at the template's closing text where ordinary tokens close it;
not cut by ``max_tokens``), its text has at least ``min_chars``
characters, and it is new: not already kept and not one of ``exclude`` (by default the
chat prompts of ``lmkit bench``, so a head is measured on prompts it never saw), both
compared case- and space-insensitively. Sampling goes on in rounds until ``count`` are
kept; each request has its own seed (``seed`` and its index), so a set is reproducible.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["bulk_llm_options", "own_prompts", "read_jsonl", "user_turn_opening",
           "write_prompts", "write_jsonl"]

#: requests decoded at once when generating training data on CUDA (the engine's default,
#: ``scheduler.max_num_seqs`` 64, suits serving; a bulk job of thousands of prompts on a
#: small model runs several times faster with more)
BULK_MAX_NUM_SEQS = 256

_MARK = "\u2063LMKIT-PROMPT\u2063"  # text no template produces on its own


def user_turn_opening(tokenizer: Any) -> tuple[str, int | None, str]:
    """The text a chat of one user message starts with, up to where the message would
    go (the template's own system prompt included, as serving renders it); the id of
    the token that closes the user's turn (``None`` when the closing text does not start
    with a special token); and that closing text, stripped (a stop string where no
    special token closes the turn, as in ``[INST] ... [/INST]`` templates; the model's
    end-of-sequence token ends a turn either way).

    :raises ValueError: the tokenizer has no chat template, or its template does not
        put the message text into the prompt as given.
    """
    from lmkit.api import InvalidRequestError, render_chat

    try:
        text = render_chat(tokenizer, [{"role": "user", "content": _MARK}],
                           add_generation_prompt=False)
    except InvalidRequestError as e:
        raise ValueError(f"the model has no usable chat template ({e}); writing prompts "
                         "needs a chat model") from e
    cut = text.find(_MARK)
    if cut < 0:
        raise ValueError("the model's chat template does not put a user message into the "
                         "prompt as given; cannot find where a user turn starts")
    closing = text[cut + len(_MARK):]
    ids = list(tokenizer.encode(closing, add_special_tokens=False)) if closing else []
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    return text[:cut], (ids[0] if ids and ids[0] in special else None), closing.strip()


def bulk_llm_options(device: str) -> dict[str, Any]:
    """``LLM`` options for generating training data on ``device``: float32 on the CPU,
    bfloat16 and :data:`BULK_MAX_NUM_SEQS` requests at once on CUDA."""
    if device == "cpu":
        return {"device": device, "dtype": "float32"}
    return {"device": device, "dtype": "bfloat16", "max_num_seqs": BULK_MAX_NUM_SEQS}


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def write_prompts(model: str, count: int, *, device: str, seed: int = 0,
                  temperature: float = 1.0, top_p: float = 1.0, max_tokens: int = 128,
                  min_chars: int = 12, exclude: Iterable[str] | None = None,
                  max_rounds: int = 10, progress: bool = True) -> list[str]:
    """``count`` user prompts sampled from ``model`` after its user-turn opening (see the
    module docstring); fewer when ``max_rounds`` rounds of sampling do not find them, with
    a note on stderr.

    :raises ValueError: a count below 1, or a model without a usable chat template.
    """
    from lmkit import LLM, SamplingParams
    from lmkit.api import CHAT_PROMPTS

    if count < 1:
        raise ValueError(f"the prompt count must be at least 1 (got {count})")
    seen = {_key(p) for p in (CHAT_PROMPTS if exclude is None else exclude)}
    kept: list[str] = []
    drawn = 0
    with LLM(model, **bulk_llm_options(device)) as llm:
        opening, closing_id, closing_text = user_turn_opening(llm.tokenizer)
        ids = list(llm.tokenizer.encode(opening, add_special_tokens=False))
        stops = [] if closing_id is None else [closing_id]
        texts = [closing_text] if closing_id is None and closing_text else []
        for _ in range(max_rounds):
            need = count - len(kept)
            if need <= 0:
                break
            n = max(8, math.ceil(need * 1.3))  # some are cut or repeated
            params = [SamplingParams(temperature=temperature, top_p=top_p,
                                     max_tokens=max_tokens, seed=seed * 1_000_003 + drawn + i,
                                     stop_token_ids=stops, stop=texts) for i in range(n)]
            outs = llm.generate([{"prompt_token_ids": ids}] * n, params)
            drawn += n
            for out in outs:
                done = out.outputs[0]
                text = done.text.strip()
                if (done.finish_reason != "stop" or len(text) < min_chars
                        or _key(text) in seen or len(kept) == count):
                    continue
                seen.add(_key(text))
                kept.append(text)
            if progress:
                print(f"lmkit: writing prompts: {len(kept)} of {count} kept "
                      f"({drawn} sampled)", file=sys.stderr)
    if len(kept) < count and progress:
        print(f"lmkit: the model wrote {len(kept)} usable prompts of the {count} asked in "
              f"{max_rounds} rounds ({drawn} sampled); raise --max-tokens or lower "
              "--min-chars to keep more", file=sys.stderr)
    return kept


def read_jsonl(path: Path) -> list[str]:
    """A prompt set as ``--prompts`` takes it: one ``{"prompt": ...}`` (or a JSON string)
    per line, blank lines skipped.

    :raises ValueError: a file that is not UTF-8 text, or a line that is neither (or
        whose prompt is empty), named by its line number.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); expected "
                         "JSONL, one {\"prompt\": \"...\"} per line") from e
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg}); expected a string or "
                                 "{\"prompt\": \"...\"}") from e
            prompt = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(prompt, str):
                raise ValueError(f"{path}:{n}: expected a string or {{\"prompt\": \"...\"}}")
            if not prompt.strip():
                raise ValueError(f"{path}:{n}: the prompt is empty")
            prompts.append(prompt)
    return prompts


def write_jsonl(prompts: list[str], path: Path) -> None:
    """Write ``prompts`` as ``--prompts`` reads them: one ``{"prompt": ...}`` per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def own_prompts(model: str, out: Path, count: int, device: str, seed: int,
                progress: bool) -> list[str]:
    """``train-eagle --self-prompts``: ``count`` prompts the model writes itself, kept in
    ``out/self_prompts.jsonl`` (a file already there with that many is read instead, so
    a run started again writes nothing); none when ``count`` is 0."""
    if count <= 0:
        return []
    path = out / "self_prompts.jsonl"
    if path.is_file():
        kept = read_jsonl(path)
        if len(kept) >= count:
            return kept[:count]
    kept = write_prompts(model, count, device=device, seed=seed, progress=progress)
    write_jsonl(kept, path)
    return kept
