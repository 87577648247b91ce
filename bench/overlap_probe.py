"""Whether a large decode step gains from two half batches on two CUDA streams.

A decode step of W1's shape (Qwen3-0.6B, 256 requests, contexts of hundreds to
thousands of tokens) spends most of its time in paged attention, which reads the KV
cache near the copy bandwidth, and the rest in the projections, which are compute
bound at 256 rows. Within one batch they cannot overlap: each layer's attention needs
its projections. Split the batch in two halves A and B, run A's layers on one stream
and B's on another, and make the attention launches alternate (A's layer ``i``, B's
layer ``i``, A's layer ``i + 1``, ...): each half's projections then run beside the
other half's attention.

This bench captures the layer stack's decode chain (per layer: RMSNorm, QKV, q/k norm +
RoPE + cache write, paged decode attention, O, RMSNorm, gate-up, SiLU-and-multiply,
down; the kernels the Llama family runs at these batch sizes) as CUDA graphs in
several settings and replays them in interleaved rounds:

* ``serial``: the whole batch on one stream (what the model runs today);
* ``overlap``: the two halves on two streams, attention alternating;
* ``overlap-hi``: the same, the projections' stream at high priority;
* ``attention`` / ``products``: each part alone over the whole batch (the bound an
  overlap could reach is the larger of the two).

It also checks that ``overlap``'s output matches ``serial``'s::

    python bench/overlap_probe.py --num-seqs 256 --context-range 200,2048 --out o.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_bandwidth import copy_bandwidth  # noqa: E402
from graph_timing import capture, time_replays  # noqa: E402
from lmkit_kernels.activation import silu_and_mul  # noqa: E402
from lmkit_kernels.norm import rms_norm  # noqa: E402
from lmkit_kernels.paged_attention import paged_attention, split_counters  # noqa: E402
from lmkit_kernels.random_batch import make_paged_batch  # noqa: E402
from lmkit_kernels.rotary import rotary_qk_  # noqa: E402

#: name: (hidden, heads, kv_heads, head_size, intermediate, layers)
MODELS = {"qwen0.6b": (1024, 16, 8, 128, 3072, 28),
          "llama8b": (4096, 32, 8, 128, 14336, 32)}


class Half:
    """The decode metadata of rows ``[start, end)`` of the batch (views: a decode-only
    batch's query starts are ``0, 1, ..., n`` for any run of its rows)."""

    def __init__(self, batch, start: int, end: int, kv_heads: int) -> None:
        n = end - start
        self.rows = slice(start, end)
        self.qsl = batch.query_start_loc[: n + 1]
        self.seq_lens = batch.seq_lens[start:end]
        self.block_tables = batch.block_tables[start:end]
        self.slots = batch.slot_mapping[start:end]
        self.counters = split_counters(n, kv_heads, "cuda")


class Stack:
    """Random weights of the layer stack, a paged batch, and the step's variants."""

    def __init__(self, model: str, num_seqs: int, contexts: list[int], layers: int) -> None:
        hidden, heads, kv_heads, head, inter, default_layers = MODELS[model]
        self.layers_n = layers or default_layers
        self.dims = (hidden, heads, kv_heads, head)
        g = torch.Generator(device="cuda").manual_seed(0)

        def w(out_f: int, in_f: int) -> torch.Tensor:
            return torch.randn(out_f, in_f, generator=g, device="cuda",
                               dtype=torch.bfloat16) * in_f ** -0.5

        ones = lambda n: torch.ones(n, dtype=torch.bfloat16, device="cuda")  # noqa: E731
        self.params = [{"qkv": w((heads + 2 * kv_heads) * head, hidden),
                        "o": w(hidden, heads * head), "gate_up": w(2 * inter, hidden),
                        "down": w(hidden, inter), "ln1": ones(hidden), "ln2": ones(hidden),
                        "qn": ones(head), "kn": ones(head)} for _ in range(self.layers_n)]
        self.batch = make_paged_batch([(c, 1) for c in contexts], num_heads=heads,
                                      num_kv_heads=kv_heads, head_size=head, block_size=16,
                                      dtype=torch.bfloat16, device="cuda", seed=1)
        self.caches = [self.batch.kv_cache.clone() for _ in range(self.layers_n)]
        self.kv_bytes = sum(contexts) * 2 * kv_heads * head * 2 * self.layers_n
        self.cos = torch.randn(num_seqs, head, device="cuda", generator=g)
        self.sin = torch.randn(num_seqs, head, device="cuda", generator=g)
        self.x = torch.randn(num_seqs, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
        self.whole = Half(self.batch, 0, num_seqs, kv_heads)
        h = num_seqs // 2
        self.halves = (Half(self.batch, 0, h, kv_heads), Half(self.batch, h, num_seqs, kv_heads))
        self.side = torch.cuda.Stream()
        self.side_hi = torch.cuda.Stream(priority=-1)

    # one layer in three parts: before attention, attention, after it
    def pre(self, i: int, x, res, part: Half):
        _, heads, kv_heads, head = self.dims
        p = self.params[i]
        h, res = (rms_norm(x, p["ln1"], 1e-6), x) if res is None else \
            rms_norm(x, p["ln1"], 1e-6, res)
        qkv = F.linear(h, p["qkv"])
        rotary_qk_(qkv, self.cos[part.rows], self.sin[part.rows], num_heads=heads,
                   num_kv_heads=kv_heads, head_size=head, q_norm=p["qn"], k_norm=p["kn"],
                   kv_cache=self.caches[i], slot_mapping=part.slots)
        return qkv, res

    def attend(self, i: int, qkv, part: Half):
        _, heads, kv_heads, head = self.dims
        q = qkv[:, :heads * head].view(-1, heads, head)
        return paged_attention(q, self.caches[i], part.qsl, part.seq_lens, part.block_tables,
                               max_query_len=1, scale=head ** -0.5,
                               split_counters=part.counters)

    def post(self, i: int, attn, res):
        p = self.params[i]
        h = F.linear(attn.reshape(attn.shape[0], -1), p["o"])
        h, res = rms_norm(h, p["ln2"], 1e-6, res)
        return F.linear(silu_and_mul(F.linear(h, p["gate_up"])), p["down"]), res

    def serial(self, part: Half | None = None):
        part = part or self.whole
        x, res = self.x[part.rows], None
        for i in range(self.layers_n):
            qkv, res = self.pre(i, x, res, part)
            x, res = self.post(i, self.attend(i, qkv, part), res)
        return x + res

    def overlap(self, side: torch.cuda.Stream):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        streams = (main, side)
        state = [[self.x[h.rows], None] for h in self.halves]
        done: list[torch.cuda.Event | None] = [None, None]  # last attention of each half
        for i in range(self.layers_n):
            for k, (half, stream) in enumerate(zip(self.halves, streams, strict=True)):
                with torch.cuda.stream(stream):
                    qkv, state[k][1] = self.pre(i, state[k][0], state[k][1], half)
                    other = done[1 - k]
                    if other is not None:  # attention alternates between the halves
                        stream.wait_event(other)
                    attn = self.attend(i, qkv, half)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    done[k] = ev
                    state[k][0], state[k][1] = self.post(i, attn, state[k][1])
        main.wait_stream(side)
        return torch.cat([x + r for x, r in state])

    def attention_only(self):
        qkv = torch.zeros(self.x.shape[0], self.params[0]["qkv"].shape[0],
                          dtype=torch.bfloat16, device="cuda")
        for i in range(self.layers_n):
            out = self.attend(i, qkv, self.whole)
        return out

    def products_only(self):
        x, res = self.x, None
        _, heads, _, head = self.dims
        for i in range(self.layers_n):
            qkv, res = self.pre(i, x, res, self.whole)
            x, res = self.post(i, qkv[:, :heads * head], res)
        return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen0.6b")
    ap.add_argument("--layers", type=int, default=0, help="default: the model's")
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[256])
    ap.add_argument("--context-range", default="200,2048")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("overlap_probe.py needs a CUDA GPU")
    lo, hi = (int(v) for v in args.context_range.split(","))
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    report = []
    for n in args.num_seqs:
        rng = random.Random(n)
        stack = Stack(args.model, n, [rng.randint(lo, hi) for _ in range(n)], args.layers)
        steps = {"serial": stack.serial, "overlap": partial(stack.overlap, stack.side),
                 "overlap-hi": partial(stack.overlap, stack.side_hi),
                 "attention": stack.attention_only, "products": stack.products_only}
        graphs = {name: capture(fn) for name, fn in steps.items()}
        ref, got = graphs["serial"][1].float(), graphs["overlap"][1].float()
        graphs["serial"][0].replay()
        graphs["overlap"][0].replay()
        torch.cuda.synchronize()
        err = ((ref - got).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
        times = time_replays({name: g for name, (g, _) in graphs.items()}, args.rounds,
                             args.replays)
        row = {"num_seqs": n, "kv_gb": stack.kv_bytes / 1e9, "overlap_rel_err": err,
               "ms": {k: statistics.median(v) for k, v in times.items()},
               "spread_ms": {k: [min(v), max(v)] for k, v in times.items()}}
        report.append(row)
        ms = row["ms"]
        print(f"{args.model} x {stack.layers_n} layers, {n} requests, K/V {row['kv_gb']:.1f} "
              f"GB per step; overlap's output vs serial: max rel err {err:.2e}")
        for name, t in ms.items():
            print(f"  {name:12s} {t:7.3f} ms  ({min(times[name]):.3f}-{max(times[name]):.3f})"
                  f"  {ms['serial'] / t:5.3f}x serial")
        del stack, graphs, steps
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"copy_bandwidth": bw, "rows": report}, indent=1))


if __name__ == "__main__":
    main()
