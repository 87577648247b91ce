"""Where a speculative step's host time goes: ``cProfile`` of the engine loop, with a
draft head and without, on a random SmolLM2-135M-shaped target and a random EAGLE-3
head (the pair of ``bench/draft_chain.py``; drafts are never accepted, so every step has
the same shape). Only the timed ``generate`` calls are profiled (one request at a time
at ``--batch 1``, else ``--batch`` at once); each engine's table goes to
``OUT/prof_<side>.txt`` (by own time, then by cumulative time) and a line per engine
to stdout::

    python bench/spec_host_profile.py --out prof --k 3 --batch 1
    python bench/spec_host_profile.py --out prof --model smol.gguf --speculative-model HEAD
    python bench/spec_host_profile.py --out prof --model smol.gguf --proposer ngram --batch 32

(``--model`` with ``--speculative-model``: that target and head on the built-in chat
prompts instead, answers ending at EOS, so drafts are accepted as in serving;
``--proposer ngram``: prompt lookup instead of a head.)

Needs CUDA (a host profile of graph replays; on the CPU the model's compute dominates).
``cProfile`` slows Python down, so the steps' times printed are inflated; compare the
sides with each other, not with an unprofiled run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path


def profile_side(llm, prompts: list, params, batch: int, out: Path, name: str) -> str:
    """Profile ``llm`` over ``prompts`` (warm); write its tables; return its line."""
    llm.generate(prompts[:2], params)  # warm-up
    steps0 = llm.stats().get("num_steps", 0)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    if batch == 1:
        outs = [o for prompt in prompts for o in llm.generate([prompt], params)]
    else:
        outs = llm.generate(prompts, params)
    prof.disable()
    seconds = time.perf_counter() - start
    steps = llm.stats().get("num_steps", 0) - steps0
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(50)
    stats.sort_stats("cumulative").print_stats(80)
    (out / f"prof_{name}.txt").write_text(text.getvalue())
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return (f"{name}: {steps} steps, {1e3 * seconds / max(steps, 1):.3f} ms per step and "
            f"{1e3 * seconds / tokens:.3f} ms per token under cProfile")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the tables")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step")
    ap.add_argument("--tree", help="a draft tree as JSON rank paths (speculative.tree, "
                    "e.g. '[[0],[1],[0,0]]'; eagle3 only): --k is then its node count")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--requests", type=int, default=4, help="requests per side (batch 1)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--model", help="target (default: a random SmolLM2-shaped model)")
    ap.add_argument("--speculative-model", help="its EAGLE-3 head (with --model)")
    ap.add_argument("--proposer", choices=("eagle3", "ngram"), default="eagle3")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="with --model: every answer runs --output-len (a constant batch)")
    args = ap.parse_args(argv)
    if args.proposer == "eagle3" and bool(args.model) != bool(args.speculative_model):
        ap.error("--model and --speculative-model go together")
    if args.proposer == "ngram" and args.speculative_model:
        ap.error("--proposer ngram takes no --speculative-model")
    tree = None
    if args.tree:
        if args.proposer != "eagle3":
            ap.error("--tree needs --proposer eagle3 (trees are drafted by a head)")
        try:
            tree = json.loads(args.tree)
        except json.JSONDecodeError as exc:
            ap.error(f"--tree is not JSON rank paths: {exc}")

    import torch
    if not torch.cuda.is_available():
        print("spec_host_profile needs a CUDA device", file=sys.stderr)
        return 2
    from lmkit import LLM, SamplingParams
    from spec_pair import chat_prompts, pair_and_prompts

    args.out.mkdir(parents=True, exist_ok=True)
    n = args.requests if args.batch == 1 else args.batch
    target, head, prompts = pair_and_prompts(args.model, args.speculative_model, n)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                            ignore_eos=args.ignore_eos or not args.model)
    spec = (dict(speculative="eagle3", speculative_model=head) if args.proposer == "eagle3"
            else dict(speculative="ngram"))
    drafts = {"num_speculative_tokens": args.k} if tree is None else {
        "num_speculative_tokens": len(tree), "speculative_tree": tree}
    sides = {"spec": {**spec, **drafts}, "plain": {}}
    for name, options in sides.items():
        llm = LLM(target, device="cuda", attention=args.attention, dtype="bfloat16",
                  max_num_seqs=max(args.batch, 2), max_model_len=2048,
                  gpu_memory_utilization=0.3, **options)
        if prompts is None:
            prompts = chat_prompts(llm.tokenizer, n, args.output_len)
        try:
            print(profile_side(llm, prompts, params, args.batch, args.out, name), flush=True)
        finally:
            llm.shutdown()
    print(f"tables in {args.out}/prof_spec.txt and prof_plain.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
