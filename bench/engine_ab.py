"""One engine setting A/B, end to end: two engines of the same model in one process,
B built with environment switches and/or settings that A lacks, timed in alternating
rounds on the same requests (A, B, A, B, ...), each round the whole workload.

For a switch whose effect is a fraction of a step (a fused kernel, a launch option),
separate runs in separate calls disagree by more than the effect: the machine's speed
moves between calls, and a profiled run's wall time moves with the profiler. Here both
engines are warm and interleaved, and their greedy outputs are compared::

    python bench/engine_ab.py --model smol.gguf --b-env LMKIT_GLU_EPILOGUE=0
    python bench/engine_ab.py --model smol.gguf --speculative eagle3 \\
        --speculative-model HEAD --batch 32 --b-set speculative.device_step_max_requests=8
    python bench/engine_ab.py --model smol.gguf --speculative eagle3 --speculative-model HEAD \
        --batch 32 --set speculative.disable_by_batch_size=16 --b-env LMKIT_LAUNCH_CATCH_UP=0

``--set`` applies to both engines.

The workload is the built-in chat prompts through the model's chat template (as text
for a model without one),
``--requests`` of them, ``--batch`` at a time (1: one by one), up to ``--output-len``
tokens each (``--ignore-eos``: exactly that many). Reports each side's tok/s per round,
the medians, B / A, and whether the outputs were identical. Needs CUDA unless
``--device cpu``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from gpu_args import env_during, parse_env, parse_sets  # noqa: E402
from spec_pair import chat_prompts  # noqa: E402


def build(args: argparse.Namespace, model: str, env: dict[str, str], sets: dict[str, Any]):
    """An engine with ``env`` set while it is built and ``sets`` applied."""
    from lmkit import LLM

    kw: dict[str, Any] = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
                              **sets)
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    if args.device == "cuda":
        kw.update(attention=args.attention, gpu_memory_utilization=args.memory_fraction)
    if args.speculative:
        kw.update(speculative=args.speculative, num_speculative_tokens=args.k)
        if args.speculative_model:
            kw["speculative_model"] = args.speculative_model
    with env_during(env):
        return LLM(model, **kw)


def workload(tokenizer: Any, n: int, output_len: int) -> list:
    """``n`` built-in chat prompts, through the chat template (as text, cycled, for a
    model without one)."""
    if getattr(tokenizer, "chat_template", None):
        return chat_prompts(tokenizer, n, output_len)
    from lmkit.api import CHAT_PROMPTS

    return [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(n)]


def timed_round(llm: Any, prompts: list, params: Any, batch: int) -> tuple[float, list]:
    """``(tok/s, token ids per request)`` of one pass over ``prompts``."""
    outs: list = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], params)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--b-env", default="", help="NAME=VALUE[,...] set while B is built")
    ap.add_argument("--b-set", action="append", default=[], metavar="PATH=VALUE",
                    help="a setting of B (value read as JSON)")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                    help="a setting of both engines (value read as JSON); B's own win")
    ap.add_argument("--speculative", help="a proposer for both engines (default: none)")
    ap.add_argument("--speculative-model")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--max-model-len", type=int, help="default: the model's context")
    ap.add_argument("--memory-fraction", type=float, default=0.3,
                    help="GPU memory each engine may take")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    for name in ("batch", "requests", "output_len", "rounds", "k"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    env_b = parse_env(args.b_env, "--b-env")
    sets_b = parse_sets(";".join(args.b_set), "--b-set")
    sets = parse_sets(";".join(args.set), "--set")
    if not env_b and not sets_b:
        ap.error("give B something A lacks: --b-env NAME=VALUE or --b-set PATH=VALUE")
    from lmkit import SamplingParams
    from lmkit.loading.resolve import resolve_model
    from lmkit.plugin_host.manager import PluginHost

    model = str(resolve_model(args.model, PluginHost.load()))  # a GGUF converted once
    engines = {"A": build(args, model, {}, sets), "B": build(args, model, env_b, sets | sets_b)}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                            ignore_eos=args.ignore_eos)
    prompts = workload(engines["A"].tokenizer, args.requests, args.output_len)
    for llm in engines.values():  # warm: every batch shape of the workload once
        timed_round(llm, prompts[:args.batch], params, args.batch)
    rates: dict[str, list[float]] = {"A": [], "B": []}
    outputs: dict[str, list] = {}
    for r in range(args.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            rate, tokens = timed_round(engines[side], prompts, params, args.batch)
            rates[side].append(rate)
            outputs.setdefault(side, tokens)
    for llm in engines.values():
        llm.shutdown()
    med = {side: statistics.median(v) for side, v in rates.items()}
    report = {"model": args.model, "b_env": env_b, "b_set": sets_b, "set": sets,
              "batch": args.batch,
              "requests": args.requests, "speculative": args.speculative,
              "tok_per_s": rates, "median": med, "b_over_a": med["B"] / med["A"],
              "identical": outputs["A"] == outputs["B"]}
    print(f"A {med['A']:.1f} tok/s ({', '.join(f'{x:.0f}' for x in rates['A'])})  "
          f"B {med['B']:.1f} tok/s ({', '.join(f'{x:.0f}' for x in rates['B'])})  "
          f"B/A {report['b_over_a']:.3f}  identical={'yes' if report['identical'] else 'NO'}"
          f"  [B: {args.b_env or ''}{' '.join(args.b_set)}]")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
