"""The two sides of the GPU engine benchmark, each run in its own process by
``bench/gpu_engine.py``: lmkit's engine core and Hugging Face transformers' continuous
batching (or, for models whose attention its paged cache cannot hold -- DeepSeek's
MLA -- transformers' ``generate`` over static batches), on token-id workloads with EOS
ignored.

lmkit is driven through :class:`lmkit.engine.core.EngineCore` (requests in, token ids
out; no tokenizer, no detokenization, as nano-vllm's and vLLM's throughput benchmarks
count). Every engine step is timed; steps in which every request decodes one token are
"decode steps", and for them the bytes the GPU must read -- all weights once plus the
K/V of every cached token -- over the step's wall time gives the achieved bandwidth.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpu_run_watch import gc_pauses, slowest_steps, watch_jit_compiles

Workload = dict[str, Any]  # {"name", "prompts": [[ids]], "output_lens": [n]}


def _summary(name: str, elapsed: float, output_tokens: int, prompt_tokens: int,
             **extra: Any) -> dict[str, Any]:
    return {"workload": name, "elapsed_s": elapsed, "output_tokens": output_tokens,
            "prompt_tokens": prompt_tokens, "output_tokens_per_s": output_tokens / elapsed,
            **extra}


# ---------------------------------------------------------------------- lmkit


def lmkit_side(model_dir: str, options: dict[str, Any], workloads: list[Workload],
               facts: dict[str, Any], profile_steps: int = 0, profile_run: bool = False,
               repeats: int = 1) -> dict[str, Any]:
    """Start one engine for ``model_dir``, warm it up, run each workload (``repeats``
    timed runs: :func:`repeat_runs`); results.

    With ``profile_steps``, each workload is then replayed until its decode phase and
    that many decode steps run under the torch profiler (kernel table in the result).
    With ``profile_run``, each workload runs once more whole under the profiler
    (:mod:`gpu_run_profile`: where the run's GPU time goes).
    """
    import torch
    from lmkit.engine.core import EngineCore
    from lmkit.frontend.llm import build_config

    t0 = time.perf_counter()
    engine = EngineCore(build_config(model_dir, None, options), progress=False)
    # the runner lives in this process with uniproc; a worker process's is not reachable
    runner = getattr(engine.executor, "runner", None)
    graphs = runner.cuda_graphs if runner is not None else None
    pieces = getattr(runner, "piecewise", None)
    startup = time.perf_counter() - t0
    info: dict[str, Any] = {
        "startup_s": startup, "stack": {k: v for k, v in engine.stack.names().items() if v},
        "num_kv_blocks": engine.num_blocks, "block_size": engine.config.cache.block_size,
        "cuda_graph_sizes": graphs.sizes if graphs else None,
        "cuda_graph_capture_s": graphs.capture_seconds if graphs else None,
        "piecewise_graph_sizes": pieces.sizes if pieces else None,
        "piecewise_graph_capture_s": pieces.capture_seconds if pieces else None,
        "results": []}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    recorder = _StepRecorder(engine)
    compiles = watch_jit_compiles()

    def timed(wl: Workload) -> dict[str, Any]:
        compiles.clear()
        with gc_pauses() as pauses:
            result = _run_engine(engine, wl, recorder)
        result["jit_compiles_during_run"] = list(compiles)
        result["gc_pauses"] = pauses
        result["slowest_steps"] = slowest_steps(recorder.steps)
        result.update(_decode_bandwidth(recorder.steps, facts))
        return result

    for wl in workloads:
        _run_engine(engine, warmup(wl, 8), recorder)
        info["results"].append(repeat_runs(timed, wl, repeats))
    if torch.cuda.is_available():
        info["peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 2**30
    if getattr(runner, "lookahead", None) is not None:
        info["decode_lookahead"] = vars(runner.lookahead.stats).copy()
    if profile_steps:
        info["profiles"] = {wl["name"]: _profile_decode(engine, wl, recorder, profile_steps)
                            for wl in workloads}
    if profile_run:
        from gpu_run_profile import profile_run as run_profiled

        info["run_profiles"] = {
            wl["name"]: run_profiled(lambda wl=wl: _run_engine(engine, shifted(wl, 13),
                                                               recorder),
                                     facts, len(wl["prompts"]))
            for wl in workloads}
    engine.shutdown()
    return info


def shifted(wl: Workload, by: int) -> Workload:
    """``wl`` with every token id moved by ``by`` (mod its top id + 1): the same work, no
    prefix-cache hits from a run of ``wl``."""
    top = max(max(p) for p in wl["prompts"]) + 1
    return {**wl, "prompts": [[(t + by) % top for t in p] for p in wl["prompts"]]}


def repeat_runs(run: Callable[[Workload], dict[str, Any]], wl: Workload, repeats: int
                ) -> dict[str, Any]:
    """Time ``wl`` ``repeats`` times through ``run`` (the later runs on ids shifted by 13,
    26, ...: the same work, no prefix-cache hits from the runs before); the median run's
    result by output tokens per second (of an even count, the lower of the middle two),
    with ``runs_tok_s`` (and, for one request, ``runs_tpot_ms``) of every run in order
    when there was more than one."""
    results = [run(wl if i == 0 else shifted(wl, 13 * i)) for i in range(repeats)]
    if len(results) == 1:
        return results[0]
    by_speed = sorted(results, key=lambda r: r["output_tokens_per_s"])
    median = dict(by_speed[(len(results) - 1) // 2])
    median["runs_tok_s"] = [r["output_tokens_per_s"] for r in results]
    if all("tpot_ms" in r for r in results):
        median["runs_tpot_ms"] = [r["tpot_ms"] for r in results]
    return median


class _StepRecorder:
    """Times every ``engine.step()`` and keeps what was scheduled in it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: list[tuple[float, Any]] = []
        self._last: Any = None
        schedule = engine.scheduler.schedule

        def recording_schedule() -> Any:
            self._last = schedule()
            return self._last

        engine.scheduler.schedule = recording_schedule

    def step(self) -> list[Any]:
        t = time.perf_counter()
        outputs = self.engine.step()
        self.steps.append((time.perf_counter() - t, self._last))
        return outputs


def warmup(wl: Workload, count: int) -> Workload:
    """A short warm-up of ``wl``'s first ``count`` requests (half their prompts, at most
    24 output tokens), on token ids shifted so that the timed run gets no prefix-cache
    hits from it."""
    top = max(max(p) for p in wl["prompts"]) + 1
    return {"name": "warmup", "prompts": [[(t + 7) % top for t in p[: max(16, len(p) // 2)]]
                                          for p in wl["prompts"][:count]],
            "output_lens": [min(n, 24) for n in wl["output_lens"][:count]],
            "sampling": wl.get("sampling", {})}


def lmkit_dp_side(model_dir: str, options: dict[str, Any], workloads: list[Workload]
                  ) -> dict[str, Any]:
    """lmkit through :class:`lmkit.LLM` with ``data_parallel_size`` > 1: one engine process
    per replica (each on its own device), requests routed between them. Each workload is
    timed whole after a short warm-up on shifted token ids; the steps run in the engine
    processes, so there is no per-step breakdown."""
    from lmkit import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model_dir, progress=False, **options)
    info: dict[str, Any] = {"startup_s": time.perf_counter() - t0,
                            "data_parallel_size": options["data_parallel_size"],
                            "results": []}

    def run(wl: Workload) -> tuple[float, int]:
        params = [SamplingParams(**{"temperature": 0.0, **wl.get("sampling", {})},
                                 max_tokens=n, ignore_eos=True) for n in wl["output_lens"]]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in wl["prompts"]], params)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    try:
        for wl in workloads:
            run(warmup(wl, 16))  # both engines' share of it
            elapsed, produced = run(wl)
            info["results"].append(_summary(wl["name"], elapsed, produced,
                                            sum(map(len, wl["prompts"]))))
    finally:
        llm.shutdown()
    return info


def _run_engine(engine: Any, wl: Workload, recorder: _StepRecorder) -> dict[str, Any]:
    from lmkit.api.request import Request
    from lmkit.api.sampling_params import SamplingParams

    recorder.steps = []
    start = time.perf_counter()
    first_token: dict[str, float] = {}
    for i, (prompt, n) in enumerate(zip(wl["prompts"], wl["output_lens"], strict=True)):
        params = SamplingParams(**{"temperature": 0.0, **wl.get("sampling", {})},
                                max_tokens=n, ignore_eos=True)
        engine.add_request(Request(f"{wl['name']}-{i}", list(prompt), params))
    submit_s = time.perf_counter() - start
    produced = 0
    while engine.has_unfinished_requests():
        for out in recorder.step():
            if out.new_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.perf_counter()
            produced += len(out.new_token_ids)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(map(len, wl["prompts"]))
    extra: dict[str, Any] = {"num_steps": len(recorder.steps), "submit_s": submit_s}
    if len(wl["prompts"]) == 1 and produced > 1:  # latency: time per output token
        t_first = next(iter(first_token.values()))
        extra["ttft_ms"] = 1e3 * (t_first - start)
        extra["tpot_ms"] = 1e3 * (start + elapsed - t_first) / (produced - 1)
    stats = engine.stats()
    extra["num_preemptions"] = stats.get("num_preemptions", 0)
    return _summary(wl["name"], elapsed, produced, prompt_tokens, **extra)


def _profile_decode(engine: Any, wl: Workload, recorder: _StepRecorder, steps: int
                    ) -> dict[str, Any]:
    """Run ``wl`` (short outputs) to its decode phase, profile ``steps`` decode steps."""
    import torch
    from lmkit.api.request import Request
    from lmkit.api.sampling_params import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    top = max(max(p) for p in wl["prompts"]) + 1
    ids = []
    for i, prompt in enumerate(wl["prompts"]):
        params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
        ids.append(f"profile-{i}")
        engine.add_request(Request(ids[-1], [(t + 11) % top for t in prompt], params))
    recorder.steps = []
    while engine.has_unfinished_requests():  # prefill, then one decode step
        recorder.step()
        so = recorder.steps[-1][1]
        if not so.scheduled_new_reqs and all(n == 1 for n in so.num_scheduled_tokens.values()):
            break
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    recorder.steps = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            recorder.step()
    engine.abort_requests(ids)
    while engine.has_unfinished_requests():
        engine.step()
    wall = sum(dt for dt, _ in recorder.steps)
    events = prof.key_averages()

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", None)
                     or getattr(e, "self_cuda_time_total", 0.0) or 0.0)

    kernels = sorted(((device_us(e), e.count, e.key) for e in events if device_us(e) > 0),
                     reverse=True)
    gpu_us = sum(t for t, _, _ in kernels)
    batch = len(recorder.steps[-1][1].num_scheduled_tokens) if recorder.steps else 0
    return {"steps": len(recorder.steps), "batch": batch,
            "wall_ms_per_step": 1e3 * wall / max(1, len(recorder.steps)),
            "gpu_busy_ms_per_step": gpu_us / 1e3 / max(1, len(recorder.steps)),
            "kernels_per_step": sum(c for _, c, _ in kernels) / max(1, len(recorder.steps)),
            "top_kernels": [{"us_per_step": t / max(1, len(recorder.steps)), "calls": c,
                             "name": k[:120]} for t, c, k in kernels[:25]]}


def _decode_bandwidth(steps: list[tuple[float, Any]], facts: dict[str, Any]) -> dict[str, Any]:
    """Bytes read per pure-decode step (weights + cached K/V) over its wall time; of a
    MoE model's routed experts, those the step's batch is expected to touch
    (:func:`gpu_bench_models.expected_expert_bytes`)."""
    from gpu_bench_models import expected_expert_bytes

    total_time = total_bytes = 0.0
    count = 0
    others: list[tuple[float, int]] = []  # (ms, tokens) of every other step
    for dt, so in steps:
        if (so is None or so.scheduled_new_reqs or not so.num_scheduled_tokens
                or any(n != 1 for n in so.num_scheduled_tokens.values())):
            tokens = sum(so.num_scheduled_tokens.values()) if so is not None else 0
            others.append((round(1e3 * dt, 2), tokens))
            continue
        context = sum(so.scheduled_cached_reqs.num_computed_tokens) + len(so.num_scheduled_tokens)
        total_bytes += facts["decode_weight_bytes"] + context * facts["kv_bytes_per_token"]
        if "moe" in facts:
            total_bytes += expected_expert_bytes(facts["moe"], len(so.num_scheduled_tokens))
        total_time += dt
        count += 1
    if not count:
        return {"decode_steps": 0, "other_steps_ms_tokens": others[:64]}
    return {"other_steps_ms_tokens": others[:64], "decode_steps": count, "decode_time_s": total_time,
            "decode_step_ms": 1e3 * total_time / count,
            "decode_bytes_per_step": total_bytes / count,
            "decode_achieved_bytes_per_s": total_bytes / total_time}


# ---------------------------------------------------------------------- HF peer


def _load_hf(model_dir: str, attn: str) -> tuple[Any, str]:
    """transformers' model from ``model_dir`` in eval mode: bf16 on CUDA, else float32
    on the CPU; returns it and the device name."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
        attn_implementation=attn, device_map=device)
    model.eval()
    return model, device


def hf_side(model_dir: str, workloads: list[Workload], attn: str = "paged|sdpa"
            ) -> dict[str, Any]:
    """transformers' continuous batching (``init_continuous_batching`` manager, greedy,
    EOS disabled) on each workload; per-request ``max_new_tokens``."""
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    model, device = _load_hf(model_dir, attn)
    info: dict[str, Any] = {"load_s": time.perf_counter() - t0, "attn_implementation": attn,
                            "results": []}
    import transformers

    info["transformers"] = transformers.__version__
    for wl in workloads:
        info["results"].append(_hf_run(model, wl, GenerationConfig))
    return info


def _hf_run(model: Any, wl: Workload, generation_config_cls: Any) -> dict[str, Any]:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    max_new = max(wl["output_lens"])
    gen = generation_config_cls(max_new_tokens=max_new, do_sample=False, eos_token_id=-1,
                                pad_token_id=0)
    hints = WorkloadHints(max_prompt_length=max(map(len, wl["prompts"])),
                          max_generated_length=max_new, num_requests=len(wl["prompts"]))
    latency = len(wl["prompts"]) == 1
    t_setup = time.perf_counter()
    cb_config = None
    if model.device.type == "cpu":  # --smoke: a small cache, not 90% of the host's memory
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        cb_config = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)
    # no inference_mode here: the manager's loop runs in its own thread, outside it
    with model.continuous_batching_context_manager(
            generation_config=gen, block=True, timeout=600, workload_hints=hints,
            continuous_batching_config=cb_config) as manager:
        setup = time.perf_counter() - t_setup
        start = time.perf_counter()
        ids = [manager.add_request(input_ids=list(p), request_id=f"{wl['name']}-{i}",
                                   max_new_tokens=n, eos_token_id=-1,
                                   record_timestamps=latency)
               for i, (p, n) in enumerate(zip(wl["prompts"], wl["output_lens"], strict=True))]
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            out = manager.get_result(timeout=5)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped with "
                                       f"{len(ids) - len(results)} requests unfinished")
                continue
            if out.is_finished():
                if out.error:
                    raise RuntimeError(f"transformers request {out.request_id}: {out.error}")
                results[out.request_id] = out
        elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in results.values())
    extra: dict[str, Any] = {"setup_s": setup}
    if latency:
        stamps = next(iter(results.values())).timestamps or []
        if len(stamps) > 1:
            extra["tpot_ms"] = 1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return _summary(wl["name"], elapsed, produced, sum(map(len, wl["prompts"])), **extra)


def hf_generate_side(model_dir: str, workloads: list[Workload], batch_size: int,
                     attn: str = "sdpa") -> dict[str, Any]:
    """transformers' ``generate`` (greedy, EOS suppressed by ``min_new_tokens``) over
    static batches of ``batch_size`` requests, for models transformers' continuous
    batching cannot serve: in transformers 5.24 its paged cache stores one K and one V
    shape per layer, and DeepSeek's MLA layers hand it keys of 192 and values of 128 per
    head (``index_copy_`` shape error, found by ``gpu_engine.py --smoke``)."""
    import torch
    from lmkit.benchmarking.sides import hf_generate_batch

    t0 = time.perf_counter()
    model, device = _load_hf(model_dir, attn)
    import transformers

    info: dict[str, Any] = {"load_s": time.perf_counter() - t0, "attn_implementation": attn,
                            "mode": f"generate, static batches of {batch_size}",
                            "transformers": transformers.__version__, "results": []}
    pad = model.config.pad_token_id or 0
    hf_generate_batch(model, [workloads[0]["prompts"][0][:16]], 8, pad)  # warm-up
    for wl in workloads:
        prompts, lens = wl["prompts"], wl["output_lens"]
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        produced = 0
        for i in range(0, len(prompts), batch_size):
            produced += hf_generate_batch(model, prompts[i:i + batch_size],
                                     max(lens[i:i + batch_size]), pad)
        sync()
        elapsed = time.perf_counter() - start
        extra: dict[str, Any] = {}
        if len(prompts) == 1 and lens[0] > 1:  # tpot: the same request with one token
            sync()
            t1 = time.perf_counter()
            hf_generate_batch(model, prompts, 1, pad)
            sync()
            first = time.perf_counter() - t1
            extra = {"ttft_ms": 1e3 * first,
                     "tpot_ms": 1e3 * (elapsed - first) / (lens[0] - 1)}
        info["results"].append(_summary(wl["name"], elapsed, produced,
                                        sum(map(len, prompts)), **extra))
    return info
