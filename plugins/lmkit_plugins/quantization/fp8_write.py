"""Writing a dense model directory as an FP8 checkpoint, in the layouts the ``fp8``
method reads (:mod:`lmkit_plugins.quantization.fp8_checkpoint`): compressed-tensors
(per channel, per tensor or block-wise ``weight_scale``) or transformers' fine-grained
``quant_method: fp8`` (block-wise ``weight_scale_inv``). The projections are quantized;
embeddings, the LM head and norms are copied as they are (what llm-compressor's FP8
schemes do with ``ignore: [lm_head]``). Used by the tests and benchmarks to build FP8
checkpoints of known content (and, :func:`write_dequantized`, the dense models they
stand for); also a way to make one from a local dense model.

    python -m lmkit_plugins.quantization.fp8_write DENSE_DIR OUT_DIR --layout fp8
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from lmkit_plugins.quantization.fp8_checkpoint import PROJECTION

LAYOUTS = ("compressed-tensors", "fp8")
STRATEGIES = ("channel", "tensor", "block")


def quantization_config(layout: str, strategy: str, block: tuple[int, int]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for ``layout`` and ``strategy``."""
    if layout == "fp8":
        if strategy == "channel":
            raise ValueError("quant_method fp8 stores block-wise or per-tensor scales, not "
                             "per-channel ones; use layout compressed-tensors")
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block) if strategy == "block" else None}
    if layout != "compressed-tensors":
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    weights: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": strategy,
                               "symmetric": True, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = list(block)
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": weights,
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": True, "symmetric": True}}}}


def quantize_tensor(weight: torch.Tensor, strategy: str, block: tuple[int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q e4m3, scale)`` of a dense ``weight [out, in]``, the scale as checkpoints
    store it: ``[out, 1]`` per channel, ``[]`` per tensor, the block grid."""
    from lmkit_kernels.fp8 import quantize_per_block, quantize_per_channel

    if strategy == "channel":
        q, scale = quantize_per_channel(weight)
        return q, scale[:, None]
    if strategy == "tensor":  # one row of every value: one scale
        q, scale = quantize_per_channel(weight.reshape(1, -1))
        return q.view(weight.shape), scale.reshape(())
    if strategy == "block":
        return quantize_per_block(weight, block)
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def write_fp8_checkpoint(src: Path, dst: Path, layout: str = "compressed-tensors",
                         strategy: str = "channel", block: tuple[int, int] = (128, 128)
                         ) -> Path:
    """Write ``src`` (a dense safetensors model directory) to ``dst`` as an FP8
    checkpoint (one safetensors file); return ``dst``."""
    from lmkit.api import iterate_weights

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(layout, strategy, block)
    suffix = "weight_scale_inv" if layout == "fp8" else "weight_scale"
    tensors: dict[str, torch.Tensor] = {}
    for name, t in iterate_weights(src):
        if PROJECTION.search(name) and ".experts." not in name:
            q, scale = quantize_tensor(t, strategy, block)
            tensors[name] = q
            tensors[name[: -len("weight")] + suffix] = scale.contiguous()
        else:
            tensors[name] = t.contiguous()
    return _save(src, dst, tensors, config)


def write_dequantized(model_dir: Path, dst: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the dense model the ``fp8`` method's weights for ``model_dir`` stand for:
    every tensor as the method loads it (FP8 checkpoint or dense one quantized at load),
    quantized ones dequantized, in ``dtype``; the reference FP8 runs are compared with.
    """
    from lmkit.api import PluginHost, QuantizedTensor, load_model_facts

    from lmkit_plugins.quantization.fp8_cuda import Fp8Method

    model_dir, dst = Path(model_dir), Path(dst)
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    method = Fp8Method(load_model_facts(model_dir, host))
    tensors = {name: (method.dequantize(w) if isinstance(w, QuantizedTensor) else w)
               .to("cpu", dtype).contiguous() for name, w in method.iterate_weights()}
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    return _save(model_dir, dst, tensors, config)


def _save(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]
          ) -> Path:
    """``dst``: ``tensors`` in one safetensors file, ``config``, and ``src``'s other
    files (tokenizer, generation config)."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a dense safetensors model directory")
    ap.add_argument("dst", type=Path, help="where to write the FP8 checkpoint")
    ap.add_argument("--layout", choices=LAYOUTS, default="compressed-tensors")
    ap.add_argument("--strategy", choices=STRATEGIES, default="channel")
    ap.add_argument("--block", type=int, nargs=2, default=(128, 128))
    args = ap.parse_args(argv)
    write_fp8_checkpoint(args.src, args.dst, args.layout, args.strategy, tuple(args.block))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
