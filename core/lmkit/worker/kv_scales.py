"""The per-layer scales of an FP8 KV cache: the checkpoint's, or measured at load.

``cache.kv_cache_scales`` chooses (only with ``cache.kv_cache_dtype: fp8``):

* ``auto`` (the default): the checkpoint's calibrated scales when it has them
  (:mod:`lmkit.loading.kv_scales`), else 1.0 (vLLM's default without calibrated scales);
* ``calibrate``: measured at load, whatever the checkpoint holds;
* ``none``: 1.0 everywhere, whatever the checkpoint holds.

Measuring runs one prefill of :data:`CALIBRATION_TOKENS` random token ids (fixed seed)
through the model on a scratch cache, records the largest key and value magnitude each
layer stores, and sets ``scale = amax / 448`` (e4m3's largest value), so that no layer
saturates at 448 (keys or values far above it with scales 1.0) or leaves its values to
e4m3's subnormals (far below 1). It is not the default because on the default model
(SmolLM2-135M, CPU, float32 weights; keys up to 10-19, values 0.5-15 per layer) it
measured no better than scales 1.0: the held text's perplexity over the float32 cache's
34.10 was 34.37 with scales 1.0 and 34.30-34.46 with scales measured over 32-512
tokens (``bench/kv_cache_quality.py``). Larger magnitudes met later are saturated to
+-448. A draft head's own cache keeps scales 1.0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmkit.api.attention import FP8_KV_MAX
from lmkit.api.kv_cache_spec import KVCacheGroup
from lmkit.worker.dummy_steps import DummyStepModel, dummy_step

logger = logging.getLogger(__name__)

#: the calibration prefill's length (capped by the step budget and max_model_len)
CALIBRATION_TOKENS = 512


def set_kv_cache_scales(mode: str, groups: tuple[KVCacheGroup, ...], model_dir: Path,
                        runner: Callable[[], DummyStepModel], vocab_size: int) -> None:
    """Set the FP8 cache's per-layer scales on ``groups``' backends as ``mode`` says
    (see the module docstring); nothing for a cache that is not FP8. ``runner`` gives
    the dummy-step view of the model runner (called only when measuring)."""
    if mode == "none" or not any(g.attn.fp8_kv_cache for g in groups):
        return
    if mode == "calibrate":
        scales, source = measure_kv_scales(runner(), vocab_size), "measured"
    else:
        from lmkit.loading.kv_scales import read_kv_scales

        scales, source = read_kv_scales(model_dir), "the checkpoint's"
    if not scales:
        return
    for group in groups:
        group.attn.layer_kv_scales.update(
            {layer: scales[layer] for layer in group.layers if layer in scales})
    ks, vs = zip(*scales.values(), strict=True)
    logger.info("FP8 KV cache: %s scales for %d layers (keys %.3g-%.3g, values %.3g-%.3g)",
                source, len(scales), min(ks), max(ks), min(vs), max(vs))


def measure_kv_scales(runner: DummyStepModel, vocab_size: int, seed: int = 0
                      ) -> dict[int, tuple[float, float]]:
    """``{layer: (k_scale, v_scale)}``: each layer's largest stored key and value
    magnitude over one prefill of random tokens, over 448 (1.0 where a layer stored
    only zeros)."""
    amax: dict[int, list[torch.Tensor]] = {}
    patched: list[Any] = []
    for group in runner.kv_groups:
        attn = group.attn
        run = attn.run

        def recording(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: torch.Tensor, _run: Any = run, **kw: Any) -> torch.Tensor:
            amax.setdefault(layer, []).append(torch.stack(
                (k.detach().abs().amax().float(), v.detach().abs().amax().float())))
            return _run(layer, q, k, v, kv_cache, **kw)

        attn.run = recording  # type: ignore[method-assign]
        patched.append(attn)
    try:
        n = max(1, min(CALIBRATION_TOKENS, runner.scheduler.max_num_batched_tokens,
                       runner.max_model_len))
        gen = np.random.default_rng(seed)
        dummy_step(runner, np.array([n]), np.array([0]),
                   token_ids=gen.integers(0, vocab_size, n).tolist())
    finally:
        for attn in patched:
            del attn.run
    scales = {}
    for layer, values in sorted(amax.items()):
        k, v = torch.stack(values).amax(dim=0).tolist()
        scales[layer] = (k / FP8_KV_MAX if k > 0 else 1.0, v / FP8_KV_MAX if v > 0 else 1.0)
    return scales
