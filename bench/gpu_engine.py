"""GPU engine benchmarks W1-W7: lmkit against vLLM and transformers' continuous batching,
in one run, and against the device's memory bandwidth.

* W1: Qwen3-0.6B shape; 256 sequences, prompt and output lengths uniform in
  [100, 1024], token ids uniform in [0, 10000), seed 0 (nano-vllm's benchmark).
* W2: Llama-3.1-8B shape; one 128-token prompt, 256 output tokens: ms per output token.
* W3: Llama-3.1-8B shape; 256 prompts of 512 tokens, 256 output tokens each.
* W4, W5: W3's and W2's requests on DeepSeek-V2-Lite's shape (MLA + MoE, 27 layers;
  ``--layers N`` keeps the first N, which the report states); lmkit's MLA backend by
  ``--attention`` (``mla_flashinfer``, ``mla_triton``, ``mla_torch``; ``auto`` picks).
* W6, W7: W2's and W3's requests on Llama-3.1-70B's shape (141 GB of bf16 weights: run
  lmkit with ``--tp 2`` or more and ``--load-format dummy``, which writes no weights).

Models are random bf16 weights of the real shapes (:mod:`gpu_bench_models`), written
once per run (to /dev/shm when it has room). Each side runs in its own process
(:mod:`gpu_bench_sides`, :mod:`gpu_bench_vllm`); EOS is ignored, sampling is greedy. The device's copy
bandwidth is measured first; every decode result is also reported as the bytes a
decode step must read (all weights + the cached K/V) over its wall time, as a fraction
of that bandwidth. The peer may run on the first N requests of W1/W3
(``--hf-subset W1=32,W3=64``), which the report says.

    python bench/gpu_engine.py --out gpu_engine.json                 # lmkit and HF
    python bench/gpu_engine.py --peer vllm,hf --out gpu_engine.json   # + vLLM (installed)
    python bench/gpu_engine.py --peer none --baseline-tree OLD       # lmkit now vs OLD checkout
    python bench/gpu_engine.py --peer none --workloads W2 --ab-env LMKIT_GEMV_FOLD=0  # A/B a switch
    python bench/gpu_engine.py --smoke --out /tmp/smoke.json      # CPU, toy sizes
    python bench/gpu_engine.py --workloads W4,W5 --layers 8 --attention mla_triton \
        --hf-subset W4=64 --out deepseek.json                      # DeepSeek-V2-Lite shape
    python bench/gpu_engine.py --workloads W2,W3 --peer none --quantization fp8 \
        --baseline-quantization none --out fp8.json                # FP8 weights vs bf16

With ``--quantization fp8`` lmkit quantizes the random bf16 weights to FP8 at load and
the bandwidth accounting counts what it reads (1 byte per projection weight plus its
per-row scale; embedding/LM head and norms bf16); ``--baseline-quantization`` runs
lmkit once more with other weights as the baseline columns (a vLLM peer gets
``quantization="fp8"`` too; transformers stays bf16). ``--kv-cache-dtype fp8`` runs
lmkit and vLLM over a float8 e4m3 KV cache (per-tensor scales 1.0 on both sides) and
counts its K/V reads at one byte per value::

    python bench/gpu_engine.py --workloads W1 --peer vllm --kv-cache-dtype fp8 --out w1_fp8.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_models as models  # noqa: E402
import gpu_bench_sides as sides  # noqa: E402
import gpu_workloads as wl  # noqa: E402
from gpu_args import (  # noqa: E402
    QUANTIZATIONS,
    engine_options,
    parse_env,
    parse_peers,
    parse_sets,
    quantization_options,
)
from gpu_report import combine, format_table  # noqa: E402
from gpu_run_profile import format_profiles  # noqa: E402


def copy_bandwidth(num_bytes: int = 2**30, iters: int = 20) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), or None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    bw = 2 * num_bytes * iters / (start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return bw


def run_side(side: str, job: dict[str, Any], workdir: Path, timeout: float,
             tree: Path | None = None) -> dict[str, Any]:
    """Run one side in a fresh Python process; its result dict (or the error). With
    ``tree``, the side is that checkout's lmkit (its own bench script and packages)."""
    job_file = workdir / f"job-{side}-{job['tag']}.json"
    result_file = workdir / f"result-{side}-{job['tag']}.json"
    job_file.write_text(json.dumps(job))
    script = tree / "bench" / "gpu_engine.py" if tree else Path(__file__)
    cmd = [sys.executable, str(script), "--side", side, "--job", str(job_file),
           "--result", str(result_file)]
    if tree:
        paths = [str(tree / d) for d in ("core", "plugins", "kernels")]
        job = {**job, "env": {**job.get("env", {}), "PYTHONPATH": os.pathsep.join(
            [*paths, os.environ.get("PYTHONPATH", "")])}}
    print(f"\n=== {side} {job['tag']}: {', '.join(w['name'] for w in job['workloads'])}",
          flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **job.get("env", {})}
    try:
        proc = subprocess.run(cmd, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not result_file.exists():
        if side == "lmkit" and "LMKIT_DECODE_LOOKAHEAD" not in job.get("env", {}):
            print("lmkit failed; once more without the decode lookahead", flush=True)
            retry = run_side(side, {**job, "env": {**job.get("env", {}),
                                                   "LMKIT_DECODE_LOOKAHEAD": "0"}}, workdir,
                             timeout, tree)
            retry["retried_without_lookahead_after"] = f"exit status {proc.returncode}"
            return retry
        return {"error": f"exit status {proc.returncode}"}
    result = json.loads(result_file.read_text())
    result["wall_s"] = time.perf_counter() - t0
    result["env"] = job.get("env", {})
    return result


def _side_main(side: str, job_file: Path, result_file: Path) -> None:
    job = json.loads(job_file.read_text())
    if side == "lmkit" and job["options"].get("data_parallel_size", 1) > 1:
        result = sides.lmkit_dp_side(job["model_dir"], job["options"], job["workloads"])
    elif side == "lmkit":
        result = sides.lmkit_side(job["model_dir"], job["options"], job["workloads"],
                                  job["facts"], job.get("profile_steps", 0),
                                  job.get("profile_run", False), job.get("repeats", 1))
    elif side == "vllm":
        import gpu_bench_vllm

        result = gpu_bench_vllm.vllm_side(job["model_dir"], job["options"], job["workloads"],
                                          job["facts"], job.get("profile_run", False),
                                          job.get("repeats", 1))
    elif job.get("hf_generate_batch"):
        result = sides.hf_generate_side(job["model_dir"], job["workloads"],
                                        job["hf_generate_batch"])
    else:
        result = sides.hf_side(job["model_dir"], job["workloads"], job.get("attn", "paged|sdpa"))
    result_file.write_text(json.dumps(result, indent=1, default=str))


def _tree_commit(tree: Path) -> str:
    """The commit checked out at ``tree``: git's answer, else a ``COMMIT`` file there (an
    exported tree), else the path."""
    if (tree / "COMMIT").is_file():
        return (tree / "COMMIT").read_text().strip()
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(tree)


def model_root(arg: str | None, need_bytes: int) -> Path:
    """Where to write the model directories: ``arg``, else /dev/shm with room, else /tmp."""
    if arg:
        return Path(arg)
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need_bytes * 1.2:
        return Path(tempfile.mkdtemp(prefix="lmkit-bench-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="lmkit-bench-"))


def _write(report: dict[str, Any], out: Path | None) -> None:
    """Save what has been measured so far (a later time limit keeps it)."""
    if out:
        out.write_text(json.dumps(report, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    ap.add_argument("--smoke", action="store_true", help="toy models and workloads (CPU ok)")
    ap.add_argument("--workloads", default="W1,W2,W3",
                    help="comma-separated, of W1-W7 (W4, W5: DeepSeek-V2-Lite shape; W6, W7: "
                    "Llama-3.1-70B shape)")
    ap.add_argument("--layers", type=int,
                    help="DeepSeek-V2-Lite (W4, W5) with only its first N decoder layers "
                    "(stated in the report; default: all 27)")
    ap.add_argument("--peer", default="hf",
                    help="comma-separated peers among vllm, hf; or none")
    ap.add_argument("--baseline-tree", type=Path,
                    help="also run this other lmkit checkout's engine (A/B of two commits)")
    ap.add_argument("--hf-subset", default="", help="e.g. W1=32,W3=64: peer runs the first N")
    ap.add_argument("--hf-batch", type=int, default=64,
                    help="W4/W5: transformers' generate runs static batches of this many "
                    "requests (its continuous batching cannot cache MLA)")
    ap.add_argument("--attention", default="auto",
                    help="lmkit attention backend, for every model of the run (an MLA one "
                    "such as mla_triton serves only W4/W5: run those apart from W1-W3)")
    ap.add_argument("--enforce-eager", action="store_true", help="lmkit without CUDA graphs")
    ap.add_argument("--executor", default="uniproc",
                    help="lmkit executor: uniproc (in process) or mp (a worker process)")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                    help="dummy: write only the models' configs, and every side draws random "
                    "weights itself (lmkit --load-format dummy, vLLM load_format='dummy'): "
                    "shapes too large to write, such as W6/W7's 70B")
    ap.add_argument("--tp", type=int, default=1,
                    help="lmkit's tensor-parallel size (the mp executor over NCCL when > 1; "
                    "the peers run on one GPU)")
    ap.add_argument("--dp", type=int, default=1,
                    help="lmkit's data-parallel size: that many engine processes, each on its "
                    "own device(s), behind one LLM (timed per workload, no step breakdown)")
    ap.add_argument("--model-root", help="where to write the random models (kept there, and "
                    "reused by a later run)")
    ap.add_argument("--skip-lmkit", action="store_true",
                    help="run only the peers and the baseline (a long run split over calls)")
    ap.add_argument("--side-timeout", type=float, default=900.0)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="then profile this many decode steps per workload (torch profiler)")
    ap.add_argument("--profile-run", action="store_true",
                    help="then run each workload once more whole under the profiler, on "
                    "lmkit's and vLLM's side (GPU busy/idle time, kernel time by kind, the "
                    "matrix products' TFLOP/s; bench/gpu_run_profile.py)")
    ap.add_argument("--lookahead-ab", action="store_true",
                    help="also run lmkit with the decode lookahead off (LMKIT_DECODE_LOOKAHEAD=0)")
    ap.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                    help="lmkit's (and vLLM's) weights: none (bf16) or fp8 (quantized at "
                    "load); fp8-lm-head: the LM head too (lmkit only)")
    ap.add_argument("--quantization-options", type=json.loads, default=None,
                    help="the method's options for lmkit's run, as JSON, e.g. "
                    "'{\"gemv_block_k\": 1024, \"gemv_num_warps\": 8}'")
    ap.add_argument("--baseline-quantization", choices=QUANTIZATIONS,
                    help="also run lmkit with these weights, reported as the baseline "
                    "(with --baseline-tree: that checkout's lmkit)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                    help="lmkit's and vLLM's KV cache: auto (bf16) or fp8 (float8 e4m3, "
                    "per-tensor scales 1.0 on both sides)")
    ap.add_argument("--ab-env", default="",
                    help="also run lmkit with these environment variables right after its "
                    "run on each model, e.g. LMKIT_GEMV_FOLD=0 (A/B of a kernel switch; "
                    "NAME=VALUE, comma-separated); reported as lmkit_ab")
    ap.add_argument("--ab-set", default="",
                    help="the same A/B run with these engine options changed, by dotted "
                    "path, values as JSON; ';'-separated, e.g. "
                    "'attention.options={\"decode_tiles\": [64, 8, 3]}' (with --ab-env: "
                    "both, in one run)")
    ap.add_argument("--sampling", type=json.loads, default=None,
                    help='sampling parameters for every request of both sides, as JSON, e.g. '
                    '\'{"temperature": 0.7, "repetition_penalty": 1.1}\' (default: greedy; '
                    'max_tokens and ignore_eos stay the workload\'s)')
    ap.add_argument("--repeats", type=int, default=1,
                    help="time each workload this many times on each side, in one process "
                    "(later runs on shifted token ids); rows show the median run, and "
                    "every run's figure is listed")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="run the first fraction of W1/W3's requests (quick runs)")
    ap.add_argument("--side", choices=("lmkit", "vllm", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:
        _side_main(args.side, args.job, args.result)
        return 0

    import torch

    peers = parse_peers(args.peer)
    ab_env = parse_env(args.ab_env)
    ab_set = parse_sets(args.ab_set)
    names = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    unknown = [n for n in names if n not in wl.WORKLOAD_MODELS]
    if unknown:
        ap.error(f"unknown workload {', '.join(unknown)}; choose from "
                 f"{', '.join(wl.WORKLOAD_MODELS)}")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be at least 1, got {args.layers}")
    all_workloads = wl.make_workloads(args.smoke)
    if args.scale < 1.0:
        for name in ("W1", "W3", "W4"):
            keep = max(1, int(len(all_workloads[name]["prompts"]) * args.scale))
            all_workloads[name] = wl.subset(all_workloads[name], keep)
    if args.sampling is not None:
        if not isinstance(args.sampling, dict) or {"max_tokens", "ignore_eos"} & set(args.sampling):
            ap.error("--sampling takes a JSON object of sampling parameters other than "
                     "max_tokens and ignore_eos")
        for workload in all_workloads.values():
            workload["sampling"] = args.sampling
        sides_file = (args.baseline_tree / "bench" / "gpu_bench_sides.py"
                      if args.baseline_tree else None)
        if sides_file is not None and '"sampling"' not in sides_file.read_text():
            ap.error(f"--baseline-tree {args.baseline_tree}: that checkout's bench runs its "
                     "own lmkit side and has no --sampling (it would decode greedily); "
                     "compare sampled runs with --ab-env / --ab-set, or drop --sampling")
    subsets = wl.parse_subsets(args.hf_subset)
    report: dict[str, Any] = {
        "bench": "gpu_engine", "smoke": args.smoke, "workloads": names,
        "platform": platform.platform(), "torch": torch.__version__,
        "workload_sizes": {n: all_workloads[n]["output_lens"] for n in names},
        "lmkit": {}, "hf": {}, "vllm": {}, "lmkit_baseline": {}, "hf_workloads": {},
        "quantization": args.quantization, "baseline_quantization": args.baseline_quantization,
        "kv_cache_dtype": args.kv_cache_dtype, "sampling": args.sampling}
    if args.baseline_tree:
        report["baseline_tree"] = _tree_commit(args.baseline_tree)
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name(0)
        report["copy_bandwidth_bytes_per_s"] = copy_bandwidth()
        if args.tp > 1:  # lmkit's decode reads its shards on tp devices at once (the
            # peers run on one: its bandwidth fraction is lmkit's only)
            report["copy_bandwidth_one_device_bytes_per_s"] = report[
                "copy_bandwidth_bytes_per_s"]
            report["copy_bandwidth_bytes_per_s"] *= args.tp
            report["gpu"] += f" x{args.tp} (the limit: {args.tp} devices' copy bandwidth)"
    # (report key, model written, its layers or None for all, workloads)
    plan = [(key, wl.SMOKE_MODELS[key] if args.smoke else key,
             args.layers if key == wl.DEEPSEEK else None,
             [n for n in names if wl.WORKLOAD_MODELS[n] == key])
            for key in (wl.SMALL, wl.LARGE, wl.DEEPSEEK, wl.HUGE)]
    need = sum(models.model_facts(models.hf_config(m, layers))["param_bytes"]
               for _, m, layers, w in plan if w)
    root = model_root(args.model_root, need)
    options = engine_options(args)
    ab_jobs: list[tuple[str, dict[str, Any]]] = []
    try:
        for key, model_name, layers, wl_names in plan:
            if not wl_names:
                continue
            t0 = time.perf_counter()
            model_dir = models.write_model(model_name, root / model_name, num_layers=layers,
                                           weights=args.load_format != "dummy")
            facts = models.model_facts(models.hf_config(model_name, layers), args.quantization,
                                       args.kv_cache_dtype)
            report.setdefault("models", {})[key] = {"name": model_name, **facts,
                                                    "write_s": time.perf_counter() - t0}
            if layers is not None:
                report["models"][key]["of_layers"] = models.hf_config(
                    model_name).num_hidden_layers
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            wls = [all_workloads[n] for n in wl_names]
            job = {"tag": key, "model_dir": str(model_dir), "options": options,
                   "workloads": wls, "facts": facts, "profile_steps": args.profile_steps,
                   "profile_run": args.profile_run, "repeats": args.repeats}
            if not args.skip_lmkit:
                report["lmkit"][key] = run_side("lmkit", job, root, args.side_timeout)
                if ab_env or ab_set:
                    ab_job = {**job, "tag": key + "-ab", "env": ab_env,
                              "options": {**options, **ab_set}}
                    ab = run_side("lmkit", ab_job, root, args.side_timeout)
                    report.setdefault("lmkit_ab", {})[key] = {"env": ab_env, "set": ab_set,
                                                              **ab}
            if args.baseline_tree or args.baseline_quantization:
                base_q = args.baseline_quantization or args.quantization
                base_job = {**job, "tag": key + "-base", "profile_steps": 0,
                            "profile_run": False,
                            "options": {**{k: v for k, v in options.items()
                                           if k != "quantization.options"},
                                        **quantization_options(base_q)},
                            "facts": models.model_facts(models.hf_config(model_name, layers),
                                                        base_q, args.kv_cache_dtype)}
                report["lmkit_baseline"][key] = run_side("lmkit", base_job, root,
                                                         args.side_timeout, args.baseline_tree)
            if "vllm" in peers:
                report["vllm"][key] = run_side("vllm", job, root, args.side_timeout)
            if args.lookahead_ab:  # run last, so that a time limit cuts only these
                ab_jobs.append((key, {**job, "tag": key + "-nola", "profile_steps": 0,
                                      "profile_run": False,
                                      "env": {"LMKIT_DECODE_LOOKAHEAD": "0"}}))
            if "hf" in peers:
                hf_wls = [wl.subset(w, subsets.get(w["name"])) for w in wls]
                for w in hf_wls:
                    report["hf_workloads"][w["name"]] = w
                hf_job = {**job, "workloads": hf_wls}
                if key == wl.DEEPSEEK:  # MLA: transformers' CB cache cannot hold it
                    hf_job["hf_generate_batch"] = args.hf_batch
                report["hf"][key] = run_side("hf", hf_job, root, args.side_timeout)
            _write(report, args.out)
            if not args.lookahead_ab and not args.model_root:
                shutil.rmtree(model_dir, ignore_errors=True)
        for key, job in ab_jobs:
            report.setdefault("lmkit_no_lookahead", {})[key] = run_side(
                "lmkit", job, root, args.side_timeout)
            _write(report, args.out)
    finally:
        if not args.model_root:
            shutil.rmtree(root, ignore_errors=True)
    report["rows"] = combine(report, wl.WORKLOAD_MODELS)
    report["hf_workloads"] = {k: {"requests": len(v["prompts"]), "subset_of": v.get("subset_of")}
                              for k, v in report["hf_workloads"].items()}
    report["workload_sizes"] = {k: v for k, v in report["workload_sizes"].items()}
    text = format_table(report)
    if profiles := format_profiles(report):
        text += "\n\n" + profiles
    print("\n" + text, flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
