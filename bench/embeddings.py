"""Embedding throughput on the CPU: lmkit's ``LLM.embed`` against sentence-transformers
on all-MiniLM-L6-v2, batches of 64 texts, in one process with interleaved rounds (so
that every side sees the same machine load), plus a check that the vectors agree::

    OMP_NUM_THREADS=2 python bench/embeddings.py --texts 512 --rounds 5 --out emb.json

Texts are seeded random sentences of 6 to 40 words. Every side uses the same number of
torch threads (``--threads``). Each of ``--dtypes`` (default float32 and bfloat16) runs
on both sides: lmkit with ``dtype=...``, sentence-transformers in float32 (its default)
or after ``model.to(torch.bfloat16)``. Reported: texts/s per round and the median of
each side; the ratios at equal precision (lmkit / sentence-transformers in the same
dtype; of the medians, and round by round) and lmkit's default (``dtype=auto``,
whatever it resolves to here) against sentence-transformers' default (float32),
labelled with both precisions; and per side the smallest cosine, over the texts, to
sentence-transformers' float32 vectors.

``--clock cpu`` times each round by the process's CPU time instead of the wall clock:
on a machine shared with other jobs, time spent waiting for a core then does not count
(cache and memory-bandwidth contention still do).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

import numpy as np
import torch

WORDS = ("the a model engine token vector fast slow river mountain city paris berlin data "
         "learns attention layer quickly under over music green blue embedding search query "
         "document ranking answer question people write read computer science history art "
         "small large bright dark ancient modern running jumps carefully every never always").split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` seeded random sentences of 6 to 40 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))).capitalize() + "."
            for _ in range(n)]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-minilm-l6-v2", help="lmkit model reference")
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated dtypes each side runs in")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="time rounds by the wall clock or by this process's CPU time")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)

    from lmkit import LLM
    from sentence_transformers import SentenceTransformer

    texts = make_texts(args.texts)
    dtypes = args.dtypes.split(",")
    engines = {d: LLM(args.model, progress=False, dtype=d, max_num_seqs=args.batch_size,
                      max_num_batched_tokens=max(8192, 64 * args.batch_size))
               for d in dict.fromkeys([*dtypes, "auto"])}
    auto = engines["auto"].engine.stack.dtype  # what lmkit's default means on this machine
    if auto in engines:
        engines.pop("auto").shutdown()
    else:
        engines[auto] = engines.pop("auto")
    model_dir = str(next(iter(engines.values())).engine.model_dir)
    st: dict[str, SentenceTransformer] = {}
    for d in dict.fromkeys(["float32", *dtypes]):
        st[d] = SentenceTransformer(model_dir, device="cpu")
        st[d].to(getattr(torch, d))

    def run_lmkit(llm: LLM) -> np.ndarray:
        out = []
        for i in range(0, len(texts), args.batch_size):
            out += [o.embedding for o in llm.embed(texts[i:i + args.batch_size])]
        return np.asarray(out, dtype=np.float32)

    def run_st(model: SentenceTransformer) -> np.ndarray:
        emb = model.encode(texts, batch_size=args.batch_size, normalize_embeddings=True,
                           convert_to_tensor=True)
        return emb.float().numpy()

    sides = {f"lmkit_{d}": (lambda m=llm: run_lmkit(m)) for d, llm in engines.items()}
    sides |= {f"sentence_transformers_{d}": (lambda m=m: run_st(m)) for d, m in st.items()}
    vectors = {name: fn() for name, fn in sides.items()}  # warm-up, and the agreement check
    ref = vectors["sentence_transformers_float32"]
    min_cos = {name: float(((v * ref).sum(1) / np.linalg.norm(v, axis=1)
                            / np.linalg.norm(ref, axis=1)).min()) for name, v in vectors.items()}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            start = clock()
            fn()
            rates[name].append(len(texts) / (clock() - start))
    for llm in engines.values():
        llm.shutdown()
    medians = {k: statistics.median(v) for k, v in rates.items()}
    ratios = {f"equal_precision_{d}": medians[f"lmkit_{d}"]
              / medians[f"sentence_transformers_{d}"] for d in dtypes}
    ratios[f"defaults_lmkit_auto={auto}_vs_sentence_transformers_float32"] = (
        medians[f"lmkit_{auto}"] / medians["sentence_transformers_float32"])
    # the same ratios round by round (every side runs once per round, so a load change
    # between rounds cancels): median, min and max over the rounds
    pairs = {f"equal_precision_{d}": (f"lmkit_{d}", f"sentence_transformers_{d}")
             for d in dtypes}
    pairs[f"defaults_lmkit_auto={auto}_vs_sentence_transformers_float32"] = (
        f"lmkit_{auto}", "sentence_transformers_float32")
    paired = {}
    for key, (a, b) in pairs.items():
        per_round = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
        paired[key] = {"median": statistics.median(per_round), "min": min(per_round),
                       "max": max(per_round)}
    result = {
        "model": args.model, "texts": len(texts), "batch_size": args.batch_size,
        "threads": args.threads, "rounds": args.rounds, "clock": args.clock,
        "lmkit_auto_dtype": auto,
        "texts_per_s": rates, "median_texts_per_s": medians,
        "spread_texts_per_s": {k: [min(v), max(v)] for k, v in rates.items()},
        "ratios": ratios, "paired_ratios_per_round": paired,
        "min_cosine_vs_sentence_transformers_float32": min_cos,
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "load_average": os.getloadavg(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
