"""Reading a Hugging Face-style model directory: its ``config.json`` and its
``*.safetensors`` weights, with errors that name the file and say what is wrong."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from lmkit.errors import ModelLoadError

if TYPE_CHECKING:
    import torch
    import transformers

WEIGHTS_GLOB = "*.safetensors"
# a sharded checkpoint's map of tensor name -> file (transformers' save_pretrained)
INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def weight_files(model_dir: Path) -> list[Path]:
    """The weights files of ``model_dir``, sorted by name: the files its
    ``model.safetensors.index.json`` lists when it has one (others, such as a
    ``consolidated.safetensors`` beside the shards, are not read), else every
    ``*.safetensors`` file.

    Raises:
        ModelLoadError: the directory holds no safetensors file, or its index is not a
            JSON ``weight_map`` or lists files that are missing (named).
    """
    model_dir = Path(model_dir)
    if (model_dir / INDEX_NAME).is_file():
        return _indexed_files(model_dir / INDEX_NAME)
    files = sorted(p for p in model_dir.glob(WEIGHTS_GLOB) if p.is_file())
    if not files:
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.gguf"))
        hint = (f" It has {', '.join(others)}: lmkit reads safetensors only; convert with "
                "transformers' save_pretrained(..., safe_serialization=True), or pass the "
                ".gguf file itself as the model.") if others else ""
        raise ModelLoadError(
            f"no weights in {model_dir}: expected one or more *.safetensors files.{hint}"
        )
    return files


def _indexed_files(index: Path) -> list[Path]:
    """The files ``index``'s ``weight_map`` names, each checked to exist."""
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the weights index {index}: {_describe(e)}. "
                             "Fetch the model again.") from e
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if (not isinstance(weight_map, dict) or not weight_map
            or not all(isinstance(f, str) and f for f in weight_map.values())):
        raise ModelLoadError(
            f"the weights index {index} has no weight_map of tensor names to file names "
            "(as save_pretrained writes it); fetch the model again, or delete the index "
            "to load every *.safetensors file in the directory.")
    names = sorted(set(weight_map.values()))
    outside = [n for n in names if Path(n).is_absolute() or ".." in Path(n).parts]
    if outside:
        raise ModelLoadError(f"the weights index {index} names files outside its "
                             f"directory: {', '.join(outside[:5])}.")
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise ModelLoadError(
            f"the weights index {index} lists {len(names)} weights file(s), and "
            f"{len(missing)} of them are missing: {', '.join(missing[:10])}"
            f"{', ...' if len(missing) > 10 else ''}. The download is incomplete; fetch "
            "the model again.")
    return [index.parent / n for n in names]


def checkpoint_size(model_dir: Path) -> tuple[int, int] | None:
    """``(number of tensors, number of elements)`` over the weights files of
    ``model_dir``, from their headers alone (no tensor data is read); ``None`` when it
    has no weights or a file's header cannot be read (loading the weights reports that)."""
    try:
        files = weight_files(model_dir)
    except ModelLoadError:
        return None
    names: set[str] = set()
    elements = 0
    for path in files:
        header = _read_header(path)
        if header is None:
            return None
        for name, info in header.items():
            if name == "__metadata__" or name in names:
                continue
            shape = info.get("shape") if isinstance(info, dict) else None
            if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
                return None
            names.add(name)
            elements += math.prod(shape)
    return len(names), elements


def _read_header(path: Path) -> dict[str, object] | None:
    """The JSON header of a safetensors file, or ``None`` when it is unreadable."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return None
    return header if isinstance(header, dict) else None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def _open(path: Path):
    from safetensors import safe_open

    if path.is_file() and not os.access(path, os.R_OK):
        raise ModelLoadError(f"cannot read weights file {path}: permission denied; make it "
                             "readable by this user (chmod a+r).")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError, OSError, ...
        raise ModelLoadError(
            f"cannot read weights file {path}: {_describe(e)}. The file is corrupt or "
            "truncated (e.g. an interrupted download); delete it and fetch the model again."
        ) from e


def check_weight_files(model_dir: Path) -> list[Path]:
    """Validate the header of every ``*.safetensors`` file in ``model_dir`` and return
    the files. Cheap: the header is parsed and the file size checked against it; no
    tensor data is read.

    Raises:
        ModelLoadError: as :func:`iterate_weights`.
    """
    files = weight_files(model_dir)
    for path in files:
        with _open(path):
            pass
    return files


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every ``*.safetensors`` file in
    ``model_dir`` (files sorted by name, tensors in file order), on the CPU.

    Each file is opened and its header validated before any of its tensors is
    yielded, so a truncated or garbage file fails before a model is half loaded.

    Raises:
        ModelLoadError: there is no weights file, or a file is unreadable, truncated
            or not safetensors, or two files hold a tensor of the same name (a stale
            file left beside a newer download); the message names the files.
    """
    seen: dict[str, Path] = {}
    for path in weight_files(model_dir):
        with _open(path) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name in seen:
                    raise ModelLoadError(
                        f"weight {name!r} is in both {seen[name].name} and {path.name} "
                        f"(in {path.parent}); one of them is stale or belongs to another "
                        "model: remove it, or fetch the model again.")
                seen[name] = path
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(
                        f"cannot read tensor {name!r} from weights file {path}: {_describe(e)}. "
                        "The file is corrupt; delete it and fetch the model again."
                    ) from e
                yield name, tensor


def load_hf_config(model_dir: Path) -> transformers.PretrainedConfig:
    """The model's ``config.json`` as a transformers ``PretrainedConfig``.

    Read with ``AutoConfig.from_pretrained(model_dir, local_files_only=True)``; never
    touches the network.

    Raises:
        ModelLoadError: ``config.json`` is missing, is not JSON, states a size that is
            not a positive integer (:func:`lmkit.loading.config_check.check_sizes`), or
            transformers cannot build a config from it (e.g. an unknown ``model_type``).
    """
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist or is not a directory.")
    if not path.is_file():
        raise ModelLoadError(
            f"{model_dir} has no config.json; a Hugging Face model directory needs config.json, "
            "*.safetensors and tokenizer files."
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot parse {path}: {_describe(e)}.") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, not {type(raw).__name__}.")
    from lmkit.loading.config_check import check_sizes  # (it imports this module)

    check_sizes(raw, path)  # clearer than what transformers says of the same values

    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(
            f"transformers cannot build a config from {path} "
            f"(model_type={raw.get('model_type')!r}): {_describe(e)}."
        ) from e
