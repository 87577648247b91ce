"""From engine-core outputs to user-facing :class:`RequestOutput`: incremental
detokenization, stop strings, logprobs, and folding ``n`` completions into one output.

Each parent request has an :data:`~lmkit.api.outputs.OutputKind`: ``"cumulative"``
outputs copy the completions so far at every step, ``"delta"`` outputs carry the step's
new part only, ``"final"`` parents get one output when they finish. Only the first costs
O(tokens so far) per step: 256 streams of 2,048 tokens spent about 4 ms per step on
their cumulative copies (``bench/output_processing.py``), most of a W1 decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmkit.api.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    OutputKind,
    RequestOutput,
    TokenLogprob,
    check_output_kind,
)
from lmkit.api.request import Request


@dataclass
class _Completion:
    """Text state of one engine request (one of a parent's ``n`` completions)."""

    index: int
    parent: _Parent
    detokenizer: Any
    stop: Any  # a StopStringMatcher, or None without stop strings
    # no stop string may end in the text of the first min_tokens tokens (as in vLLM)
    min_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    # the text so far, in pieces (joined when an output is built: appending to one
    # string attribute copies it every step)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: Any = None  # a RequestFaultError the engine ended it with (its own fault)
    # what the step being processed added (None: nothing yet)
    delta_ids: list[int] | None = None
    delta_text: str = ""
    delta_logprobs: list[TokenLogprob] | None = None

    def add_delta(self, text: str, ids: list[int], logprobs: list[TokenLogprob] | None
                  ) -> None:
        if self.delta_ids is None:  # the common case: one output per request and step
            self.delta_text, self.delta_ids, self.delta_logprobs = text, ids, logprobs
            return
        self.delta_text += text
        self.delta_ids = self.delta_ids + ids
        if logprobs:
            self.delta_logprobs = [*(self.delta_logprobs or ()), *logprobs]

    def finish(self, reason: str, stop_reason: int | str | None) -> None:
        """End this completion (once: its parent counts it)."""
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.parent.num_finished += 1

    @property
    def text(self) -> str:
        """The completion's text so far."""
        parts = self.text_parts
        if len(parts) == 1:
            return parts[0]
        text = "".join(parts)
        parts.clear()
        parts.append(text)
        return text

    def output(self) -> CompletionOutput:
        """The step's output (its delta taken: the next starts empty): cumulative fields
        so far, or for the ``"delta"`` kind the step's part in them too."""
        ids, self.delta_ids = self.delta_ids, None
        delta_text = self.delta_text if ids is not None else ""
        delta_ids = [] if ids is None else ids
        delta_logprobs = self.delta_logprobs if ids is not None else None
        if self.parent.kind == "delta":
            delta_logprobs = None if self.logprobs is None else (
                (delta_logprobs if delta_ids else None) or [])
            text, token_ids, logprobs = delta_text, delta_ids, delta_logprobs
        else:
            text, token_ids = self.text, list(self.token_ids)
            logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(
            index=self.index, text=text, token_ids=token_ids,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            error=self.error if self.finish_reason == "error" else None,
            logprobs=logprobs, delta_text=delta_text, delta_token_ids=delta_ids,
            delta_logprobs=delta_logprobs,
        )


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    kind: OutputKind = "cumulative"
    children: dict[int, _Completion] = field(default_factory=dict)
    engine_ids: list[str] = field(default_factory=list)  # one per child, to forget them
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    num_finished: int = 0  # children whose finish_reason is set (O(1) per output)

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n


@dataclass
class ProcessedOutputs:
    """Outputs of one step: a RequestOutput per parent request that changed (``"final"``
    parents: that finished), of the parent's kind; the engine request ids to abort (stop
    strings); and the tokens each running ``"final"`` parent got (for its metrics)."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    abort_ids: list[str] = field(default_factory=list)
    progress: dict[str, int] = field(default_factory=dict)


class OutputProcessor:
    """Keeps per-request text state; lives in the frontend (API process or ``LLM``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._by_engine_id: dict[str, _Completion] = {}
        self._parents: dict[str, _Parent] = {}

    def add_request(self, request: Request, prompt_text: str | None,
                    parent_id: str | None = None, index: int = 0, n: int = 1,
                    kind: OutputKind = "cumulative") -> None:
        """Track ``request`` as completion ``index`` of parent ``parent_id`` (itself if
        None), whose outputs are of ``kind`` (the parent's first request sets it).

        :raises ValueError: for an unknown ``kind``.
        """
        from lmkit.text.stop import StopStringMatcher
        from lmkit.text.stream_detokenizer import make_detokenizer

        check_output_kind(kind)
        pid = parent_id or request.request_id
        parent = self._parents.get(pid)
        if parent is None:
            parent = _Parent(pid, prompt_text, list(request.prompt_token_ids), n, kind)
            self._parents[pid] = parent
        params = request.sampling_params
        comp = _Completion(
            index=index, parent=parent,
            detokenizer=make_detokenizer(self.tokenizer, request.prompt_token_ids,
                                         skip_special_tokens=params.skip_special_tokens),
            stop=StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.stop else None,
            min_tokens=params.min_tokens,
            logprobs=[] if params.logprobs is not None else None,
        )
        parent.children[index] = comp
        parent.engine_ids.append(request.request_id)
        self._by_engine_id[request.request_id] = comp

    def has_unfinished(self) -> bool:
        """True while any tracked request still has a completion in flight."""
        return bool(self._parents)

    def abort(self, parent_id: str) -> list[str]:
        """Forget a parent request; returns the engine ids of its completions to abort."""
        parent = self._parents.get(parent_id)
        return [] if parent is None else self._forget(parent)

    def _forget(self, parent: _Parent) -> list[str]:
        # O(n) in the parent's own completions, never in everything in flight
        self._parents.pop(parent.request_id, None)
        ids = [eid for eid in parent.engine_ids if self._by_engine_id.pop(eid, None) is not None]
        parent.engine_ids = []
        return ids

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Detokenize and check one engine step's outputs; see :class:`ProcessedOutputs`."""
        result = ProcessedOutputs()
        progress = result.progress
        changed: dict[str, _Parent] = {}
        for out in outputs:
            comp = self._by_engine_id.get(out.request_id)
            if comp is None or comp.finish_reason is not None:
                continue
            parent = comp.parent
            if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = out.prompt_logprobs
            if out.num_cached_tokens > parent.num_cached_tokens:
                parent.num_cached_tokens = out.num_cached_tokens
            if out.error_code is not None:  # failed by its own parameters, not the engine
                comp.error = out.request_fault()
            new_ids = out.new_token_ids
            new_logprobs = out.new_logprobs
            stop = comp.stop
            hit = None
            if stop is not None and len(new_ids) > 1:
                # several tokens in one step (speculative decoding): keep only those up to
                # the one that completes a stop string, as one token per step would
                delta_text, hit, new_ids = _feed_per_token(comp, new_ids)
                if new_logprobs:
                    new_logprobs = new_logprobs[:len(new_ids)]
            else:
                delta_text = comp.detokenizer.push(new_ids) if new_ids else ""
                if stop is not None:  # at most one new token here
                    delta_text, hit = stop.feed(delta_text, can_match=len(
                        comp.token_ids) + len(new_ids) > comp.min_tokens)
            comp.token_ids.extend(new_ids)
            keeps = parent.kind != "delta"  # (delta outputs never read what came before)
            if keeps and comp.logprobs is not None and new_logprobs:
                comp.logprobs.extend(new_logprobs)
            if hit is not None:
                comp.finish("stop", hit)
                result.abort_ids.append(out.request_id)
            elif out.finish_reason is not None:
                # text held back for an incomplete character, then for a partial stop string
                tail = comp.detokenizer.flush()
                if stop is not None:
                    tail, hit = stop.feed(tail, can_match=len(comp.token_ids) > comp.min_tokens)
                delta_text += tail
                if hit is not None:
                    comp.finish("stop", hit)
                else:
                    if stop is not None:
                        delta_text += stop.flush()
                    comp.finish(out.finish_reason, out.stop_reason)
            if keeps:
                comp.text_parts.append(delta_text)
            if parent.kind == "final":
                if new_ids:
                    pid = parent.request_id
                    progress[pid] = progress.get(pid, 0) + len(new_ids)
                if comp.finish_reason is not None:
                    changed[parent.request_id] = parent
                continue
            comp.add_delta(delta_text, list(new_ids), new_logprobs)
            changed[parent.request_id] = parent
        for parent in changed.values():
            finished = parent.finished
            if parent.kind == "final" and not finished:
                continue  # another completion of the parent is still running
            children = parent.children
            outs = [children[i].output() for i in sorted(children)] if len(children) > 1 \
                else [c.output() for c in children.values()]
            result.request_outputs.append(RequestOutput(
                request_id=parent.request_id, prompt=parent.prompt,
                prompt_token_ids=parent.prompt_token_ids, outputs=outs,
                finished=finished, prompt_logprobs=parent.prompt_logprobs,
                num_cached_tokens=parent.num_cached_tokens,
            ))
            if finished:
                self._forget(parent)
        return result


def _feed_per_token(comp: _Completion, new_ids: list[int]) -> tuple[str, str | None, list[int]]:
    """Detokenize ``new_ids`` one token at a time through the stop-string matcher:
    ``(text to emit, matched stop string or None, the ids up to the matching one)``.
    The text of the request's first ``min_tokens`` tokens cannot end a match."""
    pieces: list[str] = []
    num_before = len(comp.token_ids)
    for i, token_id in enumerate(new_ids):
        text, hit = comp.stop.feed(comp.detokenizer.push([token_id]),
                                   can_match=num_before + i + 1 > comp.min_tokens)
        pieces.append(text)
        if hit is not None:
            return "".join(pieces), hit, new_ids[:i + 1]
    return "".join(pieces), None, new_ids
