"""The llama.cpp peer of ``lmkit bench latency`` (``--peer llamacpp``): the same GGUF
file through llama-cpp-python, one request at a time, greedy, EOS ignored.

It runs the model directory's kept GGUF (``model.gguf``, see
:func:`lmkit.loading.gguf.weight_format`) with ``n_threads`` = the bench's ``--threads``
(else the torch thread count), so both sides use the same cores.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lmkit.benchmarking.workload import Workload
from lmkit.errors import ConfigError
from lmkit.loading.gguf import GGUF_NAME, weight_format


def gguf_file(model_dir: str) -> Path:
    """The GGUF file the peer runs; ``ConfigError`` when the model has none."""
    if weight_format(Path(model_dir)) != "gguf":
        raise ConfigError(
            f"--peer llamacpp runs a GGUF file, but {model_dir} keeps none ({GGUF_NAME}); "
            "benchmark a model given as a .gguf file or alias (such as the default), or use "
            "--peer hf.")
    return Path(model_dir) / GGUF_NAME


def llamacpp_latency(model_dir: str, workload: Workload, threads: int | None
                     ) -> dict[str, Any]:
    """llama.cpp on one prompt at a time: TTFT and time per output token as
    :func:`lmkit.benchmarking.sides.lmkit_latency` measures them."""
    import torch

    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise ConfigError("--peer llamacpp needs llama-cpp-python: pip install "
                          "llama-cpp-python (CMAKE_ARGS=-DGGML_NATIVE=ON builds it for "
                          "this CPU).") from e
    n_threads = threads or torch.get_num_threads()
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens,
                                              strict=True))
    # LMKIT_LLAMACPP_UBATCH=1 feeds prompts one token at a time: some llama-cpp-python
    # builds crash in their multi-row CPU matmul; decode (one token per step) is unchanged
    ubatch = int(os.environ.get("LMKIT_LLAMACPP_UBATCH", "0")) or None
    batch_kw = {"n_batch": ubatch, "n_ubatch": ubatch} if ubatch else {}
    llm = Llama(model_path=str(gguf_file(model_dir)), n_ctx=max(512, longest + 8),
                n_threads=n_threads, n_threads_batch=n_threads, verbose=False, **batch_kw)

    def run(prompt: list[int], n: int) -> tuple[float, float, int]:
        llm.reset()  # no prefix reuse across prompts (lmkit's side runs without it too)
        t0 = time.perf_counter()
        first, count = 0.0, 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            count += 1
            if count == 1:
                first = time.perf_counter()
            if count == n:
                break
        return first - t0, time.perf_counter() - first, count

    run(workload.prompts[0][:32], 4)  # warm-up
    ttfts, tpots, total = [], [], 0
    t_all = time.perf_counter()
    for prompt, n in zip(workload.prompts, workload.output_lens, strict=True):
        ttft, rest, count = run(prompt, n)
        ttfts.append(ttft)
        if count > 1:
            tpots.append(rest / (count - 1))
        total += count
    return {"elapsed_s": time.perf_counter() - t_all, "output_tokens": total,
            "ttft_ms": 1000 * sum(ttfts) / len(ttfts),
            "tpot_ms": 1000 * sum(tpots) / max(len(tpots), 1), "n_threads": n_threads,
            "n_ubatch": ubatch}
