"""FP8 checkpoints in the layouts Hugging Face and vLLM use, and dense checkpoints
quantized at load, read as per-output-channel e4m3 weights.

``config.json``'s ``quantization_config`` says which layout (:func:`read_layout`):

* none: a dense checkpoint; the projections (``*.{q,k,v,o,gate,up,down}_proj.weight``
  outside mixture-of-experts blocks) are quantized at load
  (:func:`lmkit_kernels.fp8.quantize_per_channel`), everything else stays dense;
* ``quant_method: compressed-tensors`` (llm-compressor, ``float-quantized``): float8
  ``<module>.weight`` with ``<module>.weight_scale``, per channel ``[out, 1]``, per
  tensor (one value) or, for the ``block`` strategy, ``[ceil(out / bn), ceil(in /
  bk)]``; ``W = q * scale``. Modules the config ignores are stored dense and stay dense;
* ``quant_method: fp8`` (transformers' fine-grained FP8, as DeepSeek-V3 ships):
  float8 ``<module>.weight`` with ``<module>.weight_scale_inv`` (despite the name,
  ``W = q * scale_inv``), block-wise ``[ceil(out / 128), ceil(in / 128)]`` for
  ``weight_block_size: [128, 128]``, one value without a block size.

Per-tensor scales become per-channel ones exactly (the value repeated). Block-wise
scales cannot be expressed per channel: such weights are dequantized (float32) and
quantized again per channel, which rounds each value a second time (see
docs/quantization.md for the error this adds). Static activation scales
(``input_scale``) are ignored: activations are always quantized per token. KV-cache
scales (``k_scale``, ``v_scale``) are not weights: the runner reads them for an FP8 KV
cache (:mod:`lmkit.loading.kv_scales`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lmkit.api import KV_SCALE_SUFFIXES, ModelLoadError, QuantizedTensor

QTYPE = "F8_E4M3"  # QuantizedTensor.qtype: e4m3 weights with float32 per-channel scales
FLOAT_DTYPES = ("F32", "BF16", "F16")  # dense tensors and scales
#: the dense projections quantized at load: every Linear of the Llama-family blocks
PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
# static activation scales (per-token ones are used) and KV-cache scales (read by the
# runner for an FP8 cache, lmkit.loading.kv_scales)
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", *KV_SCALE_SUFFIXES)


@dataclass(frozen=True)
class Fp8Weight:
    """:attr:`QuantizedTensor.data` of an FP8 weight: ``weight [out, in]``
    float8_e4m3fn and ``scale [out]`` float32, ``W = weight * scale[:, None]``."""

    weight: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class Fp8Layout:
    """How a checkpoint stores FP8 weights (see the module docstring).

    ``source``: ``"dense"``, ``"compressed-tensors"`` or ``"fp8"``; ``scale_suffix``:
    the scale tensor's name after ``<module>.``; ``block``: the ``[rows, cols]`` of
    block-wise scales the config declares, else ``None``."""

    source: str
    scale_suffix: str = "weight_scale"
    block: tuple[int, int] | None = None

    def describe(self) -> str:
        """E.g. ``compressed-tensors (block 128x128)`` for error messages."""
        return self.source + (f" (block {self.block[0]}x{self.block[1]})" if self.block else "")


@dataclass(frozen=True)
class TensorHeader:
    """One tensor of a safetensors header: its file, dtype (``"F8_E4M3"``) and shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_layout(model_dir: Path) -> Fp8Layout:
    """The FP8 layout ``config.json`` declares (``dense`` when it declares none).

    :raises ModelLoadError: a quantization the fp8 method does not read (another
        method, integer or 4-bit weights, e5m2, group-wise scales), saying which."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    quant = config.get("quantization_config")
    if not quant:
        return Fp8Layout("dense")
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        fmt = str(quant.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise _unreadable(path, f"quant_method fp8 with fmt {fmt!r}")
        block = quant.get("weight_block_size")
        return Fp8Layout("fp8", "weight_scale_inv", _block(path, block) if block else None)
    if method == "compressed-tensors":
        return Fp8Layout("compressed-tensors", "weight_scale", _ct_block(path, quant))
    raise _unreadable(path, f"quant_method {method!r}")


def _ct_block(path: Path, quant: dict[str, Any]) -> tuple[int, int] | None:
    """The block size of a compressed-tensors config's FP8 groups (``None``: per
    channel or per tensor), after checking every group stores float8 weights."""
    blocks = set()
    for name, group in (quant.get("config_groups") or {}).items():
        w = (group or {}).get("weights") or {}
        kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
        if kind != "float" or bits != 8:
            raise _unreadable(path, f"compressed-tensors group {name!r} with {bits}-bit "
                              f"{kind} weights")
        if strategy not in ("channel", "tensor", "block"):
            raise _unreadable(path, f"compressed-tensors group {name!r} with {strategy!r} "
                              "weight scales (the fp8 method reads channel, tensor and "
                              "block scales)")
        if strategy == "block":
            blocks.add(_block(path, w.get("block_structure")))
    if len(blocks) > 1:
        raise _unreadable(path, f"compressed-tensors groups of several block sizes {blocks}")
    return blocks.pop() if blocks else None


def _block(path: Path, value: Any) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise ModelLoadError(f"{path}: a block size must be two positive integers "
                             f"[rows, cols], got {value!r}")
    return int(value[0]), int(value[1])


def _unreadable(path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path} declares {what}; the fp8 quantization method reads float8 e4m3 weights "
        "with per-channel, per-tensor or block-wise scales (compressed-tensors "
        "float-quantized, or quant_method fp8), or quantizes a dense checkpoint at load. "
        "Run this checkpoint with an engine that reads its quantization, or use a dense "
        "or FP8 copy of the model.")


def read_headers(files: list[Path]) -> dict[str, TensorHeader]:
    """Every tensor's header (no tensor data is read) over the safetensors ``files``."""
    from safetensors import safe_open

    headers: dict[str, TensorHeader] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                part = f.get_slice(name)
                headers[name] = TensorHeader(path, part.get_dtype(), tuple(part.get_shape()))
    return headers


def plan_weights(headers: dict[str, TensorHeader], layout: Fp8Layout) -> dict[str, str]:
    """``{fp8 weight name: its scale's name}`` after checking every tensor's header.

    :raises ModelLoadError: naming the tensor and its file: a dtype the method does not
        read, an FP8 weight without its scale (or in a checkpoint that declares no FP8
        layout), a scale without an FP8 weight, a scale whose dtype is not float or whose
        shape fits neither per-channel, per-tensor nor the declared block scales, an FP8
        tensor that is not a 2-D ``.weight``, FP8 mixture-of-experts weights, zero points.
    """
    suffix = "." + layout.scale_suffix
    for name, h in headers.items():  # dtypes first: the plainest reason
        if h.dtype not in FLOAT_DTYPES + ("F8_E4M3",) and not name.endswith(IGNORED_SUFFIXES):
            raise ModelLoadError(
                f"tensor {name!r} in {h.file} has dtype {h.dtype}; the fp8 method reads "
                f"F8_E4M3 weights with {'/'.join(FLOAT_DTYPES)} scales and "
                f"{'/'.join(FLOAT_DTYPES)} tensors (checkpoint layout: {layout.describe()}). "
                "Convert the checkpoint, or run it with --quantization none if it is dense.")
    plan: dict[str, str] = {}
    for name, h in headers.items():
        where = f"tensor {name!r} in {h.file}"
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name.endswith("_zero_point"):
            raise ModelLoadError(f"{where} is a zero point: asymmetric FP8 weights are not "
                                 "supported (the fp8 method reads symmetric scales only)")
        if name.endswith(suffix):
            weight = name[: -len(suffix)] + ".weight"
            if weight not in headers or headers[weight].dtype != "F8_E4M3":
                have = headers[weight].dtype if weight in headers else "missing"
                raise ModelLoadError(f"{where} is a weight scale, but {weight!r} is not an "
                                     f"F8_E4M3 weight ({have}); the file is malformed")
            continue
        if h.dtype == "F8_E4M3":
            plan[name] = _checked_scale(name, h, headers, layout, where)
    return plan


def _checked_scale(name: str, h: TensorHeader, headers: dict[str, TensorHeader],
                   layout: Fp8Layout, where: str) -> str:
    if layout.source == "dense":
        raise ModelLoadError(f"{where} is F8_E4M3, but config.json declares no "
                             "quantization_config saying where its scales are; add the "
                             "checkpoint's quantization_config (compressed-tensors or fp8)")
    if len(h.shape) != 2 or not name.endswith(".weight"):
        raise ModelLoadError(f"{where}: F8_E4M3 tensors must be 2-D '.weight' matrices, "
                             f"got shape {list(h.shape)}")
    if ".experts." in name:
        raise ModelLoadError(f"{where}: FP8 mixture-of-experts weights are not supported "
                             "yet (only the attention and dense MLP projections)")
    scale_name = name[: -len("weight")] + layout.scale_suffix
    scale = headers.get(scale_name)
    if scale is None:
        raise ModelLoadError(f"{where} is F8_E4M3 but its scale {scale_name!r} is missing "
                             f"(layout {layout.describe()}); the checkpoint is incomplete")
    if scale.dtype not in FLOAT_DTYPES:
        raise ModelLoadError(f"tensor {scale_name!r} in {scale.file} has dtype "
                             f"{scale.dtype}; weight scales must be {'/'.join(FLOAT_DTYPES)}")
    allowed = scale_shapes(h.shape, layout.block)  # type: ignore[arg-type]
    if scale.shape not in allowed:
        raise ModelLoadError(
            f"tensor {scale_name!r} in {scale.file} has shape {list(scale.shape)}; for the "
            f"weight of shape {list(h.shape)} a scale is one of "
            f"{', '.join(str(list(s)) for s in allowed)} (per channel, per tensor"
            + (f", blocks of {layout.block[0]}x{layout.block[1]})" if layout.block else ")"))
    return scale_name


def scale_shapes(shape: tuple[int, int], block: tuple[int, int] | None
                 ) -> list[tuple[int, ...]]:
    """The scale shapes accepted for a weight of ``shape``: per channel ``[out, 1]`` or
    ``[out]``, per tensor ``[]``, ``[1]`` or ``[1, 1]``, and the block grid when given."""
    out, cols = shape
    shapes: list[tuple[int, ...]] = [(out, 1), (out,), (), (1,), (1, 1)]
    if block is not None:
        shapes.append((math.ceil(out / block[0]), math.ceil(cols / block[1])))
    return shapes


def to_per_channel(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
                   ) -> Fp8Weight:
    """A checkpoint's FP8 ``weight [out, in]`` and ``scale`` as per-channel
    :class:`Fp8Weight` (on ``weight``'s device): per-tensor and per-channel scales
    exactly, block-wise ones by dequantizing and quantizing again per channel.

    :raises ModelLoadError: the scales are not finite and positive."""
    from lmkit_kernels.fp8 import quantize_per_channel

    out, cols = weight.shape
    s = scale.to(weight.device, torch.float32)
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError("weight scales must be finite and positive")
    if s.numel() == 1:
        return Fp8Weight(weight.contiguous(), s.reshape(1).expand(out).contiguous())
    if s.shape[0] == out and (s.dim() == 1 or s.shape[1] == 1):
        return Fp8Weight(weight.contiguous(), s.reshape(out).contiguous())
    assert block is not None, "plan_weights admits block scales only with a block size"
    grid = s.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :cols]
    return Fp8Weight(*quantize_per_channel(weight.float() * grid))


def quantize_dense(weight: torch.Tensor) -> Fp8Weight:
    """A dense float ``weight [out, in]`` quantized per channel (on its device)."""
    from lmkit_kernels.fp8 import quantize_per_channel

    return Fp8Weight(*quantize_per_channel(weight))


def quantized(data: Fp8Weight) -> QuantizedTensor:
    """``data`` as the :class:`QuantizedTensor` the model's layers receive."""
    return QuantizedTensor(data, QTYPE, tuple(data.weight.shape))  # type: ignore[arg-type]


def iterate_fp8(tensors: Iterator[tuple[str, torch.Tensor]], plan: dict[str, str],
                layout: Fp8Layout, device: torch.device, quantize_lm_head: bool = False
                ) -> Iterator[tuple[str, Any]]:
    """``(hf_name, tensor)`` for the checkpoint's ``tensors``: FP8 weights (paired with
    their scales, in whatever order the files hold them), for a dense checkpoint the
    projections, and with ``quantize_lm_head`` a dense ``lm_head.weight``, as
    :class:`QuantizedTensor` on ``device``; the rest as stored.

    :raises ModelLoadError: a scale that is not finite and positive."""
    scale_of = {s: w for w, s in plan.items()}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        key = name if name in plan else scale_of.get(name)
        if key is None:
            if (layout.source == "dense" and PROJECTION.search(name)
                    and ".experts." not in name) or (quantize_lm_head
                                                     and name == "lm_head.weight"):
                yield name, quantized(quantize_dense(t.to(device)))
            else:
                yield name, t
            continue
        parts = pending.setdefault(key, {})
        parts["weight" if name == key else "scale"] = t
        if len(parts) == 2:
            del pending[key]
            try:
                data = to_per_channel(parts["weight"].to(device), parts["scale"], layout.block)
            except ValueError as e:
                raise ModelLoadError(f"weight {key!r}: {e}; the checkpoint is corrupt") from e
            yield key, quantized(data)
    if pending:  # plan_weights saw both halves of each pair: only a file changing under us
        raise ModelLoadError(f"weights without their scales after reading every file: "
                             f"{sorted(pending)[:5]}")
