"""Speculative decoding in the core: proposers only propose, the core verifies.

- ``manager``: :class:`ProposerManager`, which the engine core calls after each step
  to get draft tokens for the decoding requests from the chosen proposer plugin.
- ``validate``: what a proposer returned, checked per request before any draft is used.
- ``rows``: the sampling rows of a step with drafts (one per position).
- ``stats``: :class:`SpecDecodeStats`, drafts proposed and accepted, acceptance rate,
  mean accepted length, acceptance per draft position.

Verification itself is the sampler's (:mod:`lmkit.sample.sampler`): the same pipeline
over ``k + 1`` rows per request plus the acceptance rule (:mod:`lmkit.sample.rejection`).
"""
