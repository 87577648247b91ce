"""The two sides of each benchmark: lmkit and the Hugging Face transformers peer.

Each function runs inside its own process (see :mod:`lmkit.benchmarking.measure`), loads the
model, warms up, and times only generation.
"""

from __future__ import annotations

import time
from typing import Any

from lmkit.benchmarking.workload import Workload


def lmkit_throughput(model: str, options: dict[str, Any], workload: Workload,
                     threads: int | None) -> dict[str, Any]:
    """All requests submitted at once to the continuous-batching engine."""
    import torch

    from lmkit import SamplingParams
    from lmkit.frontend.llm import LLM

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model, **options)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([workload.prompts[0][:32]] * 2, warm)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.stats()
    llm.shutdown()
    return {"elapsed_s": elapsed, "output_tokens": produced,
            "num_preemptions": stats.get("num_preemptions", 0),
            "stack": {k: v for k, v in llm.engine.stack.names().items() if v},
            **{k: v for k, v in stats.items() if k.startswith("spec_")}}


def hf_generate_batch(model: Any, prompts: list[list[int]], new_tokens: int, pad: int) -> int:
    """One left-padded batch of token-id prompts through ``model.generate`` (greedy,
    exactly ``new_tokens`` each, EOS ignored); returns the tokens it produced."""
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device),
                             attention_mask=mask.to(model.device), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    return (out.shape[1] - width) * len(prompts)


def hf_throughput(model_dir: str, workload: Workload, dtype: str, device: str,
                  batch_size: int, threads: int | None) -> dict[str, Any]:
    """Static batches through ``model.generate`` (left padding, greedy, EOS ignored).

    A batch generates ``max(output_lens)`` tokens; only the tokens each request asked
    for are counted, which is what static batching costs.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.to(device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run(prompts: list[list[int]], new_tokens: int) -> None:
        hf_generate_batch(model, prompts, new_tokens, pad)

    run([workload.prompts[0][:32]] * 2, 4)
    t0 = time.perf_counter()
    for s in range(0, len(workload.prompts), batch_size):
        chunk = workload.prompts[s:s + batch_size]
        run(chunk, max(workload.output_lens[s:s + batch_size]))
    if device == "cuda":
        torch.cuda.synchronize()
    return {"elapsed_s": time.perf_counter() - t0, "output_tokens": workload.num_output_tokens}


def lmkit_latency(model: str, options: dict[str, Any], workload: Workload,
                  threads: int | None) -> dict[str, Any]:
    """One request at a time, streamed, to time first token and each later token."""
    import torch

    from lmkit import SamplingParams
    from lmkit.frontend.llm import LLM

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model, **options)
    llm.generate([workload.prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4,
                                                           ignore_eos=True))
    ttfts, tpots, total_tokens = [], [], 0
    t_all = time.perf_counter()
    for prompt, n in zip(workload.prompts, workload.output_lens, strict=True):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        first = None
        tokens = 0
        for out in llm.stream(prompt, params):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            tokens = len(out.outputs[0].token_ids)
        end = time.perf_counter()
        assert first is not None
        ttfts.append(first - t0)
        if tokens > 1:
            tpots.append((end - first) / (tokens - 1))
        total_tokens += tokens
    elapsed = time.perf_counter() - t_all
    llm.shutdown()
    return {"elapsed_s": elapsed, "output_tokens": total_tokens,
            "ttft_ms": 1000 * sum(ttfts) / len(ttfts),
            "tpot_ms": 1000 * sum(tpots) / max(len(tpots), 1)}


def hf_latency(model_dir: str, workload: Workload, dtype: str, device: str,
               threads: int | None) -> dict[str, Any]:
    """``model.generate`` on one prompt at a time (greedy, EOS ignored)."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.to(device).eval()

    def run(prompt: list[int], n: int) -> None:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=model.config.pad_token_id or 0)
        if device == "cuda":
            torch.cuda.synchronize()

    run(workload.prompts[0][:32], 4)
    t0 = time.perf_counter()
    for prompt, n in zip(workload.prompts, workload.output_lens, strict=True):
        run(prompt, n)
    return {"elapsed_s": time.perf_counter() - t0, "output_tokens": workload.num_output_tokens}
