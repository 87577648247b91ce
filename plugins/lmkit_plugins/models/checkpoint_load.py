"""Loading a model's checkpoint tensors by name: each HF tensor name maps to a loader
that copies (or splits, or fuses) it into the model's parameters; tensors the model
needs but the checkpoint lacks, and tensors the model does not know, are one error."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from lmkit.api import ModelLoadError

Loader = Callable[[torch.Tensor], None]


def load_named_weights(targets: dict[str, Loader],
                       weights: Iterable[tuple[str, torch.Tensor]],
                       key_of: Callable[[str], str], ignored: Callable[[str], bool]
                       ) -> set[str]:
    """Run ``targets[key_of(name)]`` on every checkpoint tensor; return the keys loaded.

    :param key_of: the target key of a checkpoint name (e.g. a prefix dropped).
    :param ignored: keys without a target that are skipped rather than unexpected.
    :raises ModelLoadError: a dense tensor is not floating point (an integer, boolean
        or complex tensor where the model keeps weights), a loader refused a tensor
        (shape), or tensors are missing or unexpected (:func:`describe_mismatch`).
    """
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        key = key_of(name)
        load = targets.get(key)
        if load is None:
            if not ignored(key):
                unexpected.append(name)
            continue
        if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
            raise ModelLoadError(
                f"weight {name}: the checkpoint stores it as {tensor.dtype}, but model "
                "weights are floating point (float32, bfloat16, float16, float8); the file "
                "is corrupt, or holds quantized weights that config.json does not declare "
                "(quantization_config).")
        try:
            load(tensor)
        except ValueError as e:
            raise ModelLoadError(f"weight {name}: {e}") from e
        loaded.add(key)
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        raise ModelLoadError(describe_mismatch(missing, unexpected))
    return loaded


def describe_mismatch(missing: list[str], unexpected: list[str], limit: int = 12) -> str:
    """The error for a checkpoint that does not match the model built from config.json."""
    def listing(names: list[str]) -> str:
        shown = ", ".join(names[:limit])
        return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")

    parts = ["the checkpoint does not match the model built from config.json:"]
    if missing:
        parts.append(f"missing {len(missing)} weight(s): {listing(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} weight(s): {listing(unexpected)}")
    parts.append("Check that config.json belongs to these weights (architecture, layer count, "
                 "tie_word_embeddings).")
    return "\n  ".join(parts)
