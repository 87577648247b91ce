"""The report of ``bench/gpu_engine.py``: its sides' results combined into one row per
workload (ratios to each peer, the decode step's bandwidth fraction) and printed as a
plain-text table."""

from __future__ import annotations

import json
from typing import Any


def combine(report: dict[str, Any], workload_models: dict[str, str]) -> list[dict[str, Any]]:
    """One row per workload (run on ``workload_models[workload]``): lmkit, the peers,
    their ratios, bandwidth fractions."""
    bw = report.get("copy_bandwidth_bytes_per_s")
    rows = []
    for name in report["workloads"]:
        model = workload_models[name]
        lm = _find(report["lmkit"].get(model, {}), name)
        hf = _find(report["hf"].get(model, {}), name)
        vl = _find(report.get("vllm", {}).get(model, {}), name)
        base = _find(report.get("lmkit_baseline", {}).get(model, {}), name)
        row: dict[str, Any] = {"workload": name, "model": model,
                               "requests": len(report["workload_sizes"][name])}
        if lm:
            row.update(lmkit_tok_s=lm["output_tokens_per_s"], lmkit_elapsed_s=lm["elapsed_s"],
                       lmkit_output_tokens=lm["output_tokens"])
            for key in ("tpot_ms", "ttft_ms", "decode_step_ms", "decode_achieved_bytes_per_s",
                        "decode_bytes_per_step", "num_preemptions"):
                if key in lm:
                    row[f"lmkit_{key}"] = lm[key]
            if bw and "decode_achieved_bytes_per_s" in lm:
                row["lmkit_decode_bandwidth_fraction"] = lm["decode_achieved_bytes_per_s"] / bw
            if bw and "tpot_ms" in lm:
                limit_ms = 1e3 * lm["decode_bytes_per_step"] / bw if "decode_bytes_per_step" \
                    in lm else None
                row["bandwidth_limit_ms_per_token"] = limit_ms
        if lm and "runs_tok_s" in lm:
            row["lmkit_runs_tok_s"] = lm["runs_tok_s"]
        for tag, peer in (("vllm", vl), ("baseline", base)):
            if not peer:
                continue
            row[f"{tag}_tok_s"] = peer["output_tokens_per_s"]
            if "runs_tok_s" in peer:
                row[f"{tag}_runs_tok_s"] = peer["runs_tok_s"]
            for key in ("tpot_ms", "ttft_ms"):
                if key in peer:
                    row[f"{tag}_{key}"] = peer[key]
            if lm:
                row[f"ratio_vs_{tag}"] = lm["output_tokens_per_s"] / peer["output_tokens_per_s"]
        if hf:
            row.update(hf_tok_s=hf["output_tokens_per_s"], hf_requests=len(
                report["hf_workloads"][name]["prompts"]))
            if "tpot_ms" in hf:
                row["hf_tpot_ms"] = hf["tpot_ms"]
            if lm:
                row["ratio_tok_s"] = lm["output_tokens_per_s"] / hf["output_tokens_per_s"]
        rows.append(row)
    return rows


def _find(side: dict[str, Any], name: str) -> dict[str, Any] | None:
    for r in side.get("results", []):
        if r["workload"] == name:
            return r
    return None


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table of :func:`combine`'s rows."""
    bw = report.get("copy_bandwidth_bytes_per_s")
    lines = [f"device: {report.get('gpu', 'cpu')}   copy bandwidth: "
             f"{bw / 1e12:.2f} TB/s" if bw else "device: cpu (no bandwidth limit)"]
    subset = False
    head = f"{'':4} {'lmkit tok/s':>12} {'vLLM tok/s':>10} {'x vLLM':>7} {'HF tok/s':>10} " \
           f"{'x HF':>6} {'ms/tok':>8} {'vLLM ms/tok':>11} {'HF ms/tok':>9} " \
           f"{'decode step':>11} {'bw frac':>8} {'base tok/s':>10} {'x base':>7}"
    lines.append(head)
    for r in report["rows"]:
        def f(key: str, fmt: str, r: dict[str, Any] = r) -> str:
            v = r.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else "-"
        hf = f("hf_tok_s", ".0f")
        if r.get("hf_requests", 0) and r["hf_requests"] != r.get("requests"):
            hf += "*"
            subset = True
        lines.append(f"{r['workload']:4} {f('lmkit_tok_s', '.0f'):>12} "
                     f"{f('vllm_tok_s', '.0f'):>10} {f('ratio_vs_vllm', '.3f'):>7} {hf:>10} "
                     f"{f('ratio_tok_s', '.1f'):>6} {f('lmkit_tpot_ms', '.2f'):>8} "
                     f"{f('vllm_tpot_ms', '.2f'):>11} {f('hf_tpot_ms', '.1f'):>9} "
                     f"{f('lmkit_decode_step_ms', '.2f'):>11} "
                     f"{f('lmkit_decode_bandwidth_fraction', '.2f'):>8} "
                     f"{f('baseline_tok_s', '.0f'):>10} {f('ratio_vs_baseline', '.3f'):>7}")
    if subset:
        lines.append("* HF ran the first N requests of the workload (see hf_requests)")
    for r in report["rows"]:
        runs = [f"{side} {' / '.join(f'{v:.0f}' for v in r[key])}"
                for side, key in (("lmkit", "lmkit_runs_tok_s"), ("vLLM", "vllm_runs_tok_s"),
                                  ("base", "baseline_runs_tok_s")) if key in r]
        if runs:
            lines.append(f"{r['workload']} timed runs (tok/s; the table shows each side's "
                         f"median): {'; '.join(runs)}")
    for key, facts in report.get("models", {}).items():
        if "of_layers" in facts:
            lines.append(f"{key}: {facts['num_hidden_layers']} of its {facts['of_layers']} "
                         f"layers ({facts['num_params']:,} parameters, bf16)")
    quant, base_quant = report.get("quantization", "none"), report.get("baseline_quantization")
    if quant != "none" or base_quant:
        lines.append(f"lmkit weights: {quant}" + (f"; baseline: {base_quant}" if base_quant
                                                  else "") + " (bw frac counts the bytes "
                     "read in that format; HF runs bf16)")
    for model, res in report.get("hf", {}).items():
        if "mode" in res:
            lines.append(f"HF on {model}: {res['mode']}")
    runs = [("without the decode lookahead", res)
            for res in report.get("lmkit_no_lookahead", {}).values()]
    runs += [("with " + " ".join([*(f"{k}={v}" for k, v in res.get("env", {}).items()),
                                  *(f"{k}={json.dumps(v)}" for k, v in res.get("set", {}).items())]),
              res)
             for res in report.get("lmkit_ab", {}).values()]
    for label, res in runs:
        for r in res.get("results", []):
            extra = f", {r['tpot_ms']:.2f} ms/token" if "tpot_ms" in r else ""
            lines.append(f"{r['workload']} {label}: {r['output_tokens_per_s']:.0f} tok/s{extra}")
        if "error" in res:
            lines.append(f"lmkit {label}: ERROR {res['error']}")
    for side in ("lmkit", "lmkit_baseline", "vllm", "hf"):
        for model, res in report.get(side, {}).items():
            if "error" in res:
                lines.append(f"{side} {model}: ERROR {res['error']}")
    return "\n".join(lines)
