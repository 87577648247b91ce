"""The formatters' pre-encoded SSE events (one write per output) are byte for byte the
server-sent events of their chunk dicts, for every stream option."""

from __future__ import annotations

import pytest
from lmkit.serve.logprobs import TokenTexts
from lmkit.serve.protocol import ChatCompletionRequest, CompletionRequest
from lmkit.serve.routes_chat import ChatFormatter
from lmkit.serve.routes_completions import CompletionFormatter
from lmkit.serve.streaming import ChunkTemplate, sse
from test_serve_formatting import StubTokenizer, out

STREAM_OPTIONS = [None, {"include_usage": True},
                  {"include_usage": True, "continuous_usage_stats": True}]
# a stream: text with quotes, newlines and non-ASCII, then both completions finishing
OUTPUTS = [
    lambda: out([([4], 'say "hi"\n', [4]), ([5], "é😀", [5])], finished=False),
    lambda: out([([], "", [4]), ([6], "\\t", [5, 6])], finished=False),
    lambda: out([([7], "end", [4, 7]), ([], "", [5, 6])], finish=["stop", "length"]),
]


def _check(make) -> None:
    dicts, events = make(), make()  # two formatters fed the same outputs
    for output in OUTPUTS:
        expected = b"".join(sse(c) for c in dicts.chunks(0, output()))
        assert events.events(0, output()) == expected


@pytest.mark.parametrize("options", STREAM_OPTIONS)
@pytest.mark.parametrize("logprobs", [None, 1])
@pytest.mark.parametrize("echo", [False, True])
def test_completion_events_equal_chunks(options, logprobs, echo):
    body = CompletionRequest(model="m", prompt="a", n=2, stream=True, logprobs=logprobs,
                             echo=echo, stream_options=options)
    _check(lambda: CompletionFormatter(body, "cmpl-1", "m/odd \"name\"",
                                       TokenTexts(StubTokenizer())))


@pytest.mark.parametrize("options", STREAM_OPTIONS)
@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_events_equal_chunks(options, logprobs):
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], n=2,
                                 stream=True, logprobs=logprobs,
                                 top_logprobs=1 if logprobs else None, stream_options=options)
    _check(lambda: ChatFormatter(body, "chatcmpl-1", "m", TokenTexts(StubTokenizer())))


def test_template_event_is_sse_of_its_dict():
    template = ChunkTemplate({"id": "x", "created": 1, "n": None}, include_usage=True)
    choices = [{"index": 0, "text": "a\u2028b", "finish_reason": None}]
    for usage in (None, {"prompt_tokens": 1}):
        assert template.event(choices, usage) == sse(template.as_dict(choices, usage))
    with pytest.raises(ValueError, match="fixed field"):
        ChunkTemplate({}, include_usage=False)
