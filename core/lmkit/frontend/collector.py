"""Per-request hand-off between the frontend's output loop and a request's consumer.

The output loop ``put``s every :class:`RequestOutput` as it arrives; the consumer
``get``s. A consumer slower than the engine never builds a backlog: pending outputs are
folded into one whose cumulative fields are the newest (``"delta"`` kind: the
concatenation of what it has not seen) and whose per-completion deltas (``delta_text``,
``delta_token_ids``, ``delta_logprobs``) are everything it has not seen, so streamed
deltas always concatenate to the final text. A ``"final"`` request gets one output; the
tokens it got meanwhile come through :meth:`OutputCollector.observe_tokens`, for the
metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Protocol

from lmkit.api.outputs import CompletionOutput, OutputKind, RequestOutput


class RequestObserver(Protocol):
    """Receives one request's timings (the server's metrics implement this)."""

    def on_first_token(self, ttft_s: float) -> None: ...
    def on_tokens(self, num_tokens: int, inter_token_s: float) -> None: ...
    def on_finish(self, outcome: str, e2e_s: float, num_prompt_tokens: int,
                  num_generated_tokens: int) -> None: ...


@dataclass
class RequestTimer:
    """When a request arrived, produced its first token, and produced its latest one."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


def merge_outputs(older: RequestOutput, newer: RequestOutput, delta: bool = False
                  ) -> RequestOutput:
    """``newer`` with the deltas of ``older`` prepended, completion by completion
    (``delta``: outputs of the ``"delta"`` kind, whose cumulative fields are deltas too)."""
    by_index = {c.index: c for c in older.outputs}
    merged: list[CompletionOutput] = []
    for c in newer.outputs:
        o = by_index.get(c.index)
        if o is None:
            merged.append(c)
            continue
        logprobs = c.delta_logprobs
        if o.delta_logprobs:
            logprobs = [*o.delta_logprobs, *(logprobs or [])]
        fields = dict(delta_text=o.delta_text + c.delta_text,
                      delta_token_ids=[*o.delta_token_ids, *c.delta_token_ids],
                      delta_logprobs=logprobs)
        if delta:  # the cumulative fields hold the same
            fields.update(text=fields["delta_text"], token_ids=fields["delta_token_ids"],
                          logprobs=logprobs if c.logprobs is not None else None)
        merged.append(replace(c, **fields))
    return replace(newer, outputs=merged)


class OutputCollector:
    """The mailbox of one parent request (all its ``n`` completions)."""

    def __init__(self, num_prompt_tokens: int, observer: RequestObserver | None = None,
                 arrival: float | None = None, kind: OutputKind = "cumulative") -> None:
        self._pending: RequestOutput | None = None
        self._delta = kind == "delta"
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.num_prompt_tokens = num_prompt_tokens
        self.observer = observer
        self.timer = RequestTimer(arrival=time.monotonic() if arrival is None else arrival)
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        """Deliver an output (called by the output loop)."""
        self._observe(output)
        pending = self._pending
        self._pending = output if pending is None else merge_outputs(pending, output,
                                                                     self._delta)
        if output.finished:
            self.finished = True
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Make the consumer's next :meth:`get` raise ``error``."""
        if self._error is None:
            self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next (possibly merged) output; raises the error given to :meth:`fail`."""
        await self._ready.wait()
        if self._pending is not None:
            out, self._pending = self._pending, None
            if self._error is None:
                self._ready.clear()
            return out
        assert self._error is not None
        raise self._error

    def observe_tokens(self, num_new: int) -> None:
        """Count ``num_new`` tokens the request got now (first token, inter-token time)."""
        now = time.monotonic()
        t = self.timer
        if num_new:
            if t.first_token is None:
                t.first_token = now
                if self.observer:
                    self.observer.on_first_token(now - t.arrival)
            elif self.observer and t.last_token is not None:
                self.observer.on_tokens(num_new, (now - t.last_token) / num_new)
            t.last_token = now
            t.num_generated += num_new

    def _observe(self, output: RequestOutput) -> None:
        self.observe_tokens(sum(len(c.delta_token_ids) for c in output.outputs))
        t = self.timer
        if output.finished and self.observer:
            reasons = [c.finish_reason for c in output.outputs]
            outcome = "length" if "length" in reasons else "stop"
            errors = [c for c in output.outputs if c.finish_reason == "error"]
            if errors:  # "invalid" when every failure was the request's own (a 400)
                outcome = "invalid" if all(c.error is not None for c in errors) else "error"
            self.observer.on_finish(outcome, time.monotonic() - t.arrival,
                                    self.num_prompt_tokens, t.num_generated)

    def observe_end(self, outcome: str) -> None:
        """Report a request that ended without finishing (abort, error)."""
        if self.observer and not self.finished:
            self.observer.on_finish(outcome, time.monotonic() - self.timer.arrival,
                                    self.num_prompt_tokens, self.timer.num_generated)
        self.finished = True

    def discard(self) -> None:
        """End without reporting anything (the caller reports the outcome itself)."""
        self.finished = True
