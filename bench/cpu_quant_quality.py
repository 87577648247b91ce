"""Quality of the quantized default model against its float32 path (issue 23).

Both runs load the same GGUF (``smollm2-135m-instruct``, Q4_1 with a Q8_0 embedding):
``--quantization gguf`` keeps the blocks packed (activations quantized to int8 per
block for decode batches), ``--quantization none`` runs the float32 dequantization of
the same weights. Reports:

* greedy agreement: per prompt, the tokens generated before the first divergence, and
  the fraction of the float32 tokens matched position by position (N prompts x T tokens);
* perplexity of a held text (teacher forcing, prompt log-probabilities) on each path;
  a prompt of more than 32 tokens runs the quantized path's float32 tiles, so the
  quantized path is also scored with prefill chunks of 16 tokens
  (``max_num_batched_tokens=16``), which run the int8-activation kernels;
* with ``--llamacpp`` (llama-cpp-python installed): llama.cpp's perplexity on the same
  GGUF and the same token ids (every position's logits from one context), and lmkit's
  relative to it.

::

    python bench/cpu_quant_quality.py --prompts 16 --tokens 32 --llamacpp --out quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

HELD_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into "
    "a system that could produce books far faster than scribes. Within fifty years, "
    "presses operated in more than two hundred European cities, and millions of volumes "
    "had been printed. The spread of printed material lowered the cost of books, "
    "encouraged literacy, and allowed scientific results to be shared and checked by "
    "readers who would never meet their authors. Historians still debate how quickly "
    "these effects took hold, but few doubt that the press changed how knowledge moved."
)

PROMPT_STEMS = [
    "Write a short poem about the sea.", "What is the capital of Japan?",
    "Explain photosynthesis in one paragraph.", "def quicksort(arr):",
    "List three uses of copper.", "Translate 'good morning' into French.",
    "Why is the sky blue?", "Give me a recipe for pancakes.",
    "What is 17 times 23?", "Summarize the plot of Hamlet.",
    "How do vaccines work?", "Name the planets of the solar system.",
    "What does a compiler do?", "Describe a cat to someone who has never seen one.",
    "Write a haiku about autumn.", "What causes earthquakes?",
]


def run(quantization: str, prompts: list[str], tokens: int, held_text: str = HELD_TEXT,
        **options: Any) -> dict[str, Any]:
    """Greedy outputs for ``prompts`` and the held text's perplexity on one path."""
    from lmkit import SamplingParams
    from lmkit.frontend.llm import LLM

    llm = LLM(quantization=quantization, **options)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens,
                                                ignore_eos=True)) if prompts else []
    gen_s = time.perf_counter() - t0
    scored = llm.generate([held_text], SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                      temperature=0))[0]
    logprobs = [p.logprob for p in scored.prompt_logprobs or [] if p is not None]
    model_dir = str(llm.engine.model_dir)
    llm.shutdown()
    return {"model_dir": model_dir, "held_ids": list(scored.prompt_token_ids),"tokens": [list(o.outputs[0].token_ids) for o in outs], "generate_s": gen_s,
            "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
            "scored_tokens": len(logprobs)}


def llamacpp_perplexity(model_dir: str, ids: list[int], threads: int) -> float:
    """llama.cpp's perplexity of ``ids`` (the ids lmkit scored) on the model's GGUF."""
    from lmkit.benchmarking.llamacpp import gguf_file
    from lmkit.benchmarking.llamacpp_batch import prompt_logprobs

    logprobs = prompt_logprobs(gguf_file(model_dir), ids, threads)
    return math.exp(-sum(logprobs) / len(logprobs))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Prefix agreement and positionwise agreement of two sets of greedy outputs."""
    prefix, same, total = [], 0, 0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                 min(len(x), len(y)))
        prefix.append(n)
        same += sum(p == q for p, q in zip(x, y, strict=False))
        total += len(y)
    return {"identical_sequences": sum(p == len(y) for p, y in zip(prefix, b, strict=True)),
            "num_sequences": len(b), "mean_prefix_tokens": sum(prefix) / len(prefix),
            "positionwise_agreement": same / total, "prefix_per_prompt": prefix}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--llamacpp", action="store_true",
                    help="also score the held text with llama.cpp on the same GGUF")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    ap.add_argument("--text", default=None,
                    help="score this text file instead of the built-in paragraph (e.g. "
                         "bench/data/held_text_long.txt, ~1,100 tokens)")
    ap.add_argument("--model", default=None,
                    help="a GGUF file or model alias instead of the default model (e.g. a "
                         "Q6_K or Q4_K_M requantization)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.prompts < 1:
        ap.error("--prompts must be at least 1")
    held = HELD_TEXT
    if args.text:
        try:
            held = open(args.text, encoding="utf-8").read().strip()
        except OSError as e:
            ap.error(f"--text {args.text}: {e.strerror}")
        if not held:
            ap.error(f"--text {args.text} is empty")
    prompts = (PROMPT_STEMS * (args.prompts // len(PROMPT_STEMS) + 1))[:args.prompts]
    model = {"model": args.model} if args.model else {}
    quant = run("gguf", prompts, args.tokens, held, **model)
    dense = run("none", prompts, args.tokens, held, **model)
    chunked = run("gguf", [], 0, held, max_num_batched_tokens=16, **model)
    report = {"model": args.model or "default", "prompts": args.prompts, "tokens": args.tokens, "text": args.text or "built-in",
              "greedy": agreement(quant["tokens"], dense["tokens"]),
              "perplexity": {"gguf": quant["perplexity"], "float32": dense["perplexity"],
                             "relative": quant["perplexity"] / dense["perplexity"] - 1,
                             "gguf_int8_activations": chunked["perplexity"],
                             "relative_int8_activations":
                                 chunked["perplexity"] / dense["perplexity"] - 1,
                             "scored_tokens": quant["scored_tokens"]}}
    if args.llamacpp:
        # scoring is a multi-row llama_decode, which the prebuilt CPU library crashes in
        # with its AMX/repacked weight buffers (a segfault on this AMX host): plain buffers
        os.environ.setdefault("LMKIT_LLAMACPP_EXTRA_BUFTS", "0")
        ref = llamacpp_perplexity(quant["model_dir"], quant["held_ids"], args.threads)
        report["perplexity"].update(
            llamacpp=ref, relative_to_llamacpp=quant["perplexity"] / ref - 1,
            relative_to_llamacpp_int8_activations=chunked["perplexity"] / ref - 1)
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
