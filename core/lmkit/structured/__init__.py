"""Structured output (constrained decoding) in the engine core.

- ``constraint``: :class:`Constraint`, parsing and validating
  ``SamplingParams.structured_outputs`` (backend-independent, at the frontend too).
- ``cache``: :class:`GrammarCache`, the bounded LRU of compiled grammars.
- ``compile_pool``: :class:`CompilePool`, the threads that compile off the step loop,
  with time limits that abandon (never wait for) a runaway compilation.
- ``compiler``: :class:`GrammarCompiler` (backend, cache, pool, deduplication) and
  :class:`RequestGrammar`, a request's grammar state (``request.structured_output``).
- ``rows``: :func:`fill_rows`, one request's bitmask rows, draft positions included;
  the other grammar calls of a step, each kept to its own request when it fails.
- ``manager``: :class:`StructuredOutputManager`, what the engine core calls: admits a
  request to the scheduler once its grammar is compiled, fills the step's bitmask rows,
  advances grammars with the accepted tokens, ends requests whose grammar terminated.
- ``off``: the phase of an engine without a backend, refusing constrained requests.

The bitmask's application to the logits is in :mod:`lmkit.sample.bitmask` (worker side).
"""
