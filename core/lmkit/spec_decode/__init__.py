"""Speculative decoding in the core: proposers only propose, the core verifies.

- ``manager``: :class:`ProposerManager`, which the engine core calls after each step
  to get draft tokens for the decoding requests from the chosen proposer plugin.
- ``rejection``: the verification mathematics (greedy prefix, rejection sampling).
- ``sampler``: :class:`SpecDecodeSampler`, the model runner's sampler for steps with
  drafts.
- ``stats``: :class:`SpecDecodeStats`, drafts proposed and accepted, acceptance rate,
  mean accepted length, acceptance per draft position.

Modules that import torch (``rejection``, ``sampler``) are imported on use only.
"""
