"""Converting a GGUF file, once, into a cached Hugging Face safetensors directory.

transformers reads the GGUF (architecture, hyper-parameters, tokenizer, chat template)
and dequantizes its weights to float32; the model is saved with ``save_pretrained``
(safetensors, ``config.json`` with ``architectures`` set, ``generation_config.json``),
the tokenizer beside it, and the GGUF file itself as ``model.gguf`` (98 MB for the
default model), which quantization methods read to keep its blocks packed
(:func:`weight_format`). The result lives in ``<cache>/converted/<stem>-<fp>/`` where
``fp`` is the first 16 hex digits of :func:`lmkit.loading.cache.file_fingerprint`, so a
second load only checks the entry's marker file.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from pathlib import Path

from packaging.version import Version

from lmkit.api.model_facts import DENSE_WEIGHT_FORMAT
from lmkit.errors import ModelLoadError, ModelNotFoundError
from lmkit.loading.cache import (
    atomic_entry,
    default_cache_dir,
    file_fingerprint,
    is_complete,
    temp_dir,
)
from lmkit.loading.gguf_check import check_gguf_file
from lmkit.loading.progress import announce, library_progress, step

CONVERTED = "converted"
GGUF_MAGIC = b"GGUF"
GGUF_NAME = "model.gguf"  # the GGUF file kept beside its conversion


def weight_format(model_dir: Path) -> str:
    """The format a quantization method must read: ``"gguf"`` when ``model_dir`` keeps
    its GGUF file (:data:`GGUF_NAME`); else the ``quant_method`` its ``config.json``
    declares in ``quantization_config`` (``"compressed-tensors"``, ``"fp8"``, ...),
    lower-cased; else ``"safetensors"`` (dense weights)."""
    if (Path(model_dir) / GGUF_NAME).is_file():
        return "gguf"
    return declared_quant_method(Path(model_dir) / "config.json") or DENSE_WEIGHT_FORMAT


def declared_quant_method(config_path: Path) -> str | None:
    """``quantization_config.quant_method`` of a ``config.json`` (lower-cased), or
    ``None`` when it declares none (or cannot be read: loading reports that)."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method is None:
        return None
    return str(method).strip().lower() or None


def _keep_gguf(gguf_path: Path, dest: Path) -> None:
    """Put the GGUF file at ``dest`` (a hard link when on the same filesystem), through a
    temporary name so that a crash never leaves a partial file under ``dest``'s name."""
    tmp = dest.with_name(f".{dest.name}.part")
    tmp.unlink(missing_ok=True)
    try:
        os.link(gguf_path, tmp)
    except OSError:
        shutil.copyfile(gguf_path, tmp)
    os.replace(tmp, dest)


def converted_path(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where the conversion of ``gguf_path`` lives (whether or not it exists yet)."""
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    fingerprint = file_fingerprint(gguf_path)[:16]
    return cache_dir / CONVERTED / f"{gguf_path.stem}-{fingerprint}"


def convert_gguf_to_safetensors(gguf_path: Path, cache_dir: Path | None = None,
                                progress: bool = True) -> Path:
    """Return the cached safetensors directory for ``gguf_path``, converting it first if
    this file has not been converted before.

    Args:
        gguf_path: the ``.gguf`` file.
        cache_dir: lmkit's cache directory (default :func:`default_cache_dir`).
        progress: show status lines and transformers' progress bars on stderr.

    Raises:
        ModelNotFoundError: the file does not exist.
        ModelLoadError: it is not a GGUF file, it is truncated or corrupt
            (:func:`lmkit.loading.gguf_check.check_gguf_file`), or transformers cannot
            convert it (e.g. an architecture its GGUF support does not cover).
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf_path} does not exist.")
    with gguf_path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{gguf_path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
            "the file is corrupt or truncated, or it is not a GGUF model."
        )
    entry = converted_path(gguf_path, cache_dir)
    if is_complete(entry):
        if not (entry / GGUF_NAME).is_file():  # converted by an older lmkit
            _keep_gguf(gguf_path, entry / GGUF_NAME)
        return entry
    check_gguf_file(gguf_path)  # a corrupt file fails here, before transformers reads it

    announce(f"converting {gguf_path.name} to safetensors in {entry} (once; later loads "
             "reuse it)", progress)
    start = time.perf_counter()
    metadata = {
        "source": str(gguf_path),
        "source_size": gguf_path.stat().st_size,
        "fingerprint": entry.name.rsplit("-", 1)[-1],
        "python": platform.python_version(),
    }
    with atomic_entry(cache_dir, entry, metadata) as staging, library_progress(progress):
        metadata.update(_convert(gguf_path, staging, cache_dir, progress))
        _keep_gguf(gguf_path, staging / GGUF_NAME)
        metadata["convert_seconds"] = round(time.perf_counter() - start, 2)
    announce(f"converted {gguf_path.name} in {metadata['convert_seconds']:.1f} s", progress)
    return entry


def _convert(gguf_path: Path, out_dir: Path, cache_dir: Path, progress: bool = False
             ) -> dict[str, str]:
    """Load ``gguf_path`` with transformers and save it as safetensors into ``out_dir``,
    reporting each phase (see :func:`lmkit.loading.progress.step`) if ``progress``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers looks for config.json beside the GGUF first; a clean directory that
    # holds only a link to the file makes it read the GGUF's own metadata.
    link_dir = temp_dir(cache_dir, "gguf-link-")
    try:
        link = link_dir / gguf_path.name
        os.symlink(gguf_path, link)
        kwargs = {"gguf_file": gguf_path.name, "local_files_only": True}
        # transformers renamed torch_dtype to dtype in 4.56
        dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        try:
            # transformers draws its own bars for the tensors: no spinner over them
            with step("building the model from the GGUF tensors (float32)", progress,
                      spinner=False):
                model = AutoModelForCausalLM.from_pretrained(
                    str(link_dir), quantization_config=_dequantize_config(),
                    **{dtype_kw: torch.float32}, **kwargs)
            with step("building the tokenizer from the GGUF metadata", progress):
                tokenizer = AutoTokenizer.from_pretrained(str(link_dir), **kwargs)
        except Exception as e:
            raise ModelLoadError(
                f"transformers {transformers.__version__} cannot convert {gguf_path}: "
                f"{type(e).__name__}: {str(e).rstrip('.')}. Only architectures that "
                "transformers' GGUF support covers can be converted; alternatively pass a "
                "Hugging Face directory."
            ) from e
    finally:
        shutil.rmtree(link_dir, ignore_errors=True)  # removes the link, not the GGUF

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # transformers >= 5 keeps a GGUF "quantizer" even when dense
        quantizer.remove_quantization_config(model)
    packed = [n for n, t in model.state_dict().items() if not t.is_floating_point()]
    if packed:
        raise ModelLoadError(
            f"transformers left {len(packed)} weights of {gguf_path} packed (e.g. {packed[0]}); "
            "lmkit needs dense weights. Uninstall the `kernels` package or upgrade lmkit."
        )
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    model.config.architectures = architectures  # engines pick their model class by it
    with step("writing the safetensors weights", progress, spinner=False):  # has its bar
        model.save_pretrained(str(out_dir))
    with step("writing the tokenizer", progress):
        tokenizer.save_pretrained(str(out_dir))
    return {"architecture": architectures[0],
            "transformers": transformers.__version__}


def _dequantize_config():
    """A GgufConfig asking for dense weights, where this transformers has one."""
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:  # transformers 4.x always dequantizes GGUF weights
        return None
    return GgufConfig(dequantize=True)
