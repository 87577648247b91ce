"""Generation latency beside a stream of embedding requests, against generation alone,
on one offline engine (the default model, SmolLM2-135M, pooling its last token)::

    OMP_NUM_THREADS=2 python bench/mixed_pooling.py --streams 4 --tokens 64 --out mixed.json

Each run generates ``--streams`` greedy completions of ``--tokens`` tokens; in the mixed
run ``--embed-per-step`` embedding requests (seeded sentences) are queued before every
engine step, so pooling chunks share the steps with the decodes. Reported per run: the
median and p90 step time while generating (the inter-token latency of every stream),
end-to-end seconds, and the embeddings finished. Runs alternate (``--rounds``), so both
see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from embeddings import make_texts  # noqa: E402


def run(llm, prompts, tokens: int, embed_per_step: int, texts: list[str]) -> dict:
    from lmkit import SamplingParams
    from lmkit.api import PoolingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    rids = [llm._submit(p, None, params) for p in prompts]
    pending = set(rids)
    steps: list[float] = []
    next_text = 0
    start = time.perf_counter()
    while pending:
        for _ in range(embed_per_step):
            llm.pooling.submit(f"e{time.monotonic_ns()}-{next_text}",
                               texts[next_text % len(texts)], PoolingParams())
            next_text += 1
        t = time.perf_counter()
        for out in llm._step():
            if out.finished:
                pending.discard(out.request_id)
        steps.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    while llm.pooling.pending:  # let the last embeddings finish (not timed)
        llm._step()
    llm.pooling.results.clear()
    steps.sort()
    return {"median_step_ms": 1000 * statistics.median(steps),
            "p90_step_ms": 1000 * steps[int(0.9 * (len(steps) - 1))],
            "seconds": elapsed, "embeddings": next_text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--embed-per-step", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lmkit import LLM

    llm = LLM(args.model, progress=False, max_num_seqs=64)
    prompts = [f"Write a short story about {w}." for w in ("a fox", "the sea", "a robot",
                                                              "a city", "rain", "a clock")]
    prompts = (prompts * args.streams)[:args.streams]
    texts = make_texts(256)
    run(llm, prompts, 8, args.embed_per_step, texts)  # warm-up
    runs: dict[str, list[dict]] = {"alone": [], "mixed": []}
    for _ in range(args.rounds):
        runs["alone"].append(run(llm, prompts, args.tokens, 0, texts))
        runs["mixed"].append(run(llm, prompts, args.tokens, args.embed_per_step, texts))
    llm.shutdown()
    summary = {k: {"median_step_ms": statistics.median(r["median_step_ms"] for r in v),
                   "p90_step_ms": statistics.median(r["p90_step_ms"] for r in v),
                   "embeddings_per_s": statistics.median(r["embeddings"] / r["seconds"]
                                                         for r in v)}
               for k, v in runs.items()}
    result = {"model": args.model, "streams": args.streams, "tokens": args.tokens,
              "embed_per_step": args.embed_per_step, "threads": args.threads,
              "runs": runs, "summary": summary}
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
