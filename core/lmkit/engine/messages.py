"""The typed messages between the API process and the engine-core process.

Every message is a tagged msgspec Struct encoded as msgpack, one ZMQ frame per message.
Nothing on this channel is pickled: a message that does not decode into one of these
types is rejected, so a peer can never make the other side run code.

Frontend -> engine core: :class:`AddRequest`, :class:`AbortRequests`,
:class:`StatsQuery`, :class:`Shutdown`.
Engine core -> frontend: :class:`EngineReady`, :class:`EngineFailed`,
:class:`EngineOutputs`, :class:`RequestRejected`, :class:`EngineStats`.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from lmkit.api.outputs import EngineCoreOutput
from lmkit.api.pooling import PoolingParams
from lmkit.api.request import Request
from lmkit.api.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add", frozen=True):
    """A validated, tokenized request for the engine core to schedule."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    max_tokens: int | None = None
    pooling_params: PoolingParams | None = None  # a pooling request (prefill only)

    @classmethod
    def from_request(cls, request: Request) -> AddRequest:
        """The wire form of a :class:`Request` built by the input processor."""
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            max_tokens=request.max_tokens,
            pooling_params=request.pooling_params,
        )

    def to_request(self) -> Request:
        """Rebuild the engine's :class:`Request` on the engine-core side."""
        return Request(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            eos_token_id=self.eos_token_id,
            arrival_time=self.arrival_time,
            priority=self.priority,
            cache_salt=self.cache_salt,
            max_tokens=self.max_tokens,
            pooling_params=self.pooling_params,
        )


class AbortRequests(msgspec.Struct, tag="abort", frozen=True):
    """Stop these requests and free their KV blocks (unknown ids are ignored)."""

    request_ids: list[str]


class StatsQuery(msgspec.Struct, tag="stats_query", frozen=True):
    """Ask for an :class:`EngineStats` reply carrying the same ``query_id``."""

    query_id: int


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    """Finish the current step, shut the engine down and exit."""


class EngineReady(msgspec.Struct, tag="ready", frozen=True):
    """Sent once the model is loaded and the KV pool sized: the engine accepts requests.

    ``max_model_len``, ``vocab_size``, ``eos_token_ids`` (primary first) and
    ``generates`` (``False``: a pooling-only model) are the engine's
    :class:`~lmkit.api.ModelFacts`, so the frontend validates with the same ones.
    ``default_pooler``: the pooler of a request that names none (a sentence-transformers
    export's mode, else the model's ``ModelPooling.default_pooler``; ``"classify"``: a
    sequence classifier).
    """

    model_dir: str
    max_model_len: int
    vocab_size: int
    stack: dict[str, Any]  # ResolvedStack.as_dict()
    plugins: list[dict[str, Any]]  # name, source, dist, version, status per loaded plugin
    stats: dict[str, float]
    logits_processors: list[str] = []  # names requests may select
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    generates: bool = True
    default_pooler: str = "last"


class EngineFailed(msgspec.Struct, tag="failed", frozen=True):
    """The engine core could not start, or died: ``error`` says why; ``exit_code`` is the
    CLI status the error calls for (2: the configuration or model asked for, 1: a
    failure while running)."""

    error: str
    error_type: str
    exit_code: int = 1


class EngineOutputs(msgspec.Struct, tag="outputs", frozen=True):
    """What one engine step produced, for every request that advanced."""

    outputs: list[EngineCoreOutput]


class RequestRejected(msgspec.Struct, tag="rejected", frozen=True):
    """The engine core refused one request (it never ran); the others are unaffected."""

    request_id: str
    message: str
    param: str | None = None
    code: str | None = None


class EngineStats(msgspec.Struct, tag="stats", frozen=True):
    """``EngineCore.stats()``: sent periodically, and in answer to a :class:`StatsQuery`."""

    stats: dict[str, float]
    query_id: int | None = None


ToEngine = Union[AddRequest, AbortRequests, StatsQuery, Shutdown]
FromEngine = Union[EngineReady, EngineFailed, EngineOutputs, RequestRejected, EngineStats]


def make_encoder() -> msgspec.msgpack.Encoder:
    """The encoder for both directions (msgpack; no pickle)."""
    return msgspec.msgpack.Encoder()


def make_engine_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the frontend sends the engine core."""
    return msgspec.msgpack.Decoder(ToEngine)


def make_frontend_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the engine core sends the frontend."""
    return msgspec.msgpack.Decoder(FromEngine)


def numeric_stats(stats: dict[str, Any]) -> dict[str, float]:
    """Keep the numeric entries of ``EngineCore.stats()`` as floats (the wire type)."""
    return {str(k): float(v) for k, v in stats.items() if isinstance(v, (int, float))}
