"""Seeded benchmark workloads: token-id prompts with fixed output lengths."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmkit.benchmarking.prompts import CHAT_PROMPTS
from lmkit.errors import ConfigError


@dataclass(frozen=True)
class Workload:
    """Prompts as token ids with the number of tokens to generate for each (EOS ignored)."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> str:
        n = len(self.prompts)
        return (f"{self.name}: {n} requests, {self.num_prompt_tokens} prompt tokens "
                f"(mean {self.num_prompt_tokens / max(n, 1):.0f}), {self.num_output_tokens} "
                f"output tokens (mean {self.num_output_tokens / max(n, 1):.0f})")


def _lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def random_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, seed: int = 0) -> Workload:
    """Random token ids; lengths uniform in the given closed ranges."""
    rng = random.Random(seed)
    ins = _lengths(rng, n, *input_len)
    outs = _lengths(rng, n, *output_len)
    hi = min(vocab_size, 32000) - 1
    prompts = [[rng.randint(10, hi) for _ in range(k)] for k in ins]
    return Workload(f"random(in={input_len}, out={output_len}, seed={seed})", prompts, outs)


def chat_workload(tokenizer: Any, n: int, output_len: int, seed: int = 0,
                  texts: Sequence[str] | None = None) -> Workload:
    """``n`` of the built-in chat prompts (or of ``texts``; seeded order, cycled when
    ``n`` is larger), rendered with the chat template.

    :raises ValueError: when ``texts`` is given but empty."""
    from lmkit.text.chat import render_chat

    pool = CHAT_PROMPTS if texts is None else tuple(texts)
    if not pool:
        raise ValueError("chat_workload: no prompt texts given")
    rng = random.Random(seed)
    texts = [pool[i % len(pool)] for i in range(n)]
    rng.shuffle(texts)
    prompts = [
        list(tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": t}]),
                              add_special_tokens=False))
        for t in texts
    ]
    source = "" if pool is CHAT_PROMPTS else f", {len(pool)} given prompts"
    return Workload(f"chat(n={n}, out={output_len}, seed={seed}{source})", prompts,
                    [output_len] * n)


# Modules whose docstrings (prose shipped with lmkit) are the passages of copy_workload.
COPY_PASSAGE_MODULES = (
    "lmkit.worker.input_batch", "lmkit.kv_cache.block_pool", "lmkit.sample.sampler",
    "lmkit.sample.filters", "lmkit.sample.logprobs", "lmkit.kv_cache.hashing",
    "lmkit.scheduler.paged", "lmkit.sample.metadata", "lmkit.serve.metrics",
    "lmkit.sample.penalties",
)


def copy_passages() -> list[str]:
    """Prose passages shipped with lmkit: module docstrings, markup stripped (read from
    source, nothing imported)."""
    import ast
    import importlib.util
    import re

    passages = []
    for name in COPY_PASSAGE_MODULES:
        spec = importlib.util.find_spec(name)
        doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) if spec and \
            spec.origin else None
        if doc:
            doc = re.sub(r":\w+:`~?([^`]*)`", r"\1", doc).replace("``", "")
            passages.append(" ".join(doc.split()))
    return passages


def copy_workload(tokenizer: Any, n: int, seed: int = 0) -> Workload:
    """Copy-heavy chat prompts (speculative decoding by prompt lookup shines here): each
    asks to repeat a passage of :func:`copy_passages` exactly; its output length is the
    passage's length in tokens, so the answer is mostly the copy."""
    from lmkit.text.chat import render_chat

    passages = copy_passages()
    rng = random.Random(seed)
    order = [passages[i % len(passages)] for i in range(n)]
    rng.shuffle(order)
    prompts, outs = [], []
    for text in order:
        msg = {"role": "user", "content": f"Repeat the following text exactly:\n\n{text}"}
        prompts.append(list(tokenizer.encode(render_chat(tokenizer, [msg]),
                                             add_special_tokens=False)))
        outs.append(len(tokenizer.encode(text, add_special_tokens=False)))
    return Workload(f"copy(n={n}, seed={seed})", prompts, outs)


def file_workload(path: Path, tokenizer: Any, default_output_len: int) -> Workload:
    """JSON lines: ``{"prompt": str | [ids], "output_len": int?}`` per line."""
    prompts, outs = [], []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read workload file {path}: {e}") from e
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}:{no}: expected a JSON object with a 'prompt' ({e})") from e
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        prompts.append(list(ids))
        outs.append(int(item.get("output_len", default_output_len)))
    if not prompts:
        raise ConfigError(f"workload file {path} has no prompts")
    return Workload(f"file({path})", prompts, outs)


def parse_length_range(text: str) -> tuple[int, int]:
    """``"64"`` -> (64, 64); ``"100:1024"`` -> (100, 1024)."""
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError as e:
        raise ConfigError(f"expected a length like 64 or 100:1024, got {text!r}") from e
    if not 0 < a <= b:
        raise ConfigError(f"expected 0 < low <= high in {text!r}")
    return a, b
