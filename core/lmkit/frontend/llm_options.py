"""Keyword options of ``LLM(...)``: the short names (:data:`SHORT_OPTIONS`) and dotted
config paths they set, turned into a config (:func:`build_config`) with clear errors for
an unknown name or a mapping where a plugin's name belongs."""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

from lmkit.config.schema import LMKitConfig

# Short keyword arguments of LLM(...) and the config paths they set.
SHORT_OPTIONS = {
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "seed": "model.seed",
    "load_format": "model.load_format",
    "tokenizer": "model.tokenizer",
    "block_size": "cache.block_size",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "num_blocks": "cache.num_blocks",
    "kv_cache_memory_gb": "cache.kv_cache_memory_gb",
    "gpu_memory_utilization": "cache.gpu_memory_utilization",
    "kv_cache_dtype": "cache.kv_cache_dtype",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "enable_chunked_prefill": "scheduler.enable_chunked_prefill",
    "scheduler": "scheduler.backend",
    "attention": "attention.backend",
    "executor": "executor.backend",
    "device": "executor.device",
    "enforce_eager": "executor.enforce_eager",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "data_parallel_size": "parallel.data_parallel_size",
    "speculative": "speculative.backend",
    "num_speculative_tokens": "speculative.num_speculative_tokens",
    "speculative_model": "speculative.model",
    "speculative_adaptive": "speculative.adaptive",
    "speculative_tree": "speculative.tree",
    "structured_output": "structured_output.backend",
    "offload": "offload.backend",
    "quantization": "quantization.backend",
    "sampling_kernels": "sampling_kernels.backend",
}


def build_config(model: str | None, config: LMKitConfig | str | Path | None,
                 overrides: Mapping[str, Any]) -> LMKitConfig:
    """A config from a file or object plus keyword overrides (short names or dotted paths)."""
    from lmkit.config.loader import load_config

    cli: dict[str, Any] = {}
    if model is not None:
        cli["model.model"] = model
    for key, value in overrides.items():
        path = SHORT_OPTIONS.get(key, key)
        if "." not in path:
            known = ", ".join(sorted(SHORT_OPTIONS))
            raise TypeError(f"LLM() got an unknown option {key!r}; use a dotted config path "
                            f"(e.g. 'scheduler.max_num_seqs') or one of: {known}."
                            + _option_hint(key))
        if path.endswith(".backend") and isinstance(value, Mapping):
            raise TypeError(_section_mapping_error(key, path, value))
        cli[path] = value
    if isinstance(config, LMKitConfig):  # the keywords override the given config
        cfg, _ = load_config(None, cli, env={}, base=config.model_dump())
        return cfg
    if config is not None and not isinstance(config, (str, PathLike)):
        raise TypeError(f"LLM(config=...) takes an LMKitConfig or the path of a YAML/TOML "
                        f"file, got {type(config).__name__}.")
    cfg, _ = load_config(config, cli, env={})
    return cfg


def _section_mapping_error(key: str, path: str, value: Mapping[str, Any]) -> str:
    """The error for a mapping given to a short option that names a plugin
    (``LLM(speculative={"method": "eagle3", ...})``, vLLM's ``speculative_config`` style):
    which string it takes and where each of the mapping's other settings goes."""
    section = path.rsplit(".", 1)[0]
    related = sorted(name for name, p in SHORT_OPTIONS.items()
                     if p.startswith(section + ".") and name != key)
    where = (f"the section's other settings with {', '.join(f'{n}=...' for n in related)}, "
             if related else "")
    return (f"LLM({key}=...) takes the {section} plugin's name (a string), got a "
            f"{type(value).__name__} with keys {', '.join(map(repr, value))}. Pass the name "
            f"as {key}='NAME', {where}or any setting of the section as a dotted path, e.g. "
            f"**{{'{section}.options': {{...}}}} (see `lmkit config show`).")


def _option_hint(key: str) -> str:
    """`` Did you mean ...?`` for an unknown ``LLM(...)`` keyword: the short option named
    like a CLI flag's short spelling (``spec`` -> ``speculative``), else the closest name."""
    from lmkit.cli.options import FLAGS
    from lmkit.plugin_host.registry import suggest

    by_path = {path: name for name, path in SHORT_OPTIONS.items()}
    for flag in FLAGS:
        if flag.short is not None and flag.short.lstrip("-").replace("-", "_") == key:
            name = by_path.get(flag.path or "")
            if name is not None:
                return f" Did you mean {name!r} (the CLI's {flag.decls[0]})?"
    return suggest(key, SHORT_OPTIONS)
