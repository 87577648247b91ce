"""Summarize an engine step trace (``LMKIT_STEP_TRACE=FILE``) by step kind.

    python bench/step_trace.py FILE [--json OUT]

Step kinds: ``decode`` (every request scheduled one token), ``verify`` (every other
request verifies drafts), ``mixed`` (decodes and prefill/chunk tokens), ``prefill`` (no
single-token request), ``empty``. For each kind: the number of steps, their share of the traced wall time, and the median/p90 of
the schedule, execute and preceding gap times; plus the total time spent between steps
(host gaps) against the time inside them, and the part of it when requests were running
(the gaps after a step that did not finish every request it ran: idling excluded).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def step_kind(rec: dict[str, Any]) -> str:
    """``decode``, ``verify``, ``mixed``, ``prefill`` or ``empty`` for one trace record."""
    if rec["tokens"] == 0:
        return "empty"
    if rec["prefill_tokens"] == 0:
        return "decode"
    verify = rec.get("verify_tokens", 0)  # (traces before it had no such field)
    if verify and rec["tokens"] == rec["decode_reqs"] + verify:
        return "verify"
    return "mixed" if rec["decode_reqs"] else "prefill"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-kind counts and timings, and the split of wall time into steps and gaps."""
    if not records:
        raise ValueError("the trace has no steps")
    wall = (records[-1]["t"] - records[0]["t"]) * 1e3 + records[-1]["schedule_ms"] \
        + records[-1]["execute_ms"]
    kinds: dict[str, Any] = {}
    for kind in ("decode", "verify", "mixed", "prefill", "empty"):
        recs = [r for r in records if step_kind(r) == kind]
        if not recs:
            continue
        in_step = [r["schedule_ms"] + r["execute_ms"] for r in recs]
        gaps = [r["gap_ms"] for r in recs if r["gap_ms"] is not None]
        kinds[kind] = {
            "steps": len(recs),
            "share_of_wall": round(sum(in_step) / wall, 4) if wall else 0.0,
            "schedule_ms_p50": statistics.median(r["schedule_ms"] for r in recs),
            "execute_ms_p50": statistics.median(r["execute_ms"] for r in recs),
            "execute_ms_p90": _pct([r["execute_ms"] for r in recs], 0.9),
            "gap_before_ms_p50": statistics.median(gaps) if gaps else None,
            "reqs_p50": statistics.median(r["reqs"] for r in recs),
            "tokens_p50": statistics.median(r["tokens"] for r in recs),
        }
    gap_total = sum(r["gap_ms"] for r in records if r["gap_ms"] is not None)
    # gaps after a step that left requests running: host time, not idling
    busy = [cur["gap_ms"] for prev, cur in zip(records, records[1:], strict=False)
            if prev["reqs"] > prev.get("finished", 0)]
    return {"steps": len(records), "wall_ms": round(wall, 3),
            "gap_share": round(gap_total / wall, 4) if wall else 0.0,
            "busy_gap_share": round(sum(busy) / wall, 4) if wall else 0.0,
            "busy_gap_ms_p50": statistics.median(busy) if busy else None,
            "busy_gap_ms_p90": _pct(busy, 0.9), "kinds": kinds}


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The trace's records (one JSON object per line)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args()
    summary = summarize(read_trace(args.trace))
    print(f"{summary['steps']} steps over {summary['wall_ms'] / 1e3:.2f} s; "
          f"{summary['gap_share']:.1%} of the time between steps, "
          f"{summary['busy_gap_share']:.1%} with requests running (gap p50 "
          f"{summary['busy_gap_ms_p50'] or 0:.2f} ms, p90 {summary['busy_gap_ms_p90']:.2f} ms)")
    print(f"{'kind':8} {'steps':>6} {'wall%':>6} {'sched':>7} {'exec p50':>9} "
          f"{'exec p90':>9} {'gap p50':>8} {'reqs':>5} {'tokens':>7}")
    for kind, k in summary["kinds"].items():
        gap = k["gap_before_ms_p50"]
        print(f"{kind:8} {k['steps']:6d} {k['share_of_wall']:6.1%} {k['schedule_ms_p50']:7.2f} "
              f"{k['execute_ms_p50']:9.2f} {k['execute_ms_p90']:9.2f} "
              f"{gap if gap is not None else float('nan'):8.2f} {k['reqs_p50']:5.0f} "
              f"{k['tokens_p50']:7.0f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
