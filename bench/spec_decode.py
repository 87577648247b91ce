"""Speculative decoding (``--speculative ngram``, or a draft head: ``--proposer eagle3
--speculative-model DIR``) against plain decoding, side by side.

For each workload and batch size, one process loads the same model twice, as a plain
engine and as one with the proposer (``ngram`` prompt lookup by default), and times the
same requests on each,
alternately, ``--repeats`` times (the first side alternates too), so both see the same
machine load; the medians are reported. Greedy, EOS ignored, every output length fixed
by the workload (``--stop-at-eos``: requests end at EOS instead, as a chat client's
do; a chat model's short answers otherwise go on past EOS into text its draft head
never saw). Per row: output tokens/s of both sides, the speedup (and each pair's),
the mean accepted length (tokens emitted per verification: 1 + accepted drafts), the
draft acceptance rate, whether the greedy outputs were identical (they must be; where not,
the first difference of each request with the plain side's margin there) and, on
CUDA, how many of the timed steps with drafts were replayed through the decode CUDA
graphs (``graph_verify_steps``, of ``engine_steps``; the rest ran eagerly), and the
Triton compiles during each timed run, per side (``jit_compiles_per_run``; the kernels in
``jit_compiled``: a compile in a timed run costs it up to a second); with a draft head
on CUDA, the verifications launched ahead (``spec_lookahead``: launched, used,
discarded, and used with the step after them queued on the device, ``stepped``); and
each engine's build time (``engine_build_s``: loading, memory profile, graph captures;
the second engine reuses what the first converted or compiled). ``--quantization``
(e.g. ``gguf``: a GGUF model's blocks kept packed on the CPU) applies to both targets;
a draft head stays dense.

Workloads: ``copy`` (repeat a passage of lmkit's own documentation exactly: prompt
lookup's best case) and ``chat`` (open-ended questions: little to look up, so this
measures the overhead when drafts are rare or wrong); ``random`` (128 random token ids
in, ``--chat-output-len`` out: for random-weight models, to time the drafting cost
when nearly every draft is rejected). Batch 1 runs the requests one at
a time (``max_num_seqs=1``); batch B submits B requests at once::

    python bench/spec_decode.py --device cpu --dtype float32 --threads 1 --out spec.json
    python bench/spec_decode.py --device cuda --dtype bfloat16 --batches 1 32 256
    python bench/spec_decode.py --proposer eagle3 --speculative-model ./head --workloads chat
    python bench/spec_decode.py --workloads chat --adaptive   # speculative.adaptive
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from lmkit.benchmarking.measure import run_isolated

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_run_watch import watch_jit_compiles  # noqa: E402
from lmkit.benchmarking.workload import Workload, chat_workload, copy_workload, random_workload


def paired_side(model: str, base_opts: dict[str, Any], spec_opts: dict[str, Any],
                workload: Workload, threads: int | None, repeats: int,
                stop_at_eos: bool = False) -> dict[str, Any]:
    """Both engines in one process, timed alternately ``repeats`` times each (which one
    goes first alternates too), so both sides see the same machine load."""
    import time

    import torch
    from lmkit import SamplingParams
    from lmkit.frontend.llm import LLM

    if threads:
        torch.set_num_threads(threads)
    engines, build_s = {}, {}
    for name, opts in (("plain", base_opts), ("spec", spec_opts)):
        t0 = time.perf_counter()
        engines[name] = LLM(model, **opts)  # loading, memory profile, graph captures
        build_s[name] = time.perf_counter() - t0
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=not stop_at_eos)
              for n in workload.output_lens]
    times: dict[str, list[float]] = {"plain": [], "spec": []}
    tokens: dict[str, list[list[int]]] = {}
    for llm in engines.values():
        llm.generate([workload.prompts[0][:32]] * 2, warm)
    compiles = watch_jit_compiles()  # (empty without Triton's compile hook)
    compiled: dict[str, list[str]] = {"plain": [], "spec": []}
    graphs = _graph_runner(engines["spec"])
    replays_before = graphs.num_flattened_replays if graphs is not None else 0
    before = engines["spec"].stats()
    ahead = _lookahead_stats(engines["spec"])
    for r in range(repeats):
        for name in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
            seen, t0 = len(compiles), time.perf_counter()
            outs = engines[name].generate(workload.prompts, params)
            times[name].append(time.perf_counter() - t0)
            compiled[name].append(compiles[seen:])
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    after = engines["spec"].stats()
    ahead = {k: v - ahead.get(k, 0) for k, v in _lookahead_stats(engines["spec"]).items()}
    graph_steps = graphs.num_flattened_replays - replays_before if graphs is not None else 0
    diverged = divergences(engines["plain"], workload.prompts, tokens["plain"], tokens["spec"])
    for llm in engines.values():
        llm.shutdown()
    spec = {k: after[k] - before.get(k, 0) for k in after
            if k.startswith("spec_num_") and isinstance(after[k], (int, float))}
    verifications = max(spec.get("spec_num_verifications", 0), 1)
    drafted = max(spec.get("spec_num_draft_tokens", 0), 1)
    produced = sum(map(len, tokens["plain"]))
    return {"output_tokens": produced,
            "plain_s": statistics.median(times["plain"]),
            "spec_s": statistics.median(times["spec"]),
            "pair_speedups": [b / s for b, s in zip(times["plain"], times["spec"],
                                                    strict=True)],
            "mean_accepted_length": 1 + spec.get("spec_num_accepted_tokens", 0) / verifications,
            "acceptance_rate": spec.get("spec_num_accepted_tokens", 0) / drafted,
            "acceptance_rate_per_position": [
                after[f"spec_acceptance_rate_pos_{j}"] for j in range(64)
                if f"spec_acceptance_rate_pos_{j}" in after],
            "outputs_identical": tokens["plain"] == tokens["spec"], "divergences": diverged,
            "jit_compiles_per_run": {k: [len(c) for c in v] for k, v in compiled.items()},
            "jit_compiled": {k: [e for c in v for e in c] for k, v in compiled.items()},
            "graph_verify_steps": graph_steps,
            "spec_lookahead": ahead, "engine_build_s": build_s,
            "engine_steps": after.get("num_steps", 0) - before.get("num_steps", 0)}


def divergences(plain: Any, prompts: list[list[int]], base: list[list[int]],
                spec: list[list[int]]) -> list[dict[str, Any]]:
    """Where the greedy outputs differ: per differing request, the first position that
    differs, and there the plain engine's own top two (one more untimed step with
    logprobs): its margin (top-1 minus top-2 logprob) and whether the speculative side
    took the runner-up. Small margins and runner-ups point to numerical near-ties
    (other kernels rounding the other way), a large margin to a wrong token."""
    from lmkit import SamplingParams

    found = []
    for i, (a, b) in enumerate(zip(base, spec, strict=True)):
        if a == b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if at is None:  # one stopped early (EOS): a prefix of the other
            found.append({"request": i, "at": min(len(a), len(b)), "margin": None,
                          "spec_took_runner_up": None})
            continue
        out = plain.generate([{"prompt_token_ids": prompts[i] + list(a[:at])}],
                             SamplingParams(temperature=0, max_tokens=1, logprobs=2))
        top = out[0].outputs[0].logprobs[0].top
        found.append({"request": i, "at": at, "margin": top[0][1] - top[1][1],
                      "spec_took_runner_up": b[at] == top[1][0]})
    return found


def _divergence_note(found: list[dict[str, Any]] | None) -> str:
    """``identical=NO``'s detail: how many requests differ, the largest margin at their
    first difference and how many there took the plain side's runner-up."""
    if not found:
        return ""
    margins = [d["margin"] for d in found if d["margin"] is not None]
    runner = sum(bool(d["spec_took_runner_up"]) for d in found)
    widest = f"{max(margins):.3f}" if margins else "n/a"
    return (f" ({len(found)} differ; at the first difference the plain side's top-2 margin "
            f"is at most {widest} nats, the runner-up taken in {runner} of {len(margins)})")


def _lookahead_stats(llm: Any) -> dict[str, int]:
    """The speculative engine's launched-ahead verifications so far (CUDA graphs, a draft
    head; ``lmkit.worker.spec_lookahead``): launched, used, discarded, and ``stepped``
    (used with the step after them queued on the device); empty without them."""
    ahead = getattr(_model_runner(llm), "spec_lookahead", None)
    return dict(vars(ahead.stats)) if ahead is not None else {}


def _model_runner(llm: Any) -> Any:
    """The engine's model runner (in-process executor), else None."""
    return getattr(getattr(llm.engine, "executor", None), "runner", None)


def _graph_runner(llm: Any) -> Any:
    """The engine's CUDA-graph runner (in-process executor on CUDA), else None."""
    runner = _model_runner(llm)
    return getattr(runner, "cuda_graphs", None)


def make(kind: str, tokenizer: Any, n: int, output_len: int, seed: int,
         texts: list[str] | None = None) -> Workload:
    if kind == "copy":
        return copy_workload(tokenizer, n, seed)
    if kind == "chat":
        return chat_workload(tokenizer, n, output_len, seed, texts)
    if kind == "random":  # random-weight models without a chat template
        return random_workload(n, (128, 128), (output_len, output_len), len(tokenizer), seed)
    raise SystemExit(f"unknown workload {kind!r}; choose copy, chat or random")


def run_row(args: argparse.Namespace, model_dir: str, kind: str, batch: int,
            tokenizer: Any) -> dict[str, Any]:
    n = args.batch1_prompts if batch == 1 else batch * args.waves
    wl = make(kind, tokenizer, n, args.chat_output_len, args.seed, args.prompt_texts)
    base_opts: dict[str, Any] = {"device": args.device, "dtype": args.dtype,
                                 "max_num_seqs": batch, "attention": args.attention}
    if args.device == "cuda":  # two engines share the GPU
        base_opts["gpu_memory_utilization"] = 0.4
    if args.quantization != "none":  # both engines (the head stays dense)
        base_opts["quantization"] = args.quantization
    if args.max_model_len:
        base_opts["max_model_len"] = args.max_model_len
    spec_opts = {**base_opts, "speculative": args.proposer,
                 "num_speculative_tokens": args.spec_tokens,
                 "speculative.disable_by_batch_size": args.disable_by_batch_size,
                 "speculative.adaptive": args.adaptive,
                 "speculative.catch_up_when_off": not args.no_catch_up}
    if args.proposer == "ngram":
        spec_opts["speculative.options"] = {"prompt_lookup_max": args.prompt_lookup_max,
                                            "prompt_lookup_min": args.prompt_lookup_min}
    else:  # a draft head
        spec_opts["speculative.model"] = args.speculative_model
    if args.spec_tree:  # a draft tree: k is its node count
        spec_opts["speculative.tree"] = args.spec_tree
        del spec_opts["num_speculative_tokens"]
    print(f"[{kind} batch {batch}] {wl.describe()}", file=sys.stderr, flush=True)
    r = run_isolated(paired_side, model_dir, base_opts, spec_opts, wl, args.threads,
                     args.repeats, args.stop_at_eos)
    row = {"workload": kind, "batch": batch, "num_requests": n, "proposer": args.proposer,
           **r, "base_tokens_per_s": r["output_tokens"] / r["plain_s"],
           "spec_tokens_per_s": r["output_tokens"] / r["spec_s"],
           "speedup": r["plain_s"] / r["spec_s"]}
    print(format_row(row), file=sys.stderr, flush=True)
    return row


def format_row(r: dict[str, Any]) -> str:
    pairs = ", ".join(f"{x:.2f}" for x in r["pair_speedups"])
    return (f"{r['workload']:5s} batch {r['batch']:4d}  plain {r['base_tokens_per_s']:8.1f} tok/s"
            f"  {r['proposer']} {r['spec_tokens_per_s']:8.1f} tok/s  speedup {r['speedup']:5.2f}x"
            f" (pairs: {pairs}; median {statistics.median(r['pair_speedups']):.2f}x)"
            f"  mean accepted length {r['mean_accepted_length']:4.2f}"
            f"  acceptance {r['acceptance_rate']:.2f}"
            f"  identical={'yes' if r['outputs_identical'] else 'NO'}"
            f"{_divergence_note(r.get('divergences'))}"
            f"  graph verify steps {r['graph_verify_steps']}/{r['engine_steps']}"
            f"  JIT compiles per timed run {r.get('jit_compiles_per_run')}"
            f"  launched ahead {r.get('spec_lookahead')}"
            f"  engine build s {_rounded(r.get('engine_build_s'))}")


def _rounded(seconds: dict[str, float] | None) -> dict[str, float] | None:
    """Each side's seconds to a tenth (reports from before the field: None)."""
    return None if seconds is None else {k: round(v, 1) for k, v in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: lmkit's default model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention", default="auto", help="attention backend of both engines")
    ap.add_argument("--quantization", default="none",
                    help="quantization method of both targets, e.g. gguf (GGUF blocks on the CPU)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="cap the context length of both engines (long-context configs on a "
                         "shared GPU)")
    ap.add_argument("--workloads", nargs="+", default=["copy", "chat"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--batch1-prompts", type=int, default=4,
                    help="requests run one at a time in the batch-1 rows")
    ap.add_argument("--waves", type=int, default=1, help="requests per batch slot (batch > 1)")
    ap.add_argument("--chat-output-len", type=int, default=128)
    ap.add_argument("--prompts", type=Path, default=None,
                    help="the chat workload's prompts from this JSONL file (one "
                    "{\"prompt\": ...} per line, e.g. held-out prompts of a draft head's "
                    "training set) instead of lmkit's built-in chat prompts")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="requests end at EOS (output lengths at most the workload's; both "
                         "sides stop alike, greedy); default: EOS ignored, fixed lengths")
    ap.add_argument("--proposer", default="ngram", help="ngram, eagle or eagle3")
    ap.add_argument("--speculative-model", default=None,
                    help="the draft head directory (eagle, eagle3)")
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--spec-tree", default=None,
                    help="a draft head's token tree as JSON rank paths (speculative.tree), "
                         "e.g. '[[0],[1],[0,0]]'; --spec-tokens is then its node count")
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=3)
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="speculative.disable_by_batch_size: no drafts above this batch")
    ap.add_argument("--no-catch-up", action="store_true",
                    help="speculative.catch_up_when_off false: with --disable-by-batch-size, "
                    "requests that run above the limit stop drafting and the head skips them")
    ap.add_argument("--adaptive", action="store_true",
                    help="speculative.adaptive: draft only while drafts measure faster")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs of each side, alternating (the median is reported)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args()
    if args.proposer != "ngram" and not args.speculative_model:
        ap.error(f"--proposer {args.proposer} needs --speculative-model DIR (its draft head)")
    if args.spec_tree:
        from lmkit.errors import ConfigError
        from lmkit.spec_decode.tree import DraftTree

        if args.proposer == "ngram":
            ap.error("--spec-tree needs a draft head (--proposer eagle or eagle3)")
        try:
            args.spec_tokens = DraftTree.parse(args.spec_tree).num_nodes
        except ConfigError as e:
            ap.error(f"--spec-tree: {e}")
    args.prompt_texts = None
    if args.prompts is not None:
        from lmkit_plugins.spec.train_eagle import load_prompts

        try:
            args.prompt_texts = load_prompts(args.prompts)
        except (OSError, ValueError) as e:
            ap.error(f"--prompts {args.prompts}: {e}")
        if not args.prompt_texts:
            ap.error(f"--prompts {args.prompts}: no prompts in the file")

    from lmkit.config import DEFAULT_MODEL
    from lmkit.loading.resolve import resolve_model
    from lmkit.loading.tokenizer import load_tokenizer
    from lmkit.plugin_host.manager import PluginHost

    model_dir = str(resolve_model(args.model or DEFAULT_MODEL, PluginHost.load()))
    tokenizer = load_tokenizer(Path(model_dir))
    rows = [run_row(args, model_dir, kind, batch, tokenizer)
            for kind in args.workloads for batch in args.batches]
    report = {"bench": "spec_decode", "model": args.model or DEFAULT_MODEL,
              "machine": {"platform": platform.platform(), "device": args.device,
                          "dtype": args.dtype, "threads": args.threads,
                          "attention": args.attention, "quantization": args.quantization},
              "proposer": args.proposer, "speculative_model": args.speculative_model,
              "spec_tokens": args.spec_tokens, "spec_tree": args.spec_tree,
              "stop_at_eos": args.stop_at_eos,
              "prompt_lookup_max": args.prompt_lookup_max,
              "prompt_lookup_min": args.prompt_lookup_min,
              "disable_by_batch_size": args.disable_by_batch_size,
              "adaptive": args.adaptive, "rows": rows}
    print("\n".join(format_row(r) for r in rows))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
