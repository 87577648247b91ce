"""The ``sampling_kernels`` plugin kind: declared like the other stack kinds, ``auto``
choosing by device and priority (``triton`` on CUDA, ``torch`` elsewhere), a clear
refusal of ``triton`` on a CPU stack, the Triton kernels' policy following the measured
table, the model runner's sampler built with the chosen kernels, and the conformance
suite (which must pass the torch kernels and fail broken ones)."""

from __future__ import annotations

import pytest
import torch
from lmkit.api import SamplingKernels, TorchSamplingKernels
from lmkit.api.contract import CONSTRUCTORS
from lmkit.config import LMKitConfig
from lmkit.errors import ConfigError
from lmkit.plugin_host import spec as spec_module
from lmkit.plugin_host.kinds import KINDS, OPTIONAL_KINDS, REGISTER_HOOKS, STACK_KINDS
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack
from lmkit.plugin_host.spec import Needs
from lmkit.sample.kernels import build_sampling_kernels
from lmkit.testing import ConformanceFailure
from lmkit.testing.sampling_kernels import check_sampling_kernels
from lmkit_plugins.sampling import policy


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})


def _config(backend: str = "auto") -> LMKitConfig:
    cfg = LMKitConfig()
    cfg.executor.device = "cpu"
    cfg.sampling_kernels.backend = backend
    return cfg


def test_the_kind_is_declared_like_the_others():
    assert REGISTER_HOOKS["sampling_kernels"] == "register_sampling_kernels"
    assert "sampling_kernels" in KINDS and "sampling_kernels" in STACK_KINDS
    assert "sampling_kernels" in OPTIONAL_KINDS  # none: the core's torch kernels
    assert CONSTRUCTORS["sampling_kernels"].interface is SamplingKernels
    assert CONSTRUCTORS["sampling_kernels"].signature == "cls(*, device, options)"
    assert LMKitConfig().sampling_kernels.backend == "auto"


def test_builtins_declare_devices_and_priorities(host):
    torch_spec = host.registry.get("sampling_kernels", "torch").spec
    triton_spec = host.registry.get("sampling_kernels", "triton").spec
    assert torch_spec.caps.values["device"] == {"cpu", "cuda"} and torch_spec.priority == 0
    assert triton_spec.caps.values["device"] == {"cuda"} and triton_spec.priority > 0
    assert torch_spec.load() is TorchSamplingKernels


def test_auto_is_torch_on_the_cpu(host):
    stack = resolve_stack(_config(), host)
    assert stack.names()["sampling_kernels"] == "torch"
    assert type(build_sampling_kernels(stack, torch.device("cpu"))) is TorchSamplingKernels


def test_none_is_the_cores_torch_kernels(host):
    stack = resolve_stack(_config("none"), host)
    assert stack.get("sampling_kernels") is None
    assert type(build_sampling_kernels(stack, torch.device("cpu"))) is TorchSamplingKernels


def test_auto_is_triton_on_cuda(host, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(spec_module, "cuda_device_count", lambda: 1)
    assert host.select("sampling_kernels", "auto", Needs(values={"device": "cuda"})).name == \
        "triton"


def test_triton_on_a_cpu_stack_is_refused_with_the_reason(host):
    with pytest.raises(ConfigError, match=r"sampling kernels 'triton'.*cannot be used:.*"
                                          r"device cpu not supported \(supports: cuda\)"
                                          r"(.|\n)*Available instead: torch"):
        resolve_stack(_config("triton"), host)


def test_unknown_name_lists_the_known_ones(host):
    with pytest.raises(ConfigError, match=r"unknown sampling kernels 'trition'; known: triton, torch.*"
                                          r"Did you mean 'triton'"):
        resolve_stack(_config("trition"), host)


@pytest.mark.parametrize("op,mode", sorted(policy.MEASURED))
def test_policy_uses_the_kernel_exactly_where_the_table_says(op, mode):
    for batch, vocab in policy.MEASURED[(op, mode)]:
        torch_us, triton_us = policy.MEASURED[(op, mode)][(batch, vocab)]
        faster = torch_us / triton_us >= policy.MIN_SPEEDUP
        assert policy.use_kernel(op, (mode,), batch, vocab) == faster


def test_top_p_race_only_where_it_measured_faster(monkeypatch):
    from lmkit_plugins.sampling.triton_kernels import top_p_race_rounds

    for (batch, vocab), (search_us, race_us) in policy.RACE_MEASURED.items():
        assert policy.uses_top_p_race(batch, vocab) == (race_us < search_us)
    assert top_p_race_rounds(256, 151936) is None  # the kernel's default rounds
    assert top_p_race_rounds(200, 128256) is None  # nearest: 256 x 151,936
    assert top_p_race_rounds(8, 151936) == 0  # small batches: the search alone
    monkeypatch.setenv("LMKIT_TOP_P_RACE", "0")
    assert top_p_race_rounds(256, 151936) == 0


def test_policy_picks_the_nearest_measured_shape():
    # top-p: faster from batch 1 at vocab 49k (1.61x) and at 152k (2.82x)
    assert policy.use_kernel("sample", ("top-p",), 1, 32000)
    assert policy.use_kernel("sample", ("top-p",), 1, 128256)  # nearest: 151936
    # top-k at 152k: only around batch 32 (1.28x; 0.92x at 1, 0.65x at 256)
    assert not policy.use_kernel("sample", ("top-k",), 1, 128256)
    assert policy.use_kernel("sample", ("top-k",), 8, 128256)  # nearest batch: 32
    assert policy.use_kernel("sample", ("top-k", "top-p"), 32, 151936)
    assert not policy.use_kernel("sample", ("top-k", "top-p"), 256, 151936)
    # temperature only: batch 256 at 49k (1.07x); batch >= 6 at 152k (1.10x, 1.65x)
    assert not policy.use_kernel("sample", ("temp",), 64, 49152)
    assert policy.use_kernel("sample", ("temp",), 100, 49152)
    assert policy.use_kernel("sample", ("temp",), 8, 151936)
    # top-k alone: only around batch 32 at 49k; top-k with top-p needs both to win
    assert policy.use_kernel("sample", ("top-k",), 32, 49152)
    assert not policy.use_kernel("sample", ("top-k",), 256, 49152)
    assert not policy.use_kernel("sample", ("top-k", "top-p"), 256, 49152)
    # verification: every measured shape but the near tie (top-p, 256 x 152k: 1.05x)
    assert policy.use_kernel("verify", ("temp",), 1, 151936)
    assert not policy.use_kernel("verify", ("top-p",), 256, 151936)
    assert policy.modes(False, False) == ("temp",)
    assert policy.modes(True, True) == ("top-k", "top-p")


def test_conformance_suite_passes_the_torch_kernels():
    assert set(check_sampling_kernels(TorchSamplingKernels).values()) == {"passed"}


class _IgnoresTopP(TorchSamplingKernels):
    def sample(self, logits, rows):
        from dataclasses import replace
        return super().sample(logits, replace(rows, top_p=None))


class _IgnoresSeeds(TorchSamplingKernels):
    def sample(self, logits, rows):
        from dataclasses import replace
        return super().sample(logits, replace(rows, generators={}))


class _AlwaysAccepts(TorchSamplingKernels):
    def verify(self, probs, rows, drafts, draft_probs):
        tokens, accepted = super().verify(probs, rows, drafts, draft_probs)
        return tokens, torch.ones_like(accepted)


class _OffByOne(TorchSamplingKernels):
    def plan_device_step(self, targets, inputs, start, tables, block_size):
        accepted, last, rows, chain = super().plan_device_step(targets, inputs, start, tables,
                                                               block_size)
        return accepted, last + 1, rows, chain


class _PresenceOnce(TorchSamplingKernels):  # presence taken as frequency (per count)
    def apply_penalties(self, logits, penalties):
        from dataclasses import replace
        return super().apply_penalties(logits, replace(
            penalties, frequency=penalties.frequency + penalties.presence,
            presence=torch.zeros_like(penalties.presence)))


class _WritesSeen(TorchSamplingKernels):
    def apply_penalties(self, logits, penalties):
        out = super().apply_penalties(logits, penalties)
        penalties.seen[0, 0] = ~penalties.seen[0, 0]
        return out


@pytest.mark.parametrize("cls,prop", [(_IgnoresTopP, "sample distribution"),
                                      (_IgnoresSeeds, "seeded rows"),
                                      (_AlwaysAccepts, "verify distribution"),
                                      (_OffByOne, "device step"),
                                      (_PresenceOnce, "penalties"),
                                      (_WritesSeen, "penalties")])
def test_conformance_suite_fails_broken_kernels(cls, prop):
    with pytest.raises(ConformanceFailure) as info:
        check_sampling_kernels(cls)
    assert info.value.prop == prop


def test_conformance_suite_checks_the_constructor():
    class NoOptions(TorchSamplingKernels):
        def __init__(self, *, device):
            super().__init__(device=device)

    with pytest.raises(ConformanceFailure, match="constructor signature"):
        check_sampling_kernels(NoOptions)
