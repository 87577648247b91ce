"""``lmkit bench latency --peer llamacpp``: the peer runs the model's kept GGUF file,
is named in the report, and is refused where it cannot run; a side that dies without a
result fails the bench instead of hanging it."""

from __future__ import annotations

import pytest
from lmkit.benchmarking import offline
from lmkit.benchmarking.llamacpp import gguf_file
from lmkit.benchmarking.measure import run_isolated
from lmkit.benchmarking.offline import BenchSetup, format_report
from lmkit.benchmarking.workload import Workload
from lmkit.errors import ConfigError

WORKLOAD = Workload("toy", [[5, 6, 7]], [4])


def test_a_model_without_a_gguf_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--peer llamacpp runs a GGUF file.*--peer hf"):
        gguf_file(str(tmp_path))
    setup = BenchSetup("toy", str(tmp_path), {}, "float32", "cpu", 1)
    with pytest.raises(ConfigError, match="keeps none"):
        offline.latency(setup, WORKLOAD, peer="llamacpp")


def test_the_kept_gguf_is_the_peer_model(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert gguf_file(str(tmp_path)) == tmp_path / "model.gguf"


def test_unknown_peers_and_models_without_a_gguf_are_refused(tmp_path):
    setup = BenchSetup("toy", str(tmp_path), {}, "float32", "cpu", 1)
    with pytest.raises(ValueError, match="unknown peer 'vllm'"):
        offline.latency(setup, WORKLOAD, peer="vllm")
    with pytest.raises(ValueError, match="unknown peer 'vllm'"):
        offline.throughput(setup, WORKLOAD, peer="vllm")
    with pytest.raises(ConfigError, match="keeps none"):
        offline.throughput(setup, WORKLOAD, peer="llamacpp")


def test_the_report_names_the_peer():
    def lmkit_side():
        return {"elapsed_s": 1.0, "output_tokens": 4}

    def peer_side():
        return {"elapsed_s": 2.0, "output_tokens": 4}

    setup = BenchSetup("toy", "/x", {}, "float32", "cpu", 2)
    report = offline._paired("latency", setup, WORKLOAD, lmkit_side, peer_side, rounds=1,
                             peer_name="llamacpp")
    assert report["peer"] == "llamacpp" and report["llamacpp"]["elapsed_s"] == 2.0
    assert "lmkit/llamacpp output tokens/s: 2.00x" in format_report(report)


def _die() -> dict:
    import os

    os._exit(3)


def test_a_side_that_dies_fails_instead_of_hanging():
    with pytest.raises(RuntimeError, match="exited with code 3 without a result"):
        run_isolated(_die)
