"""``lmkit bench throughput`` and ``lmkit bench latency``: lmkit and a peer on the same
workload in one run, each in its own process; results as a table and JSON."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmkit.bench import sides
from lmkit.bench.measure import run_isolated
from lmkit.bench.workload import (
    Workload,
    chat_workload,
    copy_workload,
    file_workload,
    random_workload,
)

PEERS = ("hf", "none")


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
               hf_batch_size: int | None = None) -> dict[str, Any]:
    """Run lmkit then the peer on ``workload``; return both results and their ratio."""
    report: dict[str, Any] = {"bench": "throughput", "workload": workload.describe(),
                              "machine": _machine(setup), "model": setup.model}
    report["lmkit"] = _rates(run_isolated(
        sides.lmkit_throughput, setup.model_dir, setup.options, workload, setup.threads),
        workload)
    if peer == "hf":
        report["hf"] = _rates(run_isolated(
            sides.hf_throughput, setup.model_dir, workload, setup.dtype, setup.device,
            hf_batch_size or len(workload.prompts), setup.threads), workload)
        report["ratio_output_tokens_per_s"] = (report["lmkit"]["output_tokens_per_s"]
                                              / report["hf"]["output_tokens_per_s"])
    return report


def latency(setup: BenchSetup, workload: Workload, peer: str = "hf") -> dict[str, Any]:
    """Single-stream decode: one request at a time, lmkit then the peer."""
    report: dict[str, Any] = {"bench": "latency", "workload": workload.describe(),
                              "machine": _machine(setup), "model": setup.model}
    report["lmkit"] = _rates(run_isolated(
        sides.lmkit_latency, setup.model_dir, setup.options, workload, setup.threads), workload)
    if peer == "hf":
        report["hf"] = _rates(run_isolated(
            sides.hf_latency, setup.model_dir, workload, setup.dtype, setup.device,
            setup.threads), workload)
        report["ratio_output_tokens_per_s"] = (report["lmkit"]["output_tokens_per_s"]
                                              / report["hf"]["output_tokens_per_s"])
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
    for side in ("lmkit", "hf"):
        if side not in report:
            continue
        r = report[side]
        vals = "  ".join(f"{k}={r[k]:.3f}" if isinstance(r[k], float) else f"{k}={r[k]}"
                         for k in keys if k in r)
        lines.append(f"  {side:6s} {vals}")
    if "ratio_output_tokens_per_s" in report:
        lines.append(f"  lmkit/hf output tokens/s: {report['ratio_output_tokens_per_s']:.2f}x")
    return "\n".join(lines)


def save_report(report: dict[str, Any], path: Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, default=str))
