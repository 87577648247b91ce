"""Sampling: per-step metadata, logit adjustments, filters, the sampler and logprobs.

Modules (each imports torch, so this package imports them lazily):

- ``metadata``: :class:`SamplingMetadata`, the batch's parameters as tensors.
- ``penalties``: logit bias, token bans (min_tokens, bad_words), allowed token ids,
  repetition/frequency/presence penalties.
- ``filters``: temperature, min-p, top-k, top-p and the final softmax.
- ``draws``: the pipeline's steps (adjust, distribution, one draw per row).
- ``rejection``: the draft acceptance rule (greedy prefix, rejection sampling).
- ``drafts``: draft layout, rejection sampling of random rows, the greedy host walk.
- ``processors``: :class:`LogitsProcessorSet`, the plugin logits processors in use.
- ``logprobs``: chosen-token logprobs, ranks, top alternatives, prompt logprobs.
- ``sampler``: :class:`Sampler`, the one pipeline (drafts optional).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "SamplingMetadata": "lmkit.sample.metadata",
    "Sampler": "lmkit.sample.sampler",
    "SamplerOutput": "lmkit.sample.sampler",
    "VerifiedTokens": "lmkit.sample.drafts",
    "LogitsProcessorSet": "lmkit.sample.processors",
    "make_generator": "lmkit.sample.sampler",
    "compute_prompt_logprobs": "lmkit.sample.sampler",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lmkit.sample' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
