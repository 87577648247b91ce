"""The ``mp`` executor's channel: what the executor sends its workers and what they
answer, as tagged msgspec structs over ZMQ (msgpack; nothing is pickled, and a frame
that does not decode into one of these types is refused).

Executor -> every worker: :class:`InitKVCache`, :class:`Execute`,
:class:`OffloadLookup`, :class:`OffloadStats`, :class:`CloseOffload`, :class:`Stop`.
Worker -> executor: :class:`Started` (after loading), :class:`Done`,
:class:`Executed` (rank 0 only), :class:`Looked`, :class:`Stats`, :class:`Failed`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Union

import msgspec
from lmkit.api import (
    ModelFacts,
    ModelInfo,
    ModelPooling,
    Needs,
    RunnerOutputWire,
    SchedulerOutputWire,
)


class InitKVCache(msgspec.Struct, tag="init_kv", frozen=True):
    """Allocate ``num_blocks`` KV blocks (each rank: its own KV heads)."""

    seq: int
    num_blocks: int


class Execute(msgspec.Struct, tag="execute", frozen=True):
    """Run one step; every rank runs it, rank 0 answers."""

    seq: int
    scheduler_output: SchedulerOutputWire


class OffloadLookup(msgspec.Struct, tag="offload_lookup", frozen=True):
    seq: int
    block_hashes: list[bytes]


class OffloadStats(msgspec.Struct, tag="offload_stats", frozen=True):
    seq: int


class CloseOffload(msgspec.Struct, tag="close_offload", frozen=True):
    seq: int


class Stop(msgspec.Struct, tag="stop", frozen=True):
    """Release everything and exit."""

    seq: int


class Started(msgspec.Struct, tag="started", frozen=True):
    """The model is loaded on ``rank``; its facts (KV budget: this rank's)."""

    rank: int
    info: ModelInfo


class Done(msgspec.Struct, tag="done", frozen=True):
    rank: int
    seq: int


class Executed(msgspec.Struct, tag="executed", frozen=True):
    rank: int
    seq: int
    output: RunnerOutputWire


class Looked(msgspec.Struct, tag="looked", frozen=True):
    rank: int
    seq: int
    held: int
    resident: int


class Stats(msgspec.Struct, tag="stats", frozen=True):
    rank: int
    seq: int
    stats: dict[str, int]


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """``rank`` raised; it exits after sending this."""

    rank: int
    error: str
    error_type: str


ToWorker = Union[InitKVCache, Execute, OffloadLookup, OffloadStats, CloseOffload, Stop]
FromWorker = Union[Started, Done, Executed, Looked, Stats, Failed]


def worker_decoder() -> msgspec.msgpack.Decoder[Any]:
    """Decodes what the executor sends a worker."""
    return msgspec.msgpack.Decoder(ToWorker)


def executor_decoder() -> msgspec.msgpack.Decoder[Any]:
    """Decodes what workers send the executor."""
    return msgspec.msgpack.Decoder(FromWorker)


def facts_to_json(facts: ModelFacts) -> dict[str, Any]:
    """The engine's :class:`~lmkit.api.ModelFacts` as JSON values, for a worker's
    handshake (every rank uses the engine's facts instead of deriving its own)."""
    out = {f.name: getattr(facts, f.name) for f in dataclasses.fields(facts)}
    needs = facts.attention_needs
    out.update(model_dir=str(facts.model_dir), eos_token_ids=list(facts.eos_token_ids),
               attention_needs={"features": sorted(needs.features),
                                "values": dict(needs.values)},
               pooling=dataclasses.asdict(facts.pooling))
    return out


def facts_from_json(data: dict[str, Any]) -> ModelFacts:
    """The :class:`~lmkit.api.ModelFacts` that :func:`facts_to_json` wrote."""
    needs = data["attention_needs"]
    return ModelFacts(**{**data, "model_dir": Path(data["model_dir"]),
                         "eos_token_ids": tuple(data["eos_token_ids"]),
                         "attention_needs": Needs(frozenset(needs["features"]),
                                                  needs["values"]),
                         "pooling": ModelPooling(**data["pooling"])})
