"""vLLM's EAGLE-3 beside its own plain decoding, on the chat workload of
``bench/spec_decode.py`` and with the same head lmkit serves: the peer row of issue 17's
measurement (run it in the same lease as ``bench/eagle_gpu.sh bench``)::

    python bench/spec_vllm.py --model SmolLM2.gguf --speculative-model HEAD --out DIR

1. **Workload**: lmkit's built-in chat prompts through the model's chat template
   (:func:`lmkit.benchmarking.workload.chat_workload`, the seed and counts of
   ``bench/eagle_gpu.sh bench``: 8 prompts one at a time, 32 at once), as token ids, each
   request ending at the model's EOS ids or after ``--output-len`` tokens; greedy.
2. **Target**: the directory lmkit converts the GGUF into (``config.json``, float32
   safetensors, tokenizer files), so both engines load the same weights; vLLM casts them
   to bfloat16 as lmkit does.
3. **vLLM**, each side in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
   engine runs in that process), with its defaults (torch.compile, CUDA graphs, prefix
   caching): ``plain``, then ``eagle3`` with ``speculative_config={"method": "eagle3",
   "model": HEAD, "num_speculative_tokens": K}``. After a warm-up, ``--repeats`` timed
   runs of each row; the median is reported, with the mean accepted length and the
   per-position acceptance from vLLM's own counters (``LLM.get_metrics()``) and whether
   the speculative outputs equal the plain ones.

vLLM is not a dependency of lmkit: ``../shared/gpu/vllm_bundle.sh`` installs it offline
on the GPU machine (docs/gpu.md). The head must be an EAGLE-3 checkpoint in the layout
both engines read (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``/``t2d``, a
Llama ``config.json`` with ``draft_vocab_size`` and ``eagle_config``), as ``lmkit spec
train-eagle`` writes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SIDES = ("plain", "eagle3")
#: files of lmkit's converted directory that vLLM reads (not the GGUF lmkit keeps beside
#: them: a directory holding a .gguf could be taken for a GGUF model)
HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja")


def make_job(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Resolve the model with lmkit, write the workloads' token ids and EOS ids."""
    from lmkit.benchmarking.workload import chat_workload
    from lmkit.loading.model_facts import eos_token_ids_of
    from lmkit.loading.resolve import resolve_model
    from lmkit.loading.tokenizer import load_tokenizer
    from lmkit.plugin_host.manager import PluginHost
    from transformers import AutoConfig

    model_dir = Path(resolve_model(args.model, PluginHost.load()))
    hf_dir = out / "vllm_model"
    hf_dir.mkdir(parents=True, exist_ok=True)
    for name in HF_FILES:
        src, dst = model_dir / name, hf_dir / name
        if src.is_file() and not dst.exists():
            dst.symlink_to(src.resolve())
    tokenizer = load_tokenizer(model_dir)
    eos = list(eos_token_ids_of(model_dir, AutoConfig.from_pretrained(model_dir)))
    rows = []
    for batch in args.batches:
        n = args.batch1_prompts if batch == 1 else batch
        wl = chat_workload(tokenizer, n, args.output_len, args.seed)
        rows.append({"batch": batch, "prompts": wl.prompts, "output_lens": wl.output_lens})
    return {"model_dir": str(hf_dir), "head": str(Path(args.speculative_model).resolve()),
            "k": args.k, "eos": eos, "rows": rows, "repeats": args.repeats,
            "max_num_seqs": max(args.batches), "gpu_memory_utilization": args.gpu_memory}


def _spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's speculative counters so far: drafts, draft tokens, accepted tokens, and
    accepted tokens per draft position."""
    found: dict[str, Any] = {}
    for m in llm.get_metrics():
        for key in ("num_accepted_tokens_per_pos", "num_accepted_tokens", "num_draft_tokens",
                    "num_drafts"):
            if m.name.endswith("spec_decode_" + key):
                found[key] = list(m.values) if hasattr(m, "values") else m.value
                break
    return found


def vllm_side(side: str, job: dict[str, Any]) -> dict[str, Any]:
    """One vLLM engine (``side``: plain or eagle3) through every row of ``job``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import vllm
    from vllm import SamplingParams

    extra: dict[str, Any] = {}
    if side == "eagle3":
        extra["speculative_config"] = {"method": "eagle3", "model": job["head"],
                                       "num_speculative_tokens": job["k"]}
    t0 = time.perf_counter()
    llm = vllm.LLM(model=job["model_dir"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                   max_num_seqs=job["max_num_seqs"], max_model_len=4096,
                   gpu_memory_utilization=job["gpu_memory_utilization"],
                   disable_log_stats=False, **extra)
    info: dict[str, Any] = {"side": side, "vllm": vllm.__version__,
                            "gpu": torch.cuda.get_device_name(0),
                            "startup_s": time.perf_counter() - t0, "rows": []}

    def params(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=job["eos"],
                              detokenize=False)

    def run(row: dict[str, Any]) -> list[list[int]]:
        ps = [params(n) for n in row["output_lens"]]
        if row["batch"] == 1:  # one request at a time, as lmkit's batch-1 rows
            outs = [llm.generate([{"prompt_token_ids": p}], q, use_tqdm=False)[0]
                    for p, q in zip(row["prompts"], ps, strict=True)]
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in row["prompts"]], ps,
                                use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    warm = {"batch": 2, "prompts": [p[:32] for p in job["rows"][0]["prompts"][:2]],
            "output_lens": [8, 8]}
    run(warm)
    for row in job["rows"]:
        run(row)  # the row's own warm-up: graph sizes, prefix cache as the timed runs see it
        before = _spec_counters(llm)
        times, tokens = [], []
        for _ in range(job["repeats"]):
            t = time.perf_counter()
            tokens = run(row)
            times.append(time.perf_counter() - t)
        after = _spec_counters(llm)
        info["rows"].append({"batch": row["batch"], "times_s": times,
                             "median_s": statistics.median(times),
                             "output_tokens": sum(map(len, tokens)), "tokens": tokens,
                             "spec": _delta(before, after)})
    return info


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The timed runs' share of the counters, with the mean accepted length (1 + accepted
    per draft) and the acceptance rate per draft position."""
    if not after:
        return {}
    d = {k: (after[k] - before.get(k, 0) if not isinstance(after[k], list) else
             [a - b for a, b in zip(after[k], before.get(k) or [0] * len(after[k]),
                                    strict=True)])
         for k in after}
    drafts = max(d.get("num_drafts", 0), 1)
    d["mean_accepted_length"] = 1 + d.get("num_accepted_tokens", 0) / drafts
    d["acceptance_per_position"] = [a / drafts for a in d.get("num_accepted_tokens_per_pos", [])]
    return d


def report(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of plain vs eagle3: tokens per second, speedup, accepted length, identity."""
    out = []
    plain, spec = results.get("plain"), results.get("eagle3")
    if plain is None or spec is None:
        return out
    for p, s in zip(plain["rows"], spec["rows"], strict=True):
        row = {"batch": p["batch"], "plain_tok_s": p["output_tokens"] / p["median_s"],
               "eagle3_tok_s": s["output_tokens"] / s["median_s"],
               "speedup": p["median_s"] / s["median_s"] * s["output_tokens"] / p["output_tokens"],
               "mean_accepted_length": s["spec"].get("mean_accepted_length"),
               "acceptance_per_position": s["spec"].get("acceptance_per_position"),
               "outputs_identical": p["tokens"] == s["tokens"],
               "output_tokens": [p["output_tokens"], s["output_tokens"]]}
        out.append(row)
        print(f"vLLM batch {row['batch']:3d}: plain {row['plain_tok_s']:8.1f} tok/s  eagle3 "
              f"{row['eagle3_tok_s']:8.1f} tok/s  speedup {row['speedup']:.2f}x  accepted "
              f"{row['mean_accepted_length']:.2f}  per position "
              f"{[round(a, 3) for a in row['acceptance_per_position'] or []]}  identical="
              f"{'yes' if row['outputs_identical'] else 'NO'}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the target (GGUF, directory or alias)")
    ap.add_argument("--speculative-model", help="the EAGLE-3 head directory")
    ap.add_argument("--out", type=Path, default=Path("spec_vllm"))
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--batch1-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-memory", type=float, default=0.5,
                    help="vLLM's gpu_memory_utilization")
    ap.add_argument("--side-timeout", type=float, default=420.0)
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    job_path = args.out / "job.json"
    if args.side:  # a child: one engine
        result = vllm_side(args.side, json.loads(job_path.read_text()))
        (args.out / f"vllm_{args.side}.json").write_text(json.dumps(result))
        return
    if not args.model or not args.speculative_model:
        ap.error("--model and --speculative-model are required")
    if not Path(args.speculative_model, "config.json").is_file():
        ap.error(f"--speculative-model {args.speculative_model}: no config.json there")
    args.out.mkdir(parents=True, exist_ok=True)
    job_path.write_text(json.dumps(make_job(args, args.out)))
    results: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        cmd = [sys.executable, __file__, "--side", side, "--out", str(args.out)]
        print(f"[vllm {side}] starting", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, timeout=args.side_timeout)
        except subprocess.TimeoutExpired:
            print(f"[vllm {side}] timed out after {args.side_timeout:.0f} s", file=sys.stderr)
            continue
        path = args.out / f"vllm_{side}.json"
        if proc.returncode != 0 or not path.is_file():
            print(f"[vllm {side}] failed (exit {proc.returncode})", file=sys.stderr)
            continue
        results[side] = json.loads(path.read_text())
        print(f"[vllm {side}] started in {results[side]['startup_s']:.0f} s", file=sys.stderr)
    rows = report(results)
    summary = {"bench": "spec_vllm", "model": args.model, "head": args.speculative_model,
               "k": args.k, "rows": rows,
               "startup_s": {s: r["startup_s"] for s, r in results.items()}}
    (args.out / "spec_vllm.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
