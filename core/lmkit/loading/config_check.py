"""Checking a model's ``config.json`` before anything is built from it: the sizes a
model plugin allocates with must be positive integers that fit together, and must fit
the weights files, so that a wrong or hostile config is one clear error naming the field
instead of a failed multi-terabyte allocation or an ``IndexError`` deep in a plugin.

:func:`check_model_config` runs in :func:`lmkit.loading.model_facts.load_model_facts`,
before any model class sees the config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmkit.errors import ModelLoadError
from lmkit.loading.weights import checkpoint_size

# config.json keys that size tensors: when present (and not null), a positive integer
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "head_dim", "moe_intermediate_size")


def check_model_config(hf_config: Any, model_dir: Path, check_weights: bool = True) -> None:
    """Refuse a config whose ``architectures`` is not a list of names, whose sizes
    (:data:`SIZE_FIELDS`) are not positive integers or do not divide (attention heads by
    key/value heads, the hidden size by the heads when ``head_dim`` is not stated), or
    that describes a model larger than its weights files can hold (a layer count above
    their tensor count; an embedding ``vocab_size x hidden_size`` or an MLP weight
    ``intermediate_size x hidden_size`` above their element count). The last check reads
    only the safetensors headers, and is skipped when ``check_weights`` is false (random
    weights), the directory has no (readable) weights, or it declares a
    ``quantization_config`` (packed weights hold fewer elements).

    Raises:
        ModelLoadError: naming ``config.json``, the field, its value and what is allowed.
    """
    path = Path(model_dir) / "config.json"
    values = hf_config.to_dict()
    archs = values.get("architectures")
    if archs is not None and (not isinstance(archs, (list, tuple))
                              or not all(isinstance(a, str) for a in archs)):
        raise ModelLoadError(
            f"{path}: architectures must be a list of class names, e.g. "
            f'["LlamaForCausalLM"], not {archs!r}.')
    stated = _stated_keys(path)
    sizes = check_sizes(values, path, stated)
    if check_weights and not isinstance(values.get("quantization_config"), dict):
        _check_fits_weights(path, sizes, stated)


def check_sizes(values: dict[str, Any], path: Path, stated: set[str] | None = None
                ) -> dict[str, int]:
    """The :data:`SIZE_FIELDS` that ``values`` (a config as a dict) states, checked to be
    positive integers that divide as attention needs; ``stated``: the keys the file
    itself holds (``None``: all of them), to name a default as one.

    Raises:
        ModelLoadError: naming ``path``, the field and its value.
    """
    sizes: dict[str, int] = {}
    for key in SIZE_FIELDS:
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelLoadError(
                f"{path}: {_field(key, value, stated)} must be a positive integer.")
        sizes[key] = value
    _check_heads(path, sizes, stated)
    return sizes


def _check_heads(path: Path, sizes: dict[str, int], stated: set[str] | None) -> None:
    heads, kv_heads = sizes.get("num_attention_heads"), sizes.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise ModelLoadError(
            f"{path}: {_field('num_attention_heads', heads, stated)} is not a multiple of "
            f"{_field('num_key_value_heads', kv_heads, stated)}; each key/value head serves "
            "a whole group of attention heads.")
    hidden = sizes.get("hidden_size")
    if heads and hidden and "head_dim" not in sizes and hidden % heads:
        raise ModelLoadError(
            f"{path}: {_field('hidden_size', hidden, stated)} does not divide by "
            f"{_field('num_attention_heads', heads, stated)}, and head_dim is not stated; "
            "state head_dim or fix the sizes.")


def _check_fits_weights(path: Path, sizes: dict[str, int], stated: set[str] | None) -> None:
    counts = checkpoint_size(path.parent)
    if counts is None:
        return
    num_tensors, num_elements = counts
    held = f"the weights files in {path.parent} hold"
    layers = sizes.get("num_hidden_layers")
    if layers and layers > num_tensors:
        raise ModelLoadError(
            f"{path}: {_field('num_hidden_layers', layers, stated)} is more layers than "
            f"{held} tensors ({num_tensors}); config.json does not belong to these weights.")
    hidden = sizes.get("hidden_size")
    for key, what in (("vocab_size", "the token embedding"),
                      ("intermediate_size", "one MLP weight")):
        other = sizes.get(key)
        if hidden and other and other * hidden > num_elements:
            raise ModelLoadError(
                f"{path}: {_field(key, other, stated)} x "
                f"{_field('hidden_size', hidden, stated)} makes {what} alone "
                f"{other * hidden:,} elements, more than {held} together "
                f"({num_elements:,}); config.json does not belong to these weights.")


def _stated_keys(path: Path) -> set[str] | None:
    """The keys ``config.json`` itself states (``None`` when unreadable), to tell a value
    read from the file from a default transformers filled in."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return set(raw) if isinstance(raw, dict) else None


def _field(key: str, value: Any, stated: set[str] | None) -> str:
    if stated is None or key in stated:
        return f"{key}={value!r}"
    return f"{key}={value!r} (a default: config.json does not state it)"
