"""Reading a Hugging Face-style model directory: its ``config.json`` and its
``*.safetensors`` weights, with errors that name the file and say what is wrong."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from lmkit.errors import ModelLoadError

if TYPE_CHECKING:
    import torch
    import transformers

WEIGHTS_GLOB = "*.safetensors"


def weight_files(model_dir: Path) -> list[Path]:
    """The ``*.safetensors`` files of ``model_dir``, sorted by name.

    Raises:
        ModelLoadError: the directory holds no safetensors file.
    """
    model_dir = Path(model_dir)
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


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def _open(path: Path):
    from safetensors import safe_open

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
            or not safetensors; the message names the file and the reason.
    """
    for path in weight_files(model_dir):
        with _open(path) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
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
        ModelLoadError: ``config.json`` is missing, is not JSON, or transformers
            cannot build a config from it (e.g. an unknown ``model_type``).
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

    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(
            f"transformers cannot build a config from {path} "
            f"(model_type={raw.get('model_type')!r}): {_describe(e)}."
        ) from e
