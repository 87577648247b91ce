"""Paired A/B of the CPU decode-stack executor in one process: two engines on the
default model (``--quantization gguf``), one loaded with ``LMKIT_CPU_DECODE_STACK=0``
(the switch is read when the weights load), alternating greedy generations::

    python bench/cpu_decode_stack_ab.py --threads 1 --rounds 7

Time per output token is the difference of a ``--tokens``-token and a 1-token
generation of the same prompt divided by ``tokens - 1`` (so the prompt's prefill and the
first token cancel). Reports each side's median, min and max, the median of the
per-round ratios, and whether the greedy tokens are identical.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

ENV = "LMKIT_CPU_DECODE_STACK"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=129)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lmkit import LLM, SamplingParams

    llms = {}
    for name, value in (("on", None), ("off", "0")):
        if value is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = value
        llms[name] = LLM(args.model, device="cpu", quantization="gguf")
    os.environ.pop(ENV, None)

    def generate(llm, n: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n,
                                                    ignore_eos=True))
        return time.perf_counter() - start, list(out[0].outputs[0].token_ids)

    for llm in llms.values():
        generate(llm, 8)  # warm-up
    tpot: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for name in (list(llms) if r % 2 == 0 else list(reversed(llms))):
            one, _ = generate(llms[name], 1)
            many, tokens[name] = generate(llms[name], args.tokens)
            tpot[name].append((many - one) / (args.tokens - 1) * 1e3)
    for name, values in tpot.items():
        print(f"{name}: {statistics.median(values):.3f} ms per token "
              f"[{min(values):.3f} to {max(values):.3f}]")
    ratios = [off / on for on, off in zip(tpot["on"], tpot["off"], strict=True)]
    print(f"off / on: {statistics.median(ratios):.3f}x "
          f"[{min(ratios):.3f} to {max(ratios):.3f}]; greedy tokens identical: "
          f"{tokens['on'] == tokens['off']}")


if __name__ == "__main__":
    main()
