"""Embedding throughput on the CPU: lmkit's ``LLM.embed`` against sentence-transformers
on all-MiniLM-L6-v2, batches of 64 texts, in one process with alternating rounds (so
that both sides see the same machine load), plus a check that the vectors agree::

    OMP_NUM_THREADS=2 python bench/embeddings.py --texts 512 --rounds 5 --out emb.json

Texts are seeded random sentences of 6 to 40 words. Both sides use the same number of
torch threads (``--threads``). Reported: texts/s per round and the median of each side,
the ratio (lmkit / sentence-transformers) and the smallest cosine between the two sides'
embeddings of the same text.
"""

from __future__ import annotations

import argparse
import json
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-minilm-l6-v2", help="lmkit model reference")
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from lmkit import LLM
    from sentence_transformers import SentenceTransformer

    texts = make_texts(args.texts)
    llm = LLM(args.model, progress=False, max_num_seqs=args.batch_size,
              max_num_batched_tokens=max(8192, 64 * args.batch_size))
    st = SentenceTransformer(str(llm.engine.model_dir), device="cpu")

    def run_lmkit() -> np.ndarray:
        out = []
        for i in range(0, len(texts), args.batch_size):
            out += [o.embedding for o in llm.embed(texts[i:i + args.batch_size])]
        return np.asarray(out, dtype=np.float32)

    def run_st() -> np.ndarray:
        return st.encode(texts, batch_size=args.batch_size, normalize_embeddings=True)

    ours, theirs = run_lmkit(), run_st()  # warm-up, and the agreement check
    cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    rates: dict[str, list[float]] = {"lmkit": [], "sentence_transformers": []}
    for _ in range(args.rounds):
        for name, fn in (("lmkit", run_lmkit), ("sentence_transformers", run_st)):
            start = time.perf_counter()
            fn()
            rates[name].append(len(texts) / (time.perf_counter() - start))
    llm.shutdown()
    medians = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "model": args.model, "texts": len(texts), "batch_size": args.batch_size,
        "threads": args.threads, "rounds": args.rounds, "texts_per_s": rates,
        "median_texts_per_s": medians,
        "ratio": medians["lmkit"] / medians["sentence_transformers"],
        "min_cosine": float(cos.min()), "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
