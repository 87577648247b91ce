"""The logits-processor machinery without an engine: the hook and kind in a PluginHost
built from an explicit plugin object, slots and batch updates of LogitsProcessorSet,
and the sampler applying processors to the whole batch (draft rows included)."""

from __future__ import annotations

import lmkit
import pytest
import torch
from lmkit.api import BatchUpdate, LogitsProcessor, Spec
from lmkit.api.sampling_params import SamplingParams
from lmkit.errors import InvalidRequestError, UnknownBackendError
from lmkit.plugin_host.manager import PluginHost
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.processors import LogitsProcessorSet, check_request
from lmkit.sample.sampler import Sampler

CPU = torch.device("cpu")
V = 6


class AddOne(LogitsProcessor):
    """Adds ``extra_args['boost']`` to token 0 of its requests; records its updates."""

    is_argmax_invariant = False

    def __init__(self, ctx, options):
        self.ctx = ctx
        self.boost = torch.zeros(ctx.max_num_slots)
        self.updates: list[BatchUpdate] = []

    @classmethod
    def validate_params(cls, params, vocab_size):
        if (params.extra_args or {}).get("boost", 0) < 0:
            raise InvalidRequestError(f"boost must be >= 0 (vocab {vocab_size})",
                                      param="extra_args")

    def update_state(self, update):
        self.updates.append(update)
        for slot in update.removed:
            self.boost[slot] = 0.0
        for added in update.added:
            self.boost[added.slot] = float((added.params.extra_args or {}).get("boost", 100))

    def apply(self, logits, slots):
        logits[:, 0] += self.boost[slots]
        return logits


class Invariant(AddOne):
    is_argmax_invariant = True


class Plugin:
    LMKIT_PLUGIN_API = ">=1.0,<2"

    @lmkit.hookimpl
    def register_logits_processors(self, register):
        register(Spec(name="add-one", target=lambda: AddOne))
        register(Spec(name="invariant", target=lambda: Invariant))


@pytest.fixture
def host():
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"},
                           extra=[("test-procs", Plugin())])


def make_set(host, enabled=(), slots=4):
    return LogitsProcessorSet.from_registry(host.registry, enabled, {}, V, slots, CPU)


def params(*names, **extra):
    return SamplingParams(logits_processors=list(names) or None, extra_args=extra or None)


def test_the_kind_is_registered_through_its_hook(host):
    assert host.registry.names("logits_processor") == ["add-one", "invariant"]
    assert host.plugins["test-procs"].hooks == ["register_logits_processors"]


def test_requests_without_processors_cost_nothing(host):
    procs = make_set(host)
    procs.add("a", params(), [1], [])
    assert not procs.in_use and not procs._instances  # nothing built, no slot taken


def test_slots_and_batch_updates(host):
    procs = make_set(host)
    out_a: list[int] = []
    procs.add("a", params("add-one", boost=5), [1, 2], out_a)
    procs.add("b", params(), [3], [])
    procs.add("c", params("add-one"), [4], [])
    active, slots = procs.for_step(["a", "a", "b", "c"], CPU)
    proc = active[0]
    assert isinstance(proc, AddOne) and proc.ctx.max_num_slots == 5
    assert slots.tolist() == [0, 0, 4, 1]  # b uses no processor: the spare slot 4
    (update,) = proc.updates
    assert update.removed == () and [(a.slot, a.req_id) for a in update.added] == [
        (0, "a"), (1, "c")]
    assert update.added[0].output_token_ids is out_a  # the live list, not a copy
    # removed then re-added before the next step: the processor sees the net change only
    procs.remove("c")
    procs.add("d", params("add-one"), [5], [])
    procs.remove("d")
    procs.remove("a")
    procs.add("e", params("add-one"), [6], [])
    procs.for_step(["e"], CPU)
    last = proc.updates[-1]
    assert sorted(last.removed) == [0, 1] and [(a.slot, a.req_id) for a in last.added] == [
        (0, "e")]


def test_processors_enabled_for_all_apply_to_every_request(host):
    procs = make_set(host, enabled=["add-one"])
    assert procs.affects_greedy
    procs.add("a", params(), [1], [])
    assert procs.in_use
    assert not make_set(host, enabled=["invariant"]).affects_greedy


def test_unknown_names_say_what_exists(host):
    with pytest.raises(UnknownBackendError, match="unknown logits processor 'add-on'; known: "
                       "add-one, invariant. Did you mean 'add-one'?"):
        make_set(host, enabled=["add-on"])


def test_too_many_requests_is_an_internal_error(host):
    procs = make_set(host, slots=1)
    procs.add("a", params("add-one"), [1], [])
    with pytest.raises(RuntimeError, match="no free slot"):
        procs.add("b", params("add-one"), [1], [])


def test_sampler_applies_processors_to_every_row_including_drafts(host):
    procs = make_set(host)
    procs.add("x", params("add-one", boost=50), [1], [])
    procs.add("y", params(), [1], [])
    logits = torch.zeros(4, V)
    logits[:, 3] = 1.0  # argmax 3 unless boosted
    greedy = SamplingParams(temperature=0.0)
    md = SamplingMetadata.build([greedy] * 4, [[1]] * 4, [[]] * 4, [None] * 4, [None] * 4,
                                V, CPU)
    md.logits_processors, md.processor_slots = procs.for_step(["x", "x", "x", "y"], CPU)
    out = Sampler().sample_requests(logits, md, [[0, 0], []])
    assert out.token_ids == [[0, 0, 0], [3]] and out.num_accepted == [2, 0]
    assert logits[0, 0] == 0.0  # applied to the sampler's copy



def test_check_request_asks_each_processor_that_applies(host):
    check_request(host.registry, params(), (), V)  # no processors: nothing loaded
    check_request(host.registry, params("add-one", boost=1), (), V)
    with pytest.raises(InvalidRequestError, match=r"boost must be >= 0 \(vocab 6\)"):
        check_request(host.registry, params("add-one", boost=-1), (), V)
    with pytest.raises(InvalidRequestError, match="boost must be >= 0"):  # enabled for all
        check_request(host.registry, params(boost=-1), ("add-one",), V)
    with pytest.raises(UnknownBackendError, match="unknown logits processor 'nope'"):
        check_request(host.registry, params("nope"), (), V)
