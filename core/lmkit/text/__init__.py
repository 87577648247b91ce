"""Text around the model: incremental detokenization, stop strings, chat templates.

- ``detokenizer``: :class:`IncrementalDetokenizer` (token ids -> streamed text).
- ``stop``: :class:`StopStringMatcher` (stop strings across streamed chunks).
- ``chat``: :func:`render_chat` (messages -> prompt via the model's chat template).
"""
