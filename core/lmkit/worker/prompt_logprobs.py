"""Prompt logprobs gathered over prefill chunks: each step scores the prompt tokens its
chunk predicts, and a request's list is handed out once its prompt is done."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lmkit.api.model import CausalLM
from lmkit.api.outputs import TokenLogprob
from lmkit.sample.sampler import compute_prompt_logprobs
from lmkit.worker.input_batch import CachedRequestState, StepInputs


def step_prompt_logprobs(model: CausalLM, requests: Mapping[str, CachedRequestState],
                         hidden: torch.Tensor, order: list[str], step: StepInputs
                         ) -> dict[str, list[TokenLogprob | None]]:
    """Accumulate prompt logprobs over this step's chunks; return completed lists.

    :param model: the model whose head scores the rows (only called for requests that
        asked for prompt logprobs, which a pooling-only model never has).
    :param order: the step's requests, in the row order of ``step``.
    """
    done: dict[str, list[TokenLogprob | None]] = {}
    for i, rid in enumerate(order):
        state = requests[rid]
        if state.prompt_logprobs is None:
            continue
        start = int(step.num_computed[i])
        end = start + int(step.num_scheduled[i])
        # row at position p scores prompt token p + 1
        last = min(end, state.num_prompt_tokens - 1)
        if last > start:
            first_row = int(step.cu_num_tokens[i] - step.num_scheduled[i])
            logits = model.compute_logits(hidden[first_row:first_row + last - start])
            targets = torch.tensor(state.prompt_token_ids[start + 1:last + 1])
            state.prompt_logprobs.extend(compute_prompt_logprobs(
                logits, targets, state.sampling_params.prompt_logprobs or 0))
        if end >= state.num_prompt_tokens:
            done[rid] = state.prompt_logprobs
            state.prompt_logprobs = None
    return done
