"""Every conformance kit builds the implementation through its kind's one documented
constructor signature (lmkit.api.contract), and a class that does not accept it, or
does not subclass the interface, fails with property 'constructor signature' and a
message naming the signature."""

from __future__ import annotations

import pytest
from lmkit.api import LMKitConfig, PagedScheduler, Spec, SpecProposer
from lmkit.api.contract import CONSTRUCTORS, build, constructor_problem
from lmkit.errors import PluginError
from lmkit.testing import ConformanceFailure
from lmkit.testing.attention import check_attention_backend
from lmkit.testing.executor import check_executor
from lmkit.testing.offload import check_offload_manager
from lmkit.testing.scheduler import check_scheduler
from lmkit.testing.spec_decode import check_spec_proposer
from lmkit.testing.structured_output import check_structured_output_backend
from lmkit_plugins.attention.torch_ref import TorchAttention
from lmkit_plugins.executors.uniproc import UniProcExecutor
from test_conformance_offload import MemoryTier, TierOptions
from test_conformance_spec_decode import PromptLookup
from test_conformance_structured_output import ChoiceBackend

SIGNATURE = "fails property 'constructor signature'"


class RenamedAttention(TorchAttention):
    """Names a constructor argument its own way (n_heads): models pass num_heads."""

    def __init__(self, *, n_heads, num_kv_heads, head_size, scale, dtype, device,
                 block_size, sliding_window=None, options=None):
        raise AssertionError("never built")


class NoOptionsScheduler(PagedScheduler):
    def __init__(self, config, num_blocks):
        super().__init__(config, num_blocks=num_blocks)


class NoOptionsProposer(PromptLookup):
    def __init__(self, config):
        super().__init__(config)


class NoVocabBackend(ChoiceBackend):
    def __init__(self, tokenizer, options=None):
        super().__init__(tokenizer, 320, options)


class NotATier:
    def __init__(self, config, kv_caches, options=None):
        pass


class OldExecutor(UniProcExecutor):
    """The executor signature before ModelFacts: no ``facts``."""

    def __init__(self, config, stack, options=None, host=None):
        super().__init__(config, stack, options=options, host=host)


def _spec(cls):
    return Spec(name=cls.__name__.lower(), target=lambda: cls)


@pytest.mark.parametrize("check, cls, signature", [
    (check_attention_backend, RenamedAttention, CONSTRUCTORS["attention"].signature),
    (check_scheduler, NoOptionsScheduler, CONSTRUCTORS["scheduler"].signature),
    (check_spec_proposer, NoOptionsProposer, CONSTRUCTORS["speculative"].signature),
    (check_structured_output_backend, NoVocabBackend,
     CONSTRUCTORS["structured_output"].signature),
])
def test_a_wrong_init_fails_with_the_documented_signature(check, cls, signature):
    with pytest.raises(ConformanceFailure) as exc:
        check(_spec(cls))
    msg = str(exc.value)
    assert SIGNATURE in msg and signature in msg and cls.__name__ in msg


def test_a_class_outside_the_interface_fails():
    with pytest.raises(ConformanceFailure, match="(?s)constructor signature.*NotATier does not "
                                                 "subclass lmkit.api.OffloadManager"):
        check_offload_manager(_spec(NotATier))


def test_the_executor_kit_builds_with_host_and_facts(tmp_path):
    from lmkit.testing.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny")
    with pytest.raises(ConformanceFailure, match="(?s)constructor signature.*unexpected "
                                                 "keyword argument 'facts'"):
        check_executor(_spec(OldExecutor), model_dir=model_dir, only=["shutdown twice"])


def test_reference_implementations_pass_the_constructor_property():
    tier = Spec(name="memory", target=lambda: MemoryTier, options=TierOptions)
    assert check_offload_manager(tier, only=["constructor signature"]) == {
        "constructor signature": "passed"}
    assert check_spec_proposer(_spec(PromptLookup), only=["constructor signature"]) == {
        "constructor signature": "passed"}


def test_build_names_the_plugin_and_the_signature():
    with pytest.raises(PluginError, match=r"speculative plugin \(plugin mine\).*"
                                          r"cls\(config, \*, options\)"):
        build("speculative", NoOptionsProposer, object(), options=None, plugin="mine")
    assert constructor_problem("speculative", PromptLookup, object(), options=None) is None
    assert "not a class" in constructor_problem("speculative", object(), None)
    config = LMKitConfig()
    assert isinstance(build("speculative", PromptLookup, config, options=None), SpecProposer)
