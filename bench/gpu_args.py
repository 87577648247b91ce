"""Parsers of ``bench/gpu_engine.py``'s list-valued options: the peers, and the
A/B run's environment (``--ab-env``) and engine option overrides (``--ab-set``)."""

from __future__ import annotations

import json
from typing import Any

PEERS = ("vllm", "hf")


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
