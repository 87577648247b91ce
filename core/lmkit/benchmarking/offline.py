"""``lmkit bench throughput`` and ``lmkit bench latency``: lmkit and a peer on the same
workload in one run, each in its own process; results as a table and JSON."""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmkit.benchmarking import sides
from lmkit.benchmarking.measure import run_isolated
from lmkit.benchmarking.workload import (
    Workload,
    chat_workload,
    copy_workload,
    file_workload,
    random_workload,
)

PEERS = ("hf", "llamacpp", "none")  # llamacpp: the model's GGUF file


@dataclass
class BenchSetup:
    """What to run: the model (resolved to a local directory), engine options, workload."""

    model: str
    model_dir: str
    options: dict[str, Any]
    dtype: str
    device: str
    threads: int | None = None


def make_workload(kind: str, tokenizer: Any, vocab_size: int, num_prompts: int,
                  input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                  dataset: Path | None = None) -> Workload:
    """The workload named by ``kind``: ``chat``, ``copy``, ``random`` or ``file``."""
    if kind == "chat":
        return chat_workload(tokenizer, num_prompts, output_len[0], seed)
    if kind == "copy":
        return copy_workload(tokenizer, num_prompts, seed)
    if kind == "random":
        return random_workload(num_prompts, input_len, output_len, vocab_size, seed)
    if kind == "file":
        if dataset is None:
            raise ValueError("--workload file needs --dataset PATH")
        return file_workload(dataset, tokenizer, output_len[0])
    raise ValueError(f"unknown workload {kind!r}; choose chat, copy, random or file")


def _rates(result: dict[str, Any], workload: Workload) -> dict[str, Any]:
    t = result["elapsed_s"]
    out = dict(result)
    out.update(
        requests_per_s=len(workload.prompts) / t,
        output_tokens_per_s=result["output_tokens"] / t,
        total_tokens_per_s=(result["output_tokens"] + workload.num_prompt_tokens) / t,
    )
    return out


def throughput(setup: BenchSetup, workload: Workload, peer: str = "hf",
               hf_batch_size: int | None = None, rounds: int = 1) -> dict[str, Any]:
    """Run lmkit and the peer on ``workload`` (``rounds`` times, see :func:`_paired`);
    return both results and their ratio."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; choose {', '.join(PEERS)}")

    def run_lmkit() -> dict[str, Any]:
        return run_isolated(sides.lmkit_throughput, setup.model_dir, setup.options, workload,
                            setup.threads)

    def run_hf() -> dict[str, Any]:
        return run_isolated(sides.hf_throughput, setup.model_dir, workload, setup.dtype,
                            setup.device, hf_batch_size or len(workload.prompts), setup.threads)

    def run_llamacpp() -> dict[str, Any]:
        import torch

        from lmkit.benchmarking.llamacpp import gguf_file
        from lmkit.benchmarking.llamacpp_batch import llamacpp_throughput

        return run_isolated(llamacpp_throughput, gguf_file(setup.model_dir), workload,
                            setup.threads or torch.get_num_threads())

    if peer == "llamacpp":
        from lmkit.benchmarking.llamacpp import gguf_file

        gguf_file(setup.model_dir)  # refuse a model without a GGUF before running lmkit
    runners = {"hf": run_hf, "llamacpp": run_llamacpp}
    return _paired("throughput", setup, workload, run_lmkit, runners.get(peer), rounds,
                   peer_name=peer)


def latency(setup: BenchSetup, workload: Workload, peer: str = "hf",
            rounds: int = 1) -> dict[str, Any]:
    """Single-stream decode: one request at a time, lmkit and the peer (``rounds`` times,
    see :func:`_paired`); the peer is ``hf``, ``llamacpp`` (the model's GGUF file through
    llama-cpp-python) or ``none``."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; choose {', '.join(PEERS)}")

    def run_lmkit() -> dict[str, Any]:
        return run_isolated(sides.lmkit_latency, setup.model_dir, setup.options, workload,
                            setup.threads)

    def run_hf() -> dict[str, Any]:
        return run_isolated(sides.hf_latency, setup.model_dir, workload, setup.dtype,
                            setup.device, setup.threads)

    def run_llamacpp() -> dict[str, Any]:
        from lmkit.benchmarking.llamacpp import gguf_file, llamacpp_latency

        gguf_file(setup.model_dir)  # refuse a model without a GGUF before running lmkit
        return run_isolated(llamacpp_latency, setup.model_dir, workload, setup.threads)

    if peer == "llamacpp":
        from lmkit.benchmarking.llamacpp import gguf_file

        gguf_file(setup.model_dir)
    runners = {"hf": run_hf, "llamacpp": run_llamacpp}
    return _paired("latency", setup, workload, run_lmkit, runners.get(peer), rounds,
                   peer_name=peer)


def _paired(bench: str, setup: BenchSetup, workload: Workload,
            run_lmkit: Callable[[], dict[str, Any]],
            run_peer: Callable[[], dict[str, Any]] | None, rounds: int,
            peer_name: str = "hf") -> dict[str, Any]:
    """Run both sides ``rounds`` times, alternating which goes first (lmkit first in
    round 1), so that a machine whose speed drifts (a shared host's memory bandwidth)
    weighs on both. Each round gives a ratio; the report's ratio is their median and
    each side's figures are those of the median round (all rounds are kept)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    report: dict[str, Any] = {"bench": bench, "workload": workload.describe(),
                              "machine": _machine(setup), "model": setup.model,
                              "peer": peer_name if run_peer is not None else None}
    results: list[dict[str, Any]] = []
    for i in range(rounds):
        order = ["lmkit", peer_name] if i % 2 == 0 else [peer_name, "lmkit"]
        entry: dict[str, Any] = {}
        for side in order:
            if side == "lmkit":
                entry["lmkit"] = _rates(run_lmkit(), workload)
            elif run_peer is not None:
                entry[peer_name] = _rates(run_peer(), workload)
        if peer_name in entry:
            entry["ratio_output_tokens_per_s"] = (entry["lmkit"]["output_tokens_per_s"]
                                                  / entry[peer_name]["output_tokens_per_s"])
        results.append(entry)
    key = "ratio_output_tokens_per_s" if run_peer is not None else None
    ranked = sorted(results, key=lambda e: e[key] if key else e["lmkit"]["output_tokens_per_s"])
    median = ranked[(len(ranked) - 1) // 2]
    report.update(median)
    if rounds > 1:
        report["rounds"] = results
        if key:
            report["ratio_per_round"] = [e[key] for e in results]
    return report


def _machine(setup: BenchSetup) -> dict[str, Any]:
    import os

    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                            "device": setup.device, "dtype": setup.dtype,
                            "threads": setup.threads}
    if setup.device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def format_report(report: dict[str, Any]) -> str:
    """A plain-text summary of a report."""
    lines = [f"{report['bench']} — {report['workload']}",
             f"model: {report['model']}  machine: {report['machine']}"]
    keys = ["elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
            "ttft_ms", "tpot_ms", "peak_rss_gb", "peak_cuda_gb", "num_preemptions",
            "spec_acceptance_rate", "spec_mean_accepted_length"]
    peer = report.get("peer") or "hf"
    for side in ("lmkit", peer):
        if side not in report:
            continue
        r = report[side]
        vals = "  ".join(f"{k}={r[k]:.3f}" if isinstance(r[k], float) else f"{k}={r[k]}"
                         for k in keys if k in r)
        lines.append(f"  {side:6s} {vals}")
    if "ratio_per_round" in report:
        rounds = ", ".join(f"{r:.2f}x" for r in report["ratio_per_round"])
        lines.append(f"  lmkit/{peer} output tokens/s: "
                     f"{report['ratio_output_tokens_per_s']:.2f}x (median of {len(report['ratio_per_round'])} rounds: {rounds}; the "
                     f"figures above are the median round's)")
    elif "ratio_output_tokens_per_s" in report:
        lines.append(f"  lmkit/{peer} output tokens/s: {report['ratio_output_tokens_per_s']:.2f}x")
    return "\n".join(lines)


def save_report(report: dict[str, Any], path: Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, default=str))
