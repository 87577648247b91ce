"""KV-cache scales stored in a checkpoint, for an FP8 KV cache.

FP8 checkpoints calibrated for an FP8 cache (llm-compressor's ``kv_cache_scheme``,
NVIDIA ModelOpt) store one key and one value scale per attention layer, named as
:data:`lmkit.api.attention.KV_SCALE_SUFFIXES` says: ``model.layers.N.self_attn.k_scale``
/ ``v_scale`` (older exports: ``...self_attn.k_proj.output_scale`` /
``v_proj.output_scale``). The cache then stores
``k / k_scale``, as lmkit's FP8 cache does. A scale given per KV head is reduced to its
largest value (every head then stays within e4m3's range).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from lmkit.api.attention import KV_SCALE_SUFFIXES
from lmkit.errors import ModelLoadError
from lmkit.loading.weights import WEIGHTS_GLOB

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _kv_scale_of(key: str) -> tuple[int, str] | None:
    """``(layer, "k" or "v")`` of a tensor named as a KV-cache scale, else ``None``."""
    for i, suffix in enumerate(KV_SCALE_SUFFIXES):  # key, value, key, value
        if key.endswith("." + suffix):
            m = _LAYER.search(key)
            return (int(m.group(1)), "kv"[i % 2]) if m else None
    return None


def read_kv_scales(model_dir: Path) -> dict[int, tuple[float, float]]:
    """``{layer: (k_scale, v_scale)}`` for every layer whose key and value scales the
    checkpoint's safetensors files hold (empty when there are none, or the directory is
    not a safetensors checkpoint).

    Raises:
        ModelLoadError: a scale that is not a positive finite number, or a layer with a
            key scale and no value scale (or the reverse).
    """
    from safetensors import safe_open

    found: dict[int, dict[str, float]] = {}
    for path in sorted(Path(model_dir).glob(WEIGHTS_GLOB)):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                which = _kv_scale_of(key)
                if which is None:
                    continue
                value = float(f.get_tensor(key).float().max())
                if not math.isfinite(value) or value <= 0:
                    raise ModelLoadError(f"{path.name}: KV-cache scale {key} is {value}; "
                                         "scales must be positive and finite")
                found.setdefault(which[0], {})[which[1]] = value
    partial = sorted(layer for layer, kv in found.items() if len(kv) != 2)
    if partial:
        raise ModelLoadError(f"{model_dir}: the checkpoint's KV-cache scales of layer "
                             f"{partial[0]} have a key or a value scale but not both")
    return {layer: (kv["k"], kv["v"]) for layer, kv in sorted(found.items())}
