"""Logit error of FP8 weights against bf16 on teacher forcing, on the Llama-3.1-8B shape.

The model is transformers' Llama with random weights drawn as the GPU benchmark draws
them (``N(0, 0.02)``, unit norms; :mod:`gpu_bench_models`), or the copy-circuit
model of tests/gpu (``--model copy-circuit``: its argmax is decided by a wide margin,
so agreement measures the kernels rather than ties). Its bf16 logits over random
token sequences are the reference. Then every projection (q/k/v/o, gate/up/down) is
replaced by lmkit's FP8 product over the same weights quantized per channel
(:class:`lmkit_plugins.quantization.fp8_cuda.Fp8Linear`), and the same sequences are
scored two ways:

* ``prefill``: one forward over each whole sequence (more than 16 rows: activations
  quantized per token, ``torch._scaled_mm``, W8A8);
* ``decode``: the first half prefilled, then one token per step for the whole batch
  (at most 16 rows: the weight-only Triton GEMV), scoring the decoded positions.

Reported per path: max and mean absolute logit error, the relative error
``|l_fp8 - l_bf16| / |l_bf16|`` per position (mean, max), argmax agreement with bf16,
and, as the floor, bf16's own agreement with and error against float32
(``--no-fp32-floor`` skips it; it needs the float32 model in memory).

    python bench/fp8_logit_error.py --out fp8_logits.json               # 32 layers
    python bench/fp8_logit_error.py --layers 4 --model copy-circuit
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Fp8Projection(nn.Module):
    """An ``nn.Linear`` replaced by lmkit's FP8 product over its weight, quantized per
    channel: ``[..., in] -> [..., out]``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from lmkit_kernels.fp8 import quantize_per_channel
        from lmkit_plugins.quantization.fp8_checkpoint import Fp8Weight
        from lmkit_plugins.quantization.fp8_cuda import Fp8Linear

        self.fn = Fp8Linear(Fp8Weight(*quantize_per_channel(linear.weight)), max_rows=16,
                            block_k=512)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fn(x.reshape(-1, x.shape[-1]), self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])


def build_model(name: str, num_layers: int, seed: int, device: str = "cuda") -> nn.Module:
    """transformers' Llama-3.1-8B-shaped model in bf16 with ``num_layers`` layers:
    random as the benchmark's, or the copy circuit of tests/gpu (``tiny-llama``: the
    benchmark's toy Llama, for ``--smoke``)."""
    from transformers import AutoModelForCausalLM

    if name == "copy-circuit":
        sys.path.insert(0, str(BENCH.parent / "tests" / "gpu"))
        from copy_circuit_model import copy_circuit_weights, llama_config

        config = llama_config(num_layers)
        weights = copy_circuit_weights(config, device, seed)
    else:
        import gpu_bench_models as models

        config = models.hf_config("tiny-llama" if name == "tiny-llama" else "llama-3.1-8b",
                                  num_layers)
        weights = None
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if weights is not None:
                p.copy_(weights[pname])
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=gen)
    return model.eval()


@torch.no_grad()  # the weights require grad: quantizing them must not record a graph
def swap_projections(model: nn.Module, fp8: bool, saved: dict[str, nn.Module]) -> None:
    """Replace every projection by :class:`Fp8Projection` (``fp8``), or put the saved
    bf16 ones back."""
    for layer_idx, layer in enumerate(model.model.layers):
        for block in (layer.self_attn, layer.mlp):
            for proj in PROJECTIONS:
                if not hasattr(block, proj):
                    continue
                key = f"{layer_idx}.{proj}"
                if fp8:
                    saved[key] = getattr(block, proj)
                    setattr(block, proj, Fp8Projection(saved[key]))
                else:
                    setattr(block, proj, saved.pop(key))


@torch.inference_mode()
def prefill_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """float32 ``[S, T, V]``: one forward per sequence (``[1, T]``)."""
    return torch.stack([model(ids[i:i + 1]).logits[0].float() for i in range(ids.shape[0])])


@torch.inference_mode()
def decode_logits(model: nn.Module, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """float32 ``[S, T - prefix, V]``: ``ids[:, :prefix]`` prefilled, then one token per
    step for the whole batch; the logits after each of the tokens ``prefix - 1 ..``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(ids[:, :prefix], past_key_values=cache, use_cache=True)
    rows = [out.logits[:, -1].float()]
    for t in range(prefix, ids.shape[1] - 1):
        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        rows.append(out.logits[:, -1].float())
    return torch.stack(rows, dim=1)


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Error statistics of logits ``got`` against ``ref`` (both ``[..., V]``)."""
    diff = (got - ref).abs()
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    return {"positions": int(ref[..., 0].numel()), "max_abs_error": float(diff.max()),
            "mean_abs_error": float(diff.mean()), "mean_relative_error": float(rel.mean()),
            "max_relative_error": float(rel.max()),
            "argmax_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
            "reference_logit_std": float(ref.std())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (Llama-8B: 32)")
    ap.add_argument("--model", choices=("random", "copy-circuit"), default="random")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--length", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fp32-floor", action="store_true",
                    help="skip bf16's own error against float32")
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    ap.add_argument("--smoke", action="store_true",
                    help="a toy Llama on the CPU (the FP8 products' torch references)")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU of compute capability 8.9+ (FP8); or --smoke")
    t0 = time.perf_counter()
    model = build_model("tiny-llama" if args.smoke else args.model, args.layers, args.seed,
                        device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, min(vocab, 10000), (args.sequences, args.length),
                        generator=g).to(device)
    prefix = args.length // 2
    report: dict[str, Any] = {
        "bench": "fp8_logit_error", "smoke": args.smoke,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "torch": torch.__version__, "model": args.model, "layers": args.layers,
        "sequences": args.sequences, "length": args.length, "decode_prefix": prefix}
    ref = prefill_logits(model, ids)
    saved: dict[str, nn.Module] = {}
    swap_projections(model, True, saved)
    report["prefill_w8a8"] = compare(prefill_logits(model, ids), ref)
    report["decode_weight_only"] = compare(decode_logits(model, ids, prefix), ref[:, prefix - 1:-1])
    swap_projections(model, False, saved)
    report["bf16_decode_vs_bf16_prefill"] = compare(decode_logits(model, ids, prefix),
                                                    ref[:, prefix - 1:-1])
    if not args.no_fp32_floor:
        ref32 = prefill_logits(model.float(), ids)
        report["bf16_vs_fp32_floor"] = compare(ref, ref32)
    report["wall_s"] = time.perf_counter() - t0
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
