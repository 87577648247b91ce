"""A decode step's kernel chain, replayed from CUDA graphs under several kernel settings
in one process.

The chain is what the Llama family runs on CUDA for one token per request: per layer the
QKV projection (bf16 at one row: with the residual add + RMSNorm folded in), RoPE + cache
write, decode attention over ``--context`` tokens, the output projection, the gate-up
projection (folded norm at one row; SwiGLU in its epilogue where
:func:`lmkit_plugins.models.fused_ops.glu_epilogue` says so), the down projection; then
the final norm, the LM head and an argmax. ``--rows N`` runs it for ``N`` requests
(above :data:`lmkit_plugins.models.fused_ops.FOLD_MAX_ROWS` the norms are separate
kernels, as in the model). ``--weights fp8`` runs the FP8 path instead (separate
RMSNorm and SiLU folded into the one-row FP8 GEMV as the model runs them,
:mod:`lmkit_kernels.fp8_gemv_fold`; ``--fp8-lm-head`` quantizes the LM head too).

A setting is ``default`` or ``NAME=VALUE[,NAME=VALUE...]``. Names other than the ones
below are environment variables read when the kernels launch (``LMKIT_PDL=0``,
``LMKIT_PDL_PREFETCH=2``, ``LMKIT_GEMV_FOLD=0``, ``LMKIT_GLU_EPILOGUE=0``,
``LMKIT_GEMV_WIDE_TILES=0``, ``LMKIT_DECODE_MERGE_AT_ONCE=0``, ...). The chain's own:

* ``TILES=BN/BK/WARPS/STAGES``: the bf16 GEMVs' (and their folds') launch for every
  projection instead of :func:`lmkit_plugins.models.fused_ops.small_m_tiles` /
  ``narrow_tiles``; ``TILES<N>=...`` for the projections of ``N`` outputs only
  (``TILES28672=64/256/8/3``: Llama-8B's gate-up);
* ``FP8_TILES=BN/BK/WARPS`` and ``FP8_PIPE=1``: the one-row FP8 kernel's launch and its
  pipelined variant;
* ``SPLITS=N``: decode attention cuts each context into ``N`` slices instead of
  :func:`lmkit_kernels.paged_attention.choose_num_splits`' count; ``ATILES=BN/WARPS/
  STAGES``: its tiles (``decode_tiles``);
* ``SKIP=KIND[+KIND...]``: kernels of those kinds left out (``norm``: the separate
  RMSNorms, ``rope``: RoPE + cache write, ``attn``: decode attention, ``head``: the final
  norm, LM head and argmax), so the difference to ``default`` is what they cost inside
  the chain, launch gaps included.

One CUDA graph is captured per setting, and the graphs replay in interleaved rounds (A,
B, C, A, B, C, ...). The report gives each setting's median step time, its spread, and
the weight bytes per step over that time::

    python bench/decode_chain.py --settings LMKIT_PDL=0 LMKIT_PDL=1 \\
        LMKIT_PDL=1,LMKIT_PDL_PREFETCH=2 --out chain.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmkit_plugins.models.fused_ops as fused_ops
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_bandwidth import copy_bandwidth  # noqa: E402
from graph_timing import capture, time_replays  # noqa: E402
from lmkit_kernels.activation import silu_and_mul  # noqa: E402
from lmkit_kernels.fp8 import quantize_per_channel  # noqa: E402
from lmkit_kernels.fp8_gemv import ROW_TILES, fp8_row_linear  # noqa: E402
from lmkit_kernels.fp8_gemv_fold import (  # noqa: E402
    norm_fp8_row_linear,
    silu_mul_fp8_row_linear,
)
from lmkit_kernels.gemv import small_m_linear  # noqa: E402
from lmkit_kernels.norm import rms_norm  # noqa: E402
from lmkit_kernels.paged_attention import paged_attention, split_counters  # noqa: E402
from lmkit_kernels.random_batch import make_paged_batch  # noqa: E402
from lmkit_kernels.rotary import rotary_qk_  # noqa: E402
from lmkit_plugins.models.fused_ops import GemvFold  # noqa: E402

#: the FP8 one-row launch of the setting being captured (FP8_TILES / FP8_PIPE)
FP8_LAUNCH: dict[str, object] = {}

#: decode attention's launch of the setting being captured (SPLITS, ATILES)
ATTENTION: dict[str, object] = {}

#: the kernel kinds the setting being captured leaves out (SKIP)
SKIP: set[str] = set()
SKIP_KINDS = ("norm", "rope", "attn", "head")

#: name: (hidden, heads, kv_heads, head_size, intermediate, vocab)
MODELS = {"llama8b": (4096, 32, 8, 128, 14336, 128256),
          "qwen0.6b": (1024, 16, 8, 128, 3072, 151936),
          "smollm2": (576, 9, 3, 64, 1536, 49152)}


def parse_setting(text: str) -> dict[str, str]:
    """``"A=1,B=2"`` -> ``{"A": "1", "B": "2"}``; ``"default"`` -> ``{}``."""
    if text == "default":
        return {}
    pairs = [p.split("=", 1) for p in text.split(",")]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise SystemExit(f"a setting is NAME=VALUE[,NAME=VALUE...] or 'default'; got {text!r}")
    return dict(pairs)


def launch_ints(name: str, text: str, count: int) -> tuple[int, ...]:
    """``"64/256/8/3"`` -> ``(64, 256, 8, 3)``: ``count`` positive integers joined by
    ``/``, the value of setting ``name``; anything else ends the run with a message."""
    parts = text.split("/")
    if len(parts) != count or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"{name} takes {count} positive integers joined by '/'; got {text!r}")
    return tuple(int(p) for p in parts)


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block (``TILES`` patches the GEMV launch
    parameters instead), then restore what was there."""
    values = dict(values)
    tiles = values.pop("TILES", None)
    by_size = {int(k[5:]): v for k, v in list(values.items())
               if k.startswith("TILES") and k[5:].isdigit()}
    for n in by_size:
        values.pop(f"TILES{n}")
    bn, bk, warps = launch_ints("FP8_TILES", values.pop("FP8_TILES", "/".join(
        map(str, ROW_TILES))), 3)
    FP8_LAUNCH.clear()
    FP8_LAUNCH.update(block_n=bn, block_k=bk, num_warps=warps,
                      pipeline=values.pop("FP8_PIPE", "0") == "1")
    splits = values.pop("SPLITS", None)
    ATTENTION.clear()
    if splits is not None:
        ATTENTION["num_splits"] = launch_ints("SPLITS", splits, 1)[0]
    tiles_attn = values.pop("ATILES", None)
    if tiles_attn is not None:
        ATTENTION["decode_tiles"] = launch_ints("ATILES", tiles_attn, 3)
    SKIP.clear()
    SKIP.update(k for k in values.pop("SKIP", "").split("+") if k)
    if SKIP - set(SKIP_KINDS):
        raise SystemExit(f"SKIP takes {'+'.join(SKIP_KINDS)}; got {sorted(SKIP)}")
    saved = {k: os.environ.get(k) for k in values}
    original, original_narrow = fused_ops.small_m_tiles, fused_ops.narrow_tiles
    if tiles is not None or by_size:
        def launch(name: str, text: str) -> dict[str, int]:
            bn, bk, warps, stages = launch_ints(name, text, 4)
            return {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}

        fixed = {n: launch(f"TILES{n}", t) for n, t in by_size.items()}
        every = launch("TILES", tiles) if tiles is not None else None
        fused_ops.small_m_tiles = lambda out_features: fixed.get(  # type: ignore[assignment]
            out_features, every or original(out_features))
        fused_ops.narrow_tiles = lambda out_features: fixed.get(  # type: ignore[assignment]
            out_features, every or original_narrow(out_features))
    os.environ.update(values)
    GemvFold.tiles.cache_clear()  # the folds' launch, cached per size, follows the patch
    try:
        yield
    finally:
        fused_ops.small_m_tiles = original  # type: ignore[assignment]
        fused_ops.narrow_tiles = original_narrow  # type: ignore[assignment]
        GemvFold.tiles.cache_clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Chain:
    """Random weights of ``layers`` decoder layers and the step's inputs, and the step."""

    def __init__(self, model: str, layers: int, context: int, weights: str,
                 fp8_lm_head: bool, rows: int = 1) -> None:
        hidden, heads, kv_heads, head, inter, vocab = MODELS[model]
        self.dims = (hidden, heads, kv_heads, head)
        g = torch.Generator(device="cuda").manual_seed(0)
        self.fp8 = weights == "fp8"

        def w(out_features: int, in_features: int, fp8: bool) -> tuple:
            t = torch.randn(out_features, in_features, generator=g, device="cuda",
                            dtype=torch.bfloat16) * in_features ** -0.5
            return quantize_per_channel(t) if fp8 else (t, None)

        qkv = (heads + 2 * kv_heads) * head
        self.layers = [{"qkv": w(qkv, hidden, self.fp8), "o": w(hidden, heads * head, self.fp8),
                        "gate_up": w(2 * inter, hidden, self.fp8),
                        "down": w(hidden, inter, self.fp8),
                        "ln1": torch.ones(hidden, dtype=torch.bfloat16, device="cuda"),
                        "ln2": torch.ones(hidden, dtype=torch.bfloat16, device="cuda")}
                       for _ in range(layers)]
        self.lm_head = w(vocab, hidden, self.fp8 and fp8_lm_head)
        self.norm = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
        self.weight_bytes = sum(t.numel() * t.element_size() for p in self.layers
                                for t, _ in (p["qkv"], p["o"], p["gate_up"], p["down"]))
        self.weight_bytes += self.lm_head[0].numel() * self.lm_head[0].element_size()
        self.rows = rows
        self.batch = make_paged_batch([(context, 1)] * rows, num_heads=heads,
                                      num_kv_heads=kv_heads, head_size=head, block_size=16,
                                      dtype=torch.bfloat16, device="cuda", seed=1)
        self.caches = torch.stack([self.batch.kv_cache] * layers)
        self.counters = split_counters(rows, kv_heads, "cuda")
        self.cos = torch.randn(rows, head, device="cuda", generator=g)
        self.sin = torch.randn(rows, head, device="cuda", generator=g)
        self.x = torch.randn(rows, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
        self.fold = GemvFold()

    def _linear(self, x: torch.Tensor, wt: tuple) -> torch.Tensor:
        weight, scale = wt
        if scale is not None:
            return fp8_row_linear(x, weight, scale, **FP8_LAUNCH)
        return small_m_linear(x, weight, None, **fused_ops.small_m_tiles(weight.shape[0]))

    def step(self) -> torch.Tensor:
        """One decode step over all layers; returns the argmax token (a device tensor)."""
        hidden, heads, kv_heads, head = self.dims
        batch, x, residual = self.batch, self.x, None
        fold = os.environ.get("LMKIT_GEMV_FOLD", "1")  # 1, 0, or the one fold kept
        if self.rows > fused_ops.FOLD_MAX_ROWS:  # as the model: separate kernels
            fold = "0"
        norm_fold, silu_fold = fold in ("1", "norm"), fold in ("1", "silu_mul")
        # bf16 only: as the model decides (one wave of programs at most)
        glu = fused_ops.glu_epilogue(self.x.device, torch.bfloat16,
                                     self.layers[0]["gate_up"][0].shape[0])
        for i, p in enumerate(self.layers):
            if self.fp8 and norm_fold:
                qkv, residual = norm_fp8_row_linear(x, residual, p["ln1"], 1e-5, *p["qkv"],
                                                    **FP8_LAUNCH)
            elif self.fp8:
                if residual is None:
                    h, residual = rms_norm(x, p["ln1"], 1e-5), x
                else:
                    h, residual = rms_norm(x, p["ln1"], 1e-5, residual)
                qkv = self._linear(h, p["qkv"])
            elif norm_fold:
                qkv, residual = self.fold.norm_linear(x, residual, p["ln1"], 1e-5,
                                                      p["qkv"][0], None)
            else:
                h, residual = self._norm(x, p["ln1"], residual)
                qkv = self._linear(h, p["qkv"])
            if "rope" not in SKIP:
                rotary_qk_(qkv, self.cos, self.sin, num_heads=heads, num_kv_heads=kv_heads,
                           head_size=head, kv_cache=self.caches[i],
                           slot_mapping=batch.slot_mapping)
            q = qkv[:, :heads * head]
            attn = q if "attn" in SKIP else paged_attention(
                q.view(self.rows, heads, head), self.caches[i], batch.query_start_loc,
                batch.seq_lens, batch.block_tables, max_query_len=1, scale=head ** -0.5,
                split_counters=self.counters, **ATTENTION)
            h = self._linear(attn.reshape(self.rows, heads * head), p["o"])
            if self.fp8:
                if norm_fold:
                    gate_up, residual = norm_fp8_row_linear(h, residual, p["ln2"], 1e-5,
                                                            *p["gate_up"], **FP8_LAUNCH)
                else:
                    h, residual = rms_norm(h, p["ln2"], 1e-5, residual)
                    gate_up = self._linear(h, p["gate_up"])
                x = silu_mul_fp8_row_linear(gate_up, *p["down"], **FP8_LAUNCH) if silu_fold \
                    else self._linear(silu_and_mul(gate_up), p["down"])
            elif glu:  # SwiGLU in the gate-up kernel's epilogue
                if norm_fold:
                    act, residual = self.fold.norm_linear(h, residual, p["ln2"], 1e-5,
                                                          p["gate_up"][0], None, glu_out=True)
                else:
                    h, residual = self._norm(h, p["ln2"], residual)
                    act = fused_ops.glu_small_m_linear(h, p["gate_up"][0], None)
                x = self._linear(act, p["down"])
            else:
                if norm_fold:
                    gate_up, residual = self.fold.norm_linear(h, residual, p["ln2"], 1e-5,
                                                              p["gate_up"][0], None)
                else:
                    h, residual = self._norm(h, p["ln2"], residual)
                    gate_up = self._linear(h, p["gate_up"])
                x = self.fold.silu_mul_linear(gate_up, p["down"][0], None) if silu_fold \
                    else self._linear(silu_and_mul(gate_up), p["down"])
        if "head" in SKIP:
            return x
        h, _ = rms_norm(x, self.norm, 1e-5, residual)
        return self._linear(h, self.lm_head).argmax(dim=-1)

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The separate (residual add +) RMSNorm: ``(normed, residual)``; with ``norm`` in
        :data:`SKIP`, ``x`` itself (and ``x`` as the residual)."""
        if "norm" in SKIP:
            return x, x
        if residual is None:
            return rms_norm(x, weight, 1e-5), x
        return rms_norm(x, weight, 1e-5, residual)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=256, help="tokens in the cache")
    ap.add_argument("--rows", type=int, default=1, help="decode rows (requests), at most 16")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--fp8-lm-head", action="store_true")
    ap.add_argument("--settings", nargs="+", default=["LMKIT_PDL=0", "default"],
                    help="NAME=VALUE[,NAME=VALUE...] per setting, or 'default'")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--replays", type=int, default=20, help="graph replays per round")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_chain.py needs a CUDA GPU")
    settings = [(s, parse_setting(s)) for s in args.settings]
    if not 1 <= args.rows <= 16:
        raise SystemExit(f"--rows takes 1-16 (the weight-streaming kernel's rows); got {args.rows}")
    chain = Chain(args.model, args.layers, args.context, args.weights, args.fp8_lm_head,
                  args.rows)
    graphs = {}
    for name, env in settings:
        with environment(env):
            graphs[name], _ = capture(chain.step)
    times = time_replays(graphs, args.rounds, args.replays)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"{args.model} x {args.layers} layers, {args.weights} weights "
          f"({chain.weight_bytes / 1e9:.2f} GB per step), {args.rows} row(s), "
          f"context {args.context}")
    rows = []
    for name, _ in settings:
        ms = statistics.median(times[name])
        frac = chain.weight_bytes / (ms * 1e-3) / bw
        rows.append({"setting": name, "median_ms": ms, "min_ms": min(times[name]),
                     "max_ms": max(times[name]), "bw_frac": frac})
        print(f"  {name:48s} {ms:7.3f} ms  ({min(times[name]):.3f}-{max(times[name]):.3f})"
              f"  weights at {100 * frac:5.1f}% of copy bandwidth")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "copy_bandwidth": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
