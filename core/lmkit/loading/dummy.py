"""Random weights from ``config.json`` alone (``model.load_format: dummy``, as vLLM's).

For benchmarks and tests of shapes no checkpoint on the machine holds (a 70B-shaped
model needs 140 GB of files that a test machine's disk may not have): the tensors a
checkpoint of the configured architecture would hold (names and shapes from a
meta-device instance of transformers' model class, so no memory is allocated), drawn
on the loading device: matrices from N(0, 0.02), biases 0, other vectors (norm
weights) 1. Each tensor's generator is seeded from the model seed and the tensor's
name, so every tensor-parallel rank draws the same full tensor before taking its
shard, and the weights do not depend on the order they are loaded in.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import torch

from lmkit.errors import ModelLoadError


def checkpoint_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """HF checkpoint tensor names and shapes of ``hf_config``'s model (tied LM heads
    omitted; MoE experts by expert, as checkpoints and lmkit's loaders name them).

    Raises:
        ModelLoadError: transformers does not know the architecture.
    """
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, ImportError) as e:
        arch = ", ".join(getattr(hf_config, "architectures", None) or ["?"])
        raise ModelLoadError(
            f"load_format dummy takes the tensor names and shapes from transformers' model "
            f"of the architecture ({arch}), which it cannot build: {e}; use the checkpoint "
            "(load_format auto)") from e
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        shapes.update(_per_expert(name, tuple(t.shape)))
    if getattr(hf_config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def _per_expert(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """transformers 5 holds a MoE layer's experts stacked (``experts.gate_up_proj
    [E, 2I, H]``, ``experts.down_proj [E, H, I]``); checkpoints name each expert's."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj"):
        return {name: shape}
    experts, rows, cols = shape
    if leaf == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": (rows, cols) for e in range(experts)}
    return {f"{prefix}.{e}.{proj}.weight": (rows // 2, cols) for e in range(experts)
            for proj in ("gate_proj", "up_proj")}


def dummy_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str, seed: int = 0) -> torch.Tensor:
    """The random tensor ``name`` gets (see the module docstring)."""
    if len(shape) == 1:
        fill = 0.0 if name.endswith("bias") else 1.0
        return torch.full(shape, fill, dtype=dtype, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)


def dummy_weights(hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                  seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of a checkpoint of ``hf_config``,
    drawn on ``device`` one at a time (the loader copies or shards each)."""
    for name, shape in checkpoint_shapes(hf_config).items():
        yield name, dummy_tensor(name, shape, dtype, device, seed)
