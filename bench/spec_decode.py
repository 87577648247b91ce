"""Speculative decoding (``--spec ngram``) against plain decoding, side by side.

For each workload and batch size, the same engine runs the same requests twice, each
side in its own process one after the other (same machine, same load): without
speculation, then with ``ngram`` prompt lookup. Greedy, EOS ignored, every output length
fixed by the workload. Reported per row: output tokens/s of both sides, the speedup,
the mean accepted length (tokens emitted per verification: 1 + accepted drafts) and
the draft acceptance rate; the two sides' outputs are also compared (greedy outputs
must be identical).

Workloads: ``copy`` (repeat a passage of lmkit's own documentation exactly: prompt
lookup's best case) and ``chat`` (open-ended questions: little to look up, so this
measures the overhead when drafts are rare or wrong). Batch 1 runs the requests one at
a time (``max_num_seqs=1``); batch B submits B requests at once::

    python bench/spec_decode.py --device cpu --dtype float32 --threads 2 --out spec.json
    python bench/spec_decode.py --device cuda --dtype bfloat16 --batches 1 32 256
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

from lmkit.bench import sides
from lmkit.bench.measure import run_isolated
from lmkit.bench.workload import Workload, chat_workload, copy_workload


def outputs_side(model: str, options: dict[str, Any], workload: Workload,
                 threads: int | None) -> dict[str, Any]:
    """:func:`lmkit.bench.sides.lmkit_throughput` plus the output token ids (to compare)."""
    import torch
    from lmkit import SamplingParams
    from lmkit.entrypoints.llm import LLM

    result = sides.lmkit_throughput(model, options, workload, threads)
    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model, **options)  # again, untimed: the outputs for the identity check
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    result["token_ids"] = [o.outputs[0].token_ids for o in llm.generate(workload.prompts,
                                                                       params)]
    llm.shutdown()
    return result


def make(kind: str, tokenizer: Any, n: int, output_len: int, seed: int) -> Workload:
    if kind == "copy":
        return copy_workload(tokenizer, n, seed)
    if kind == "chat":
        return chat_workload(tokenizer, n, output_len, seed)
    raise SystemExit(f"unknown workload {kind!r}; choose copy or chat")


def run_row(args: argparse.Namespace, model_dir: str, kind: str, batch: int,
            tokenizer: Any) -> dict[str, Any]:
    n = args.batch1_prompts if batch == 1 else batch * args.waves
    wl = make(kind, tokenizer, n, args.chat_output_len, args.seed)
    base_opts: dict[str, Any] = {"device": args.device, "dtype": args.dtype,
                                 "max_num_seqs": batch}
    spec_opts = {**base_opts, "speculative": "ngram",
                 "num_speculative_tokens": args.spec_tokens,
                 "speculative.options": {"prompt_lookup_max": args.prompt_lookup_max,
                                         "prompt_lookup_min": args.prompt_lookup_min}}
    print(f"[{kind} batch {batch}] {wl.describe()}", file=sys.stderr, flush=True)
    fn = outputs_side if args.check_outputs else sides.lmkit_throughput
    base = run_isolated(fn, model_dir, base_opts, wl, args.threads)
    spec = run_isolated(fn, model_dir, spec_opts, wl, args.threads)
    row = {"workload": kind, "batch": batch, "num_requests": n,
           "output_tokens": wl.num_output_tokens,
           "base_tokens_per_s": base["output_tokens"] / base["elapsed_s"],
           "spec_tokens_per_s": spec["output_tokens"] / spec["elapsed_s"],
           "base_elapsed_s": base["elapsed_s"], "spec_elapsed_s": spec["elapsed_s"],
           "mean_accepted_length": spec.get("spec_mean_accepted_length", 0.0),
           "acceptance_rate": spec.get("spec_acceptance_rate", 0.0),
           "acceptance_rate_per_position": [
               spec[f"spec_acceptance_rate_pos_{j}"] for j in range(args.spec_tokens)
               if f"spec_acceptance_rate_pos_{j}" in spec]}
    row["speedup"] = row["spec_tokens_per_s"] / row["base_tokens_per_s"]
    if args.check_outputs:
        row["outputs_identical"] = base["token_ids"] == spec["token_ids"]
    print(format_row(row), file=sys.stderr, flush=True)
    return row


def format_row(r: dict[str, Any]) -> str:
    same = "" if "outputs_identical" not in r else \
        f"  identical={'yes' if r['outputs_identical'] else 'NO'}"
    return (f"{r['workload']:5s} batch {r['batch']:4d}  plain {r['base_tokens_per_s']:8.1f} tok/s"
            f"  ngram {r['spec_tokens_per_s']:8.1f} tok/s  speedup {r['speedup']:5.2f}x"
            f"  mean accepted length {r['mean_accepted_length']:4.2f}"
            f"  acceptance {r['acceptance_rate']:.2f}{same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: lmkit's default model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--workloads", nargs="+", default=["copy", "chat"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--batch1-prompts", type=int, default=4,
                    help="requests run one at a time in the batch-1 rows")
    ap.add_argument("--waves", type=int, default=1, help="requests per batch slot (batch > 1)")
    ap.add_argument("--chat-output-len", type=int, default=128)
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check-outputs", dest="check_outputs", action="store_false",
                    help="skip the second, untimed run that compares greedy outputs")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args()

    from lmkit.config import DEFAULT_MODEL
    from lmkit.loading.resolve import resolve_model
    from lmkit.loading.tokenizer import load_tokenizer
    from lmkit.plugins.manager import PluginHost

    model_dir = str(resolve_model(args.model or DEFAULT_MODEL, PluginHost.load()))
    tokenizer = load_tokenizer(Path(model_dir))
    rows = [run_row(args, model_dir, kind, batch, tokenizer)
            for kind in args.workloads for batch in args.batches]
    report = {"bench": "spec_decode", "model": args.model or DEFAULT_MODEL,
              "machine": {"platform": platform.platform(), "device": args.device,
                          "dtype": args.dtype, "threads": args.threads},
              "spec_tokens": args.spec_tokens, "prompt_lookup_max": args.prompt_lookup_max,
              "prompt_lookup_min": args.prompt_lookup_min, "rows": rows}
    print("\n".join(format_row(r) for r in rows))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
