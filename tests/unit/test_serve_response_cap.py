"""A response that could carry more log-probability entries than
``server.max_response_logprobs`` (echo + logprobs over long prompts, large ``n``,
``top_logprobs`` with a large or unset ``max_tokens``) is refused with 400
``response_too_large`` before any tokenization, streaming or not; requests without
log-probabilities, or within the limit, go on (to the loading engine's 503 here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lmkit.api.sampling_params import SamplingParams
from lmkit.config.schema import LMKitConfig
from lmkit.serve.app import build_app
from lmkit.serve.errors import APIError
from lmkit.serve.limits import (
    LogprobsParams,
    check_response_logprobs,
    count_response_logprobs,
    prompt_token_bounds,
)
from starlette.testclient import TestClient
from test_serve_http import CHAT, assert_openai_error

CONTEXT = 8192
LONG = [1] * 8000  # a token-id prompt of 8,000 tokens


def make_client(max_model_len: int | None = CONTEXT, **server) -> TestClient:
    model = {"model": "tiny", "max_model_len": max_model_len}
    config = LMKitConfig.model_validate({"model": model, "server": server})
    return TestClient(build_app(config))  # no lifespan: the engine stays "loading"


def completions(client, **body):
    return client.post("/v1/completions", json={"model": "tiny", **body})


def chat(client, **body):
    return client.post("/v1/chat/completions", json={**CHAT, **body})


def too_large(resp, param):
    return assert_openai_error(resp, 400, code="response_too_large", param=param)


def passes(resp):
    assert_openai_error(resp, 503, code="model_loading")  # validated, then no engine


# -- over the default limit (4,000,000 entries) ------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_over_a_batch_is_refused_with_the_worst_case(stream):
    client = make_client()
    err = too_large(completions(client, prompt=[LONG] * 32, echo=True, logprobs=20,
                                max_tokens=16, stream=stream), "prompt")
    assert err["type"] == "invalid_request_error"
    # 32 sequences x (8,000 prompt + 16 generated tokens) x (1 + 20)
    assert "5,386,752" in err["message"] and "4,000,000" in err["message"]
    assert "server.max_response_logprobs" in err["message"]
    passes(completions(client, prompt=[LONG] * 23, echo=True, logprobs=20, max_tokens=16,
                       stream=stream))  # 3,871,728: just under


def test_echo_alone_is_blamed_when_one_prompt_is_too_much():
    client = make_client(max_response_logprobs=100_000)
    err = too_large(completions(client, prompt=LONG, echo=True, logprobs=20, max_tokens=1),
                    "echo")
    assert "168,021" in err["message"]  # (8,000 + 1) x 21
    passes(completions(client, prompt=LONG, logprobs=20, max_tokens=1))  # no echo: 21


def test_large_n_with_logprobs_is_refused_naming_n():
    client = make_client()
    err = too_large(completions(client, prompt="hi", n=128, logprobs=5, max_tokens=8000), "n")
    assert "6,144,000" in err["message"]  # 128 x 8,000 x 6
    passes(completions(client, prompt="hi", n=128, logprobs=5, max_tokens=5000))  # 3,840,000


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_with_max_tokens(stream):
    client = make_client()
    too_large(chat(client, n=32, logprobs=True, top_logprobs=20, max_tokens=8000,
                   stream=stream), "n")  # 5,376,000
    passes(chat(client, n=23, logprobs=True, top_logprobs=20, max_tokens=8000,
                stream=stream))  # 3,864,000
    small = make_client(max_response_logprobs=100_000)
    too_large(chat(small, logprobs=True, top_logprobs=20, max_tokens=8000), "max_tokens")
    too_large(chat(small, logprobs=True, top_logprobs=20, max_completion_tokens=8000),
              "max_completion_tokens")
    passes(chat(small, logprobs=True, top_logprobs=20, max_completion_tokens=4000))


def test_unset_max_tokens_counts_the_whole_context_and_names_max_tokens():
    client = make_client()
    err = too_large(chat(client, n=24, logprobs=True, top_logprobs=20),
                    "max_completion_tokens")  # 24 x 8,192 x 21
    assert "4,128,768" in err["message"] and "unset" in err["message"]
    passes(chat(client, n=24, logprobs=True, top_logprobs=20, max_tokens=4096))
    too_large(completions(client, prompt="hi", n=24, logprobs=20, max_tokens=None),
              "max_tokens")
    passes(completions(client, prompt="hi", n=24, logprobs=20))  # the default: 16 tokens
    # a token-id prompt leaves less context: 24 x (8,192 - 600) x 21 = 3,826,368
    passes(completions(client, prompt=[1] * 600, n=24, logprobs=20, max_tokens=None))


def test_requests_without_logprobs_are_never_affected():
    client = make_client(max_response_logprobs=1)
    passes(completions(client, prompt=[LONG] * 256, echo=True, max_tokens=None))
    passes(completions(client, prompt=["hi", "ho"], n=128, max_tokens=None))
    passes(chat(client, n=128))
    passes(chat(client, n=128, logprobs=False, max_tokens=8000))


# -- the setting -------------------------------------------------------------------------

def test_the_setting_raises_lowers_or_lifts_the_limit():
    body = {"prompt": [LONG] * 32, "echo": True, "logprobs": 20, "max_tokens": 16}
    passes(completions(make_client(max_response_logprobs=6_000_000), **body))
    passes(completions(make_client(max_response_logprobs=None), **body))
    low = make_client(max_response_logprobs=1000)
    err = too_large(completions(low, prompt="hi", logprobs=5, max_tokens=200), "max_tokens")
    assert "1,200" in err["message"] and "1,000" in err["message"]
    passes(completions(low, prompt="hi", logprobs=5, max_tokens=166))  # 996
    assert LMKitConfig().server.max_response_logprobs == 4_000_000
    with pytest.raises(ValueError, match="greater than 0"):
        LMKitConfig.model_validate({"server": {"max_response_logprobs": 0}})


def test_the_engines_context_length_is_used_once_it_is_up():
    client = make_client(max_model_len=None, max_response_logprobs=100_000)
    state = client.app.state.lmkit
    params = SamplingParams(logprobs=20, max_tokens=None)
    state.check_response_logprobs(params, [None], LogprobsParams())  # unknown: left to the 503
    passes(chat(client, logprobs=True, top_logprobs=20))
    state.llm = SimpleNamespace(max_model_len=CONTEXT)
    with pytest.raises(APIError) as e:
        state.check_response_logprobs(params, [None], LogprobsParams())
    assert e.value.code == "response_too_large" and "172,032" in e.value.message
    state.llm = SimpleNamespace(max_model_len=4096)  # 4,096 x 21 = 86,016
    state.check_response_logprobs(params, [None], LogprobsParams())


# -- the worst case ----------------------------------------------------------------------

def test_prompt_logprobs_count_the_prompt_tokens():
    params = SamplingParams(prompt_logprobs=20, max_tokens=16)  # no generated logprobs
    worst = count_response_logprobs(params, [LONG, "abc"], CONTEXT)
    assert (worst.num_seqs, worst.generated_tokens, worst.prompt_tokens) == (2, 0, 8011)
    assert worst.entries == 8011 * 21
    names = LogprobsParams(prompt_logprobs="prompt_logprobs")
    with pytest.raises(APIError) as e:
        check_response_logprobs(params, [LONG], CONTEXT, 100_000, names)
    assert (e.value.status, e.value.param) == (400, "prompt_logprobs")
    check_response_logprobs(params, [LONG], CONTEXT, 168_000, names)  # 168,000: at the limit


def test_prompt_and_generated_tokens_together_fit_in_the_context():
    params = SamplingParams(logprobs=1, prompt_logprobs=1, max_tokens=None)
    for prompt in (LONG, "hi", None):
        assert count_response_logprobs(params, [prompt], CONTEXT).entries == CONTEXT * 2
    capped = SamplingParams(logprobs=0, max_tokens=10**9)  # refused later for its length
    assert count_response_logprobs(capped, [[1] * 100], CONTEXT).generated_tokens == 8092


@pytest.mark.parametrize(("prompt", "bounds"), [
    ([5] * 100, (100, 100)), ("hello", (0, 13)), ("日本", (0, 14)),
    ("x" * 20_000, (0, CONTEXT)), ([5] * 9000, (CONTEXT, CONTEXT)), (None, (0, CONTEXT)),
])
def test_prompt_token_bounds_need_no_tokenizer(prompt, bounds):
    assert prompt_token_bounds(prompt, CONTEXT) == bounds
