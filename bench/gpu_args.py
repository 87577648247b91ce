"""Parsers of ``bench/gpu_engine.py``'s options: the peers, the A/B run's environment
(``--ab-env``) and engine option overrides (``--ab-set``), and the lmkit engine options
its flags make (:func:`engine_options`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PEERS = ("vllm", "hf")
ENGINE_OPTIONS = {"max_num_seqs": 256, "max_num_batched_tokens": 16384, "max_model_len": 4096}
QUANTIZATIONS = ("none", "fp8", "fp8-lm-head")


def quantization_options(quantization: str, extra: dict[str, Any] | None = None
                         ) -> dict[str, Any]:
    """The engine options of ``--quantization`` (``fp8-lm-head``: the fp8 method with
    ``quantize_lm_head``), with ``extra`` method options (``--quantization-options``)."""
    if quantization == "fp8-lm-head":
        quantization, extra = "fp8", {"quantize_lm_head": True, **(extra or {})}
    if extra:
        return {"quantization": quantization, "quantization.options": extra}
    return {"quantization": quantization}


def engine_options(args: Any) -> dict[str, Any]:
    """lmkit's engine options (``LLM`` keywords) from ``gpu_engine.py``'s parsed flags."""
    options = dict(ENGINE_OPTIONS, attention=args.attention, enforce_eager=args.enforce_eager,
                   executor=args.executor, kv_cache_dtype=args.kv_cache_dtype,
                   **quantization_options(args.quantization, args.quantization_options))
    if args.load_format == "dummy":
        options["load_format"] = "dummy"
    if args.tp > 1:
        options["tensor_parallel_size"] = args.tp
        if options["executor"] == "uniproc":  # the default: one process cannot hold ranks
            options["executor"] = "mp"
    if args.dp > 1:
        options["data_parallel_size"] = args.dp
    if args.smoke:
        options.update(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
    return options


def parse_peers(text: str) -> list[str]:
    """``"vllm,hf"`` -> ``["vllm", "hf"]``; ``"none"`` -> ``[]``."""
    peers = [p.strip().lower() for p in text.split(",") if p.strip()]
    if peers == ["none"]:
        return []
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise SystemExit(f"unknown peer {', '.join(unknown)}; known: {', '.join(PEERS)}, none")
    return peers


def parse_env(text: str, flag: str = "--ab-env") -> dict[str, str]:
    """``"LMKIT_GEMV_FOLD=0,X=1"`` -> ``{"LMKIT_GEMV_FOLD": "0", "X": "1"}``; ``flag``
    names the option in errors."""
    env = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or not name.strip():
            raise SystemExit(f"{flag}: expected NAME=VALUE[,NAME=VALUE...], got {part!r}")
        env[name.strip()] = value.strip()
    return env


def parse_sets(text: str, flag: str = "--ab-set") -> dict[str, Any]:
    """``'attention.options={"decode_tiles": [64, 8, 3]};max_num_seqs=128'`` -> engine
    option overrides by dotted path, each value read as JSON (else kept as text);
    ``;``-separated, since JSON values hold commas. ``flag`` names the option in errors."""
    sets: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        path, eq, value = part.partition("=")
        if not eq or not path.strip():
            raise SystemExit(f"{flag}: expected PATH=VALUE[;PATH=VALUE...], got {part!r}")
        try:
            sets[path.strip()] = json.loads(value)
        except json.JSONDecodeError:
            sets[path.strip()] = value.strip()
    return sets


@contextmanager
def env_during(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block (e.g. while an engine whose build
    reads switches is built), then restore what was there."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
