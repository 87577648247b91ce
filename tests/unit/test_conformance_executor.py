"""The executor conformance suite: uniproc passes against itself; an executor that
samples wrong tokens or hides workers fails with the step named."""

from __future__ import annotations

import pytest
from lmkit.api import Spec
from lmkit.plugin_host.manager import PluginHost
from lmkit.testing import ConformanceFailure
from lmkit.testing.executor import check_executor
from lmkit.testing.tiny_model import make_tiny_model
from lmkit_plugins.executors.uniproc import UniProcExecutor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-executor"))


class OffByOne(UniProcExecutor):
    """Samples the next token id for the third request."""

    def execute(self, scheduler_output):
        out = super().execute(scheduler_output)
        out.sampled_token_ids = [[(t + 1) % 320 for t in ids] if rid == "r2" else ids
                                 for rid, ids in zip(out.req_ids, out.sampled_token_ids,
                                                     strict=True)]
        return out


class PhantomTier(UniProcExecutor):
    def offload_lookup(self, block_hashes):
        return len(block_hashes), 0


def test_uniproc_passes(model_dir):
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    results = check_executor(host.registry.get("executor", "uniproc"), model_dir=model_dir)
    assert set(results.values()) == {"passed"}


def test_wrong_tokens_and_a_phantom_offload_tier_fail(model_dir):
    with pytest.raises(ConformanceFailure) as exc:
        check_executor(Spec(name="off-by-one", target=lambda: OffByOne), model_dir=model_dir,
                       only=["tokens equal uniproc"])
    msg = str(exc.value)
    assert "'off-by-one' fails property 'tokens equal uniproc'" in msg
    assert "step 1 (scheduled {" in msg and "uniproc sampled" in msg
    with pytest.raises(ConformanceFailure, match=r"returned \(\(1, 0\), \{\}\); expected"):
        check_executor(Spec(name="phantom-tier", target=lambda: PhantomTier),
                       model_dir=model_dir, only=["offload methods"])
