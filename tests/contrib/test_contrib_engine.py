"""The installed contrib plugins inside the real engine (a tiny random Llama on CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lmkit.testing.tiny_model import make_tiny_model

PROMPTS = ["hello there", "abc abc abc", "x", "the quick brown fox", "0123", "fair?"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-contrib"))


def generate(model_dir: Path, priority: list[int] | None = None, **options) -> tuple[list, object]:
    from lmkit import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=128, num_blocks=96,
              block_size=4, max_num_batched_tokens=16, **options)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, priority=priority)
    return [o.outputs[0].token_ids for o in outs], llm.engine


def test_fair_share_gives_fcfs_tokens(contrib_on_path, model_dir) -> None:
    fcfs, _ = generate(model_dir, scheduler="fcfs", max_num_seqs=4)
    fair, engine = generate(model_dir, scheduler="fair-share", max_num_seqs=4)
    assert type(engine.scheduler).__name__ == "FairShareScheduler"
    assert fair == fcfs
    assert all(len(tokens) == 12 for tokens in fair)


def test_fair_share_between_tenants_in_the_engine(contrib_on_path, model_dir) -> None:
    """Two tenants (by priority value); one request at a time, so the admission order
    differs from fcfs while every output stays what the prompt gives alone."""
    tenants = [0, 0, 0, 0, 1, 1]
    fcfs, _ = generate(model_dir, tenants, scheduler="fcfs", max_num_seqs=1)
    fair, engine = generate(model_dir, tenants, scheduler="fair-share", max_num_seqs=1,
                            **{"scheduler.options": {"tenant_from": "priority"}})
    assert fair == fcfs
    service = engine.scheduler.get_stats()["tenant_service"]
    assert set(service) == {"0", "1"} and service["1"] > 0


def test_installed_plugins_pass_the_conformance_suites(contrib_on_path) -> None:
    """Through the registry, as the engine finds them (entry points of the installed
    distributions), not through imports of the source tree."""
    from lmkit.plugin_host.manager import PluginHost
    from lmkit.testing.scheduler import check_scheduler
    from lmkit.testing.structured_output import check_structured_output_backend

    host = PluginHost.load(env={})
    fair = host.registry.get("scheduler", "fair-share")
    assert fair.dist == "lmkit-fair-scheduler"
    module_file = Path(sys.modules[fair.spec.load().__module__].__file__ or "")
    assert module_file.is_relative_to(contrib_on_path)
    assert set(check_scheduler(fair).values()) == {"passed"}
    llg = host.registry.get("structured_output", "llguidance")
    assert set(check_structured_output_backend(llg).values()) == {"passed"}
