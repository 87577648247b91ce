"""What the executor hands back to the scheduler each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmkit.api.outputs import TokenLogprob


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens per scheduled request, in ``req_ids`` order.

    ``sampled_token_ids[i]`` is empty for a request whose prefill chunk did not reach
    the end of its prompt; it holds one token for a decode, and up to k+1 accepted
    tokens with speculative decoding.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] | None = None
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    # speculative decoding: number of draft tokens proposed / accepted per request
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    # a runner-hosted proposer's drafts for the next step, per request that sampled
    # (the engine keeps those of requests that may speculate)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # KV offload: loads (by the scheduler's transfer id) that finished, with success
    finished_kv_loads: dict[int, bool] = field(default_factory=dict)
    # pooling requests whose prompt finished this step -> pooled output (a list of
    # floats, or one list per token); None when the step had no pooling request
    pooled: dict[str, Any] | None = None
    # requests with a sampled token drawn from a row whose logits were all -inf after
    # every mask (grammar bitmask, allowed_token_ids, min_tokens and bad_words bans,
    # logits processors: nothing was allowed) -> that token's index in their
    # sampled_token_ids. The tokens before it are valid; it and any after are garbage. A
    # scheduler keeps the valid ones and ends the request with finish_reason "error"
    # (error_code "no_allowed_token"); see docs/plugin-guide.md
    no_allowed_token: dict[str, int] = field(default_factory=dict)
