"""A logits-processor plugin installed for real (tests/fixtures/dists/
lmkit-testplugin-logits, entry-point group ``lmkit``) changes outputs exactly as it
specifies: ``force-token-test`` makes one token the only one that can be sampled.
Through ``LLM`` on the tiny random model, per request and for every request (config),
with speculative decoding too."""

from __future__ import annotations

import pytest
from lmkit import LLM, SamplingParams
from lmkit.errors import InvalidRequestError, UnknownBackendError
from lmkit.testing.tiny_model import make_tiny_model
from test_plugin_dists import install_test_dists

pytestmark = pytest.mark.slow  # pip-installs the fixture distributions

FORCED = 88  # the byte 'X'
PROMPTS = ["abcabcabcabc", "hello world, hello world", "xyz"]


@pytest.fixture(scope="module")
def plugin_on_path(tmp_path_factory):
    site = install_test_dists(tmp_path_factory)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        mp.setenv("LMKIT_PLUGINS", "logits-test")  # only this third-party plugin
        yield site


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-logits"))


def force(**kw) -> SamplingParams:
    return SamplingParams(logits_processors=["force-token-test"],
                          extra_args={"force_token_id": FORCED}, ignore_eos=True, **kw)


@pytest.mark.parametrize("engine", [{}, dict(speculative="ngram", num_speculative_tokens=3)],
                         ids=["plain", "ngram"])
def test_per_request_processor_forces_every_token(plugin_on_path, model_dir, engine):
    with LLM(str(model_dir), max_model_len=256, **engine) as llm:
        assert llm.host.plugins["logits-test"].dist == "lmkit-testplugin-logits"
        plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
        # forced and plain requests in one batch: only the forced ones change
        mixed = llm.generate(PROMPTS * 2, [force(temperature=1.0, seed=1, max_tokens=10)] * 3
                             + [plain] * 3)
        for out in mixed[:3]:
            assert out.outputs[0].token_ids == [FORCED] * 10
        assert [o.outputs[0].token_ids for o in mixed[3:]] == alone
        greedy = llm.generate(PROMPTS, force(temperature=0.0, max_tokens=10))
        assert all(o.outputs[0].token_ids == [FORCED] * 10 for o in greedy)


def test_processor_enabled_for_every_request_in_config(plugin_on_path, model_dir):
    with LLM(str(model_dir), max_model_len=256, **{
            "logits_processors.enable": ["force-token-test"],
            "logits_processors.options": {"force-token-test": {"token_id": 66}}}) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6,
                                                    ignore_eos=True))
        assert all(o.outputs[0].token_ids == [66] * 6 for o in outs)
        # a request's own argument wins over the option
        out = llm.generate(PROMPTS[:1], force(temperature=0.0, max_tokens=4))[0]
        assert out.outputs[0].token_ids == [FORCED] * 4


def test_unknown_processor_names_are_refused_at_the_front(plugin_on_path, model_dir):
    with LLM(str(model_dir), max_model_len=256) as llm:
        # the processor's own check of its arguments refuses the request alone
        with pytest.raises(InvalidRequestError) as exc:
            llm.generate(["a"], SamplingParams(logits_processors=["force-token-test"],
                                               extra_args={"force_token_id": 10 ** 6}))
        assert str(exc.value) == ("force-token-test needs extra_args['force_token_id'] to be "
                                  "a token id in [0, 320), got 1000000")
        assert exc.value.param == "extra_args"
        out = llm.generate(["a"], force(temperature=0.0, max_tokens=3))[0]
        assert out.outputs[0].token_ids == [FORCED] * 3  # the engine serves on
        with pytest.raises(InvalidRequestError) as exc:
            llm.generate(["a"], SamplingParams(logits_processors=["force-tokn-test"]))
        assert str(exc.value) == (
            "unknown logits processor 'force-tokn-test'; known: force-token-test. Did you "
            "mean 'force-token-test'? Install or load (-p NAME) the plugin that registers "
            "it, or remove it from logits_processors.")
        assert exc.value.param == "logits_processors"
    with pytest.raises(UnknownBackendError, match="unknown logits processor 'nope'"):
        LLM(str(model_dir), max_model_len=256, **{"logits_processors.enable": ["nope"]})
