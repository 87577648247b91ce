"""The vLLM side of the GPU engine benchmark (``bench/gpu_engine.py --peer vllm``).

vLLM's own offline engine with its defaults (torch.compile, CUDA graphs, its attention
backend, prefix caching), on the same random-weight model directory and the same
token-id workloads as lmkit: greedy, EOS ignored, no tokenizer, no detokenization.
Run in its own process; the engine runs in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the timings hold no IPC that lmkit's in-process
engine core does not pay either.

Each workload runs once untimed on shifted token ids (JIT, graph capture and allocator
warm-up; no prefix-cache hits for the timed run), then timed. A one-request workload
(W2) is stepped by hand so that the first token's time is known: it reports TTFT and
the time per output token after the first (TPOT), as lmkit's side does.

vLLM is not a dependency of lmkit: ``../shared/gpu/vllm_bundle.sh`` builds the parts
that install it offline on the GPU machine (see docs/gpu.md).
"""

from __future__ import annotations

import os
import time
from typing import Any

Workload = dict[str, Any]  # {"name", "prompts": [[ids]], "output_lens": [n]}


def vllm_side(model_dir: str, options: dict[str, Any], workloads: list[Workload],
              facts: dict[str, Any] | None = None, profile_run: bool = False,
              repeats: int = 1) -> dict[str, Any]:
    """Start vLLM's ``LLM`` for ``model_dir`` with lmkit's engine limits; run each
    workload (warm-up, then ``repeats`` timed runs as lmkit's side times them:
    ``gpu_bench_sides.repeat_runs``); results in the same shape as lmkit's side. With
    ``profile_run``, each batch workload runs once more under the profiler
    (:mod:`gpu_run_profile`), as on lmkit's side."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import vllm
    from gpu_bench_sides import repeat_runs

    t0 = time.perf_counter()
    llm = vllm.LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                   max_num_seqs=options["max_num_seqs"],
                   max_num_batched_tokens=options["max_num_batched_tokens"],
                   max_model_len=options["max_model_len"],
                   # --quantization fp8: vLLM's own FP8 weights, quantized at load
                   **({"quantization": "fp8"} if options.get("quantization") == "fp8" else {}),
                   # --kv-cache-dtype fp8: vLLM's FP8 KV cache (scales 1.0, as lmkit's)
                   **({"kv_cache_dtype": "fp8"} if options.get("kv_cache_dtype") == "fp8"
                      else {}),
                   **({"load_format": "dummy"} if options.get("load_format") == "dummy"
                      else {}))
    info: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "vllm": vllm.__version__,
                            "gpu": torch.cuda.get_device_name(0), "results": []}
    for wl in workloads:
        top = max(max(p) for p in wl["prompts"]) + 1
        warm = {"name": "warmup", "prompts": [[(t + 7) % top for t in p[: max(16, len(p) // 2)]]
                                              for p in wl["prompts"][:8]],
                "output_lens": [min(n, 24) for n in wl["output_lens"][:8]]}
        _generate(llm, warm)
        if len(wl["prompts"]) == 1:
            _step_one(llm, warm)  # the hand-stepped path warms up too
            info["results"].append(repeat_runs(lambda w: _step_one(llm, w), wl, repeats))
        else:
            info["results"].append(repeat_runs(lambda w: _generate(llm, w), wl, repeats))
    info["peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 2**30
    if profile_run:
        from gpu_bench_sides import shifted
        from gpu_run_profile import profile_run as run_profiled

        info["run_profiles"] = {
            wl["name"]: run_profiled(lambda wl=wl: _generate(llm, shifted(wl, 13)), facts,
                                     len(wl["prompts"]))
            for wl in workloads if len(wl["prompts"]) > 1}
    return info


def _params(n: int, sampling: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(**{"temperature": 0.0, **(sampling or {})}, max_tokens=n,
                          ignore_eos=True, detokenize=False)


def _prompts(wl: Workload) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": list(p)} for p in wl["prompts"]]


def _generate(llm: Any, wl: Workload) -> dict[str, Any]:
    """All of ``wl`` through ``LLM.generate`` (vLLM schedules them as it likes)."""
    params = [_params(n, wl.get("sampling")) for n in wl["output_lens"]]
    start = time.perf_counter()
    outs = llm.generate(_prompts(wl), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return _summary(wl, elapsed, produced)


def _step_one(llm: Any, wl: Workload) -> dict[str, Any]:
    """One request, stepped through ``llm.llm_engine`` to time its first token."""
    engine = llm.llm_engine
    (prompt,), (n,) = _prompts(wl), wl["output_lens"]
    start = time.perf_counter()
    engine.add_request(f"{wl['name']}-0", prompt, _params(n, wl.get("sampling")))
    t_first, produced = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced = len(out.outputs[0].token_ids)
            if produced and t_first is None:
                t_first = time.perf_counter()
    elapsed = time.perf_counter() - start
    extra: dict[str, Any] = {}
    if t_first is not None and produced > 1:
        extra = {"ttft_ms": 1e3 * (t_first - start),
                 "tpot_ms": 1e3 * (start + elapsed - t_first) / (produced - 1)}
    return _summary(wl, elapsed, produced, **extra)


def _summary(wl: Workload, elapsed: float, produced: int, **extra: Any) -> dict[str, Any]:
    return {"workload": wl["name"], "elapsed_s": elapsed, "output_tokens": produced,
            "prompt_tokens": sum(map(len, wl["prompts"])),
            "output_tokens_per_s": produced / elapsed, **extra}
