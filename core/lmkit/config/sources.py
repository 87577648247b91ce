"""The layers a configuration is built from: a file, the environment and CLI flags.

Each layer is a nested mapping of the values it sets plus, for every dotted path it
sets, a label saying where the value came from. :mod:`lmkit.config.loader` merges the
layers (CLI > environment > file > defaults) and validates the result.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from lmkit.config.errors import field_annotation
from lmkit.config.files import read_config_file
from lmkit.config.schema import LMKitConfig
from lmkit.errors import ConfigError

ENV_PREFIX = "LMKIT_"
ENV_NESTING = "__"
# Single-name variables that configure a setting (the rest, such as LMKIT_PLUGINS,
# LMKIT_DISABLE_PLUGIN_AUTOLOAD or LMKIT_CACHE, mean other things and are ignored here).
ENV_ALIASES = {"LMKIT_API_KEY": "server.api_key"}


@dataclass
class Layer:
    """Values set by one source.

    ``values`` is nested like the config (``{"scheduler": {"max_num_seqs": 8}}``);
    ``origins`` maps each dotted path the layer sets to a human label such as
    ``"environment variable LMKIT_SCHEDULER__MAX_NUM_SEQS"``.
    """

    name: str  # "file" | "env" | "cli"
    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)

    def set(self, path: str, value: Any, origin: str) -> None:
        """Set the value at a dotted path, merging into mappings already set."""
        set_path(self.values, path.split("."), value)
        self.origins[path] = origin
        if isinstance(value, Mapping):
            for sub in flatten(value, path):
                self.origins[sub] = origin


def set_path(target: dict[str, Any], keys: list[str], value: Any) -> None:
    """``target[k0][k1]...[kn] = value``, creating (or merging into) mappings on the way."""
    for key in keys[:-1]:
        child = target.get(key)
        if not isinstance(child, dict):
            child = target[key] = {}
        target = child
    last = keys[-1]
    if isinstance(value, dict) and isinstance(target.get(last), dict):
        target[last] = deep_merge(target[last], value)
    else:
        target[last] = value


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; any other value in ``top`` replaces the one in ``base``."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Leaf values by dotted path; an empty mapping and any list are leaves."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


# ------------------------------------------------------------------------------ values


class _TextLoader(yaml.SafeLoader):
    """YAML scalars as YAML 1.2 reads them: only true/false are booleans (not yes/no/on/off)."""


_TextLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_TextLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


def parse_text_value(path: str, raw: str) -> Any:
    """The value of a setting given as text (an environment variable, ``--set K=V``).

    Text fields (``model.model``, ``server.api_key``, ...) keep the text as written;
    anything else is read as a YAML value, so ``8`` is a number, ``true`` a boolean,
    ``null`` nothing and ``{"x": 1}`` a mapping.
    """
    if _is_text_field(path):
        return raw
    try:
        return yaml.load(raw, Loader=_TextLoader)  # a SafeLoader subclass: no object tags
    except yaml.YAMLError:
        return raw


def _is_text_field(path: str) -> bool:
    """Whether the field at ``path`` holds text: ``str``, ``str | None`` or a Literal of
    strings (``None`` is allowed; lists, numbers and mappings are not text)."""
    annotation = field_annotation(LMKitConfig, path.split("."))
    if annotation is None:
        return False
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = [a for a in (typing.get_args(annotation) if union else (annotation,))
               if a is not type(None)]
    return bool(members) and all(
        a is str or (typing.get_origin(a) is typing.Literal
                     and all(isinstance(v, str) for v in typing.get_args(a)))
        for a in members
    )


# ------------------------------------------------------------------------------ layers


def file_layer(path: str | Path) -> Layer:
    """The layer a YAML or TOML file sets (see :func:`read_config_file`)."""
    values, lines = read_config_file(path)
    layer = Layer("file", values)
    for dotted in flatten(values):
        line = _nearest_line(dotted, lines)
        layer.origins[dotted] = f"config file {str(path)!r}" + (f", line {line}" if line else "")
    return layer


def _nearest_line(path: str, lines: Mapping[str, int]) -> int | None:
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        line = lines.get(".".join(parts[:n]))
        if line is not None:
            return line
    return None


def env_layer(env: Mapping[str, str]) -> Layer:
    """The layer set by ``LMKIT_<SECTION>__<FIELD>[__<KEY>...]`` variables.

    Names are case-insensitive; ``LMKIT_API_KEY`` sets ``server.api_key``. Values are
    read with :func:`parse_text_value`.
    """
    layer = Layer("env")
    for name in sorted(env):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        if upper in ENV_ALIASES:
            path = ENV_ALIASES[upper]
        elif ENV_NESTING in upper:
            parts = upper[len(ENV_PREFIX):].lower().split(ENV_NESTING)
            if not all(parts):
                raise ConfigError(
                    f"environment variable {name} is not a valid setting name; use "
                    "LMKIT_<SECTION>__<FIELD>, e.g. LMKIT_SCHEDULER__MAX_NUM_SEQS=8."
                )
            path = ".".join(parts)
        else:
            continue
        # sorted order: LMKIT_API_KEY comes before (and yields to) LMKIT_SERVER__API_KEY
        layer.set(path, parse_text_value(path, env[name]), f"environment variable {name}")
    return layer


def cli_layer(cli: Mapping[str, Any], flags: Mapping[str, str] | None = None) -> Layer:
    """The layer set by CLI flags or by a program (``LLM(max_num_seqs=8)``): ``cli`` maps
    dotted paths to values (already typed; ``--set`` values go through
    :func:`parse_text_value` first). ``flags`` names the flag that set each path, for
    error messages; paths without one were set by the calling program."""
    layer = Layer("cli")
    for path, value in cli.items():
        if isinstance(value, BaseModel):
            value = value.model_dump()
        flag = (flags or {}).get(path)
        if not isinstance(path, str) or not all(path.split(".")):
            raise ConfigError(
                f"{flag + ': ' if flag else ''}{path!r} is not a setting name; use a dotted path "
                "of non-empty names, e.g. scheduler.max_num_seqs.")
        layer.set(path, value, f"command-line option {flag}" if flag else f"explicit setting {path}")
    return layer
