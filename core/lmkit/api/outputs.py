"""Outputs: per-step from the engine core, and user-facing from ``LLM``."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from lmkit.errors import RequestFaultError


@lru_cache(maxsize=64)
def _top_layout(num_top: int) -> tuple[struct.Struct, struct.Struct]:
    """The packed layout of ``num_top`` alternatives: little-endian int64 token ids and
    float64 logprobs (the same bytes on every host)."""
    return struct.Struct(f"<{num_top}q"), struct.Struct(f"<{num_top}d")


def pack_top(top: Iterable[tuple[int, float]]) -> tuple[bytes, bytes]:
    """``(token_id, logprob)`` pairs -> ``(ids, logprobs)`` as the packed bytes
    :class:`TokenLogprob` stores: little-endian int64 ids and float64 logprobs."""
    try:
        pairs = [(int(t), float(v)) for t, v in top]
        ids_layout, lps_layout = _top_layout(len(pairs))
        return (ids_layout.pack(*(t for t, _ in pairs)),
                lps_layout.pack(*(v for _, v in pairs)))
    except (TypeError, ValueError, struct.error) as e:
        raise TypeError(f"TokenLogprob top must be (token_id, logprob) pairs with int64 "
                        f"token ids; got {top!r:.120} ({e})") from e


class _TokenLogprobMeta(msgspec.StructMeta):
    """Keeps ``TokenLogprob(token_id, logprob, rank, top)`` the constructor (``top``:
    ``(token_id, logprob)`` pairs) while the fields hold ``top`` packed. Decoding and
    :meth:`TokenLogprob.from_packed` fill the fields directly."""

    def __call__(cls, token_id: int, logprob: float, rank: int,
                 top: Iterable[tuple[int, float]] = ()) -> Any:
        ids, lps = pack_top(top)
        try:
            values = int(token_id), float(logprob), int(rank)
        except (TypeError, ValueError) as e:
            raise TypeError(f"TokenLogprob needs an int token_id, a float logprob and an int "
                            f"rank; got {token_id!r}, {logprob!r}, {rank!r}") from e
        return super().__call__(*values, ids, lps)


class TokenLogprob(msgspec.Struct, metaclass=_TokenLogprobMeta, frozen=True, gc=False,
                   array_like=True):
    """The chosen token's log-probability, its rank, and the top alternatives.

    Build one as ``TokenLogprob(token_id, logprob, rank, top)`` with ``top`` the
    alternatives as ``(token_id, logprob)`` pairs, best first; :attr:`top` gives them
    back as a list of such pairs (:meth:`iter_top` without building the list).

    They are stored packed, as two ``bytes`` (int64 ids and float64 logprobs,
    little-endian), so every field is an atomic value: the object is immutable and never
    tracked by Python's garbage collector (a server holding millions of them, top-20
    logprobs of long outputs, adds nothing to a collection), and the msgpack codec
    between processes decodes one in a few allocations instead of a list and 20 tuples.
    """

    token_id: int
    logprob: float
    rank: int
    packed_top_ids: bytes = b""  # int64 little-endian, best first
    packed_top_logprobs: bytes = b""  # float64 little-endian, same order

    if TYPE_CHECKING:  # the constructor _TokenLogprobMeta.__call__ implements
        def __init__(self, token_id: int, logprob: float, rank: int,
                     top: Iterable[tuple[int, float]] = ()) -> None: ...

    @classmethod
    def from_packed(cls, token_id: int, logprob: float, rank: int,
                    packed_top_ids: bytes = b"", packed_top_logprobs: bytes = b""
                    ) -> TokenLogprob:
        """One built from already packed alternatives (see :func:`pack_top`), without
        converting them: the sampler's path. ``token_id``, ``logprob`` and ``rank`` must
        be a Python ``int``, ``float`` and ``int``; the two byte strings hold 8 bytes per
        alternative each."""
        if len(packed_top_ids) != len(packed_top_logprobs) or len(packed_top_ids) % 8:
            raise ValueError(f"TokenLogprob.from_packed needs packed ids and logprobs of "
                             f"8 bytes per alternative, as many of each; got "
                             f"{len(packed_top_ids)} and {len(packed_top_logprobs)} bytes")
        made: TokenLogprob = super(_TokenLogprobMeta, cls).__call__(  # type: ignore[misc]
            token_id, logprob, rank, packed_top_ids, packed_top_logprobs)
        return made

    @property
    def num_top(self) -> int:
        """How many alternatives there are."""
        return len(self.packed_top_ids) >> 3

    @property
    def top(self) -> list[tuple[int, float]]:
        """The alternatives as ``(token_id, logprob)`` pairs, best first (a new list)."""
        return list(self.iter_top())

    def iter_top(self, limit: int | None = None) -> Iterator[tuple[int, float]]:
        """The first ``limit`` alternatives (all when ``None``) as ``(token_id,
        logprob)`` pairs, best first: an iterator, no list of pairs is built."""
        ids = self.packed_top_ids
        num = len(ids) >> 3
        if limit is not None and limit < num:
            num = max(limit, 0)
        ids_layout, lps_layout = _top_layout(num)
        return zip(ids_layout.unpack_from(ids),
                   lps_layout.unpack_from(self.packed_top_logprobs), strict=True)

    def __repr__(self) -> str:
        return (f"TokenLogprob(token_id={self.token_id!r}, logprob={self.logprob!r}, "
                f"rank={self.rank!r}, top={self.top!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        # the constructor takes pairs, so pickling rebuilds from the packed fields
        return (self.from_packed, (self.token_id, self.logprob, self.rank,
                                   self.packed_top_ids, self.packed_top_logprobs))


@dataclass(slots=True)
class EngineCoreOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    pooled: list[Any] | None = None  # a pooling request's output (floats, or lists of them)
    # with finish_reason "error" caused by the request's own parameters (not an engine
    # fault): a RequestFaultError code (e.g. "no_allowed_token") and the parameter to
    # change; stop_reason holds the message. None for an engine fault.
    error_code: str | None = None
    error_param: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def request_fault(self) -> RequestFaultError | None:
        """The :class:`~lmkit.errors.RequestFaultError` this output finished with, or
        ``None`` (not finished with an error, or an engine fault)."""
        if self.finish_reason != "error" or self.error_code is None:
            return None
        return RequestFaultError(str(self.stop_reason), param=self.error_param,
                                 code=self.error_code)


@dataclass
class PoolingOutput:
    """A pooling request's result: ``data`` is the pooled vector (``embed``), the class
    probabilities (``classify``) or one vector per token (``all``)."""

    request_id: str
    prompt_token_ids: list[int]
    data: list[Any]  # floats, or one list of floats per token

    @property
    def embedding(self) -> list[Any]:
        """``data`` under the name embedding APIs use."""
        return self.data


OutputKind = Literal["cumulative", "delta", "final"]
"""What a generation request's outputs carry, chosen per request by the frontend's caller
(``AsyncLLM.generate(output_kind=...)``; the server picks ``"delta"`` for streams and
``"final"`` for the rest, ``LLM.generate`` ``"final"``, ``LLM.stream`` ``"cumulative"``):

- ``"cumulative"``: an output at every step that changed the request, each completion's
  ``text``, ``token_ids`` and ``logprobs`` so far, plus the step's ``delta_`` fields;
- ``"delta"``: an output at every such step, each completion's ``text``, ``token_ids``
  and ``logprobs`` holding only what the output adds (the same as its ``delta_`` fields).
  Costs O(new tokens) per step where ``"cumulative"`` copies the whole completion;
- ``"final"``: one output, when the request finishes, with the whole completions and
  empty ``delta_`` fields.
"""

OUTPUT_KINDS: tuple[OutputKind, ...] = ("cumulative", "delta", "final")


def check_output_kind(kind: str) -> None:
    """Raise ``ValueError`` naming the known kinds when ``kind`` is not one of them."""
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"unknown output kind {kind!r}; known: {', '.join(OUTPUT_KINDS)}")


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    # what this step added (streaming); empty when nothing changed
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None
    # with finish_reason "error": set when the request's own parameters caused it (e.g.
    # constraints that leave no token; stop_reason holds the same message); None for
    # an engine fault
    error: RequestFaultError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's outputs so far (cumulative), or the new part only when streaming deltas."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
