"""Reading a configuration file (YAML or TOML, chosen by extension), keeping the line
each key was written on so that errors can point at it."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

from lmkit.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

YAML_SUFFIXES = (".yaml", ".yml")
TOML_SUFFIXES = (".toml",)


def read_config_file(path: str | Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Parse a configuration file.

    :return: the nested values, and the line (1-based) of each dotted key path where
        it could be found.
    :raises ConfigError: the file is missing, unreadable, not YAML/TOML by extension,
        not parsable, or its top level is not a mapping.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give a .yaml, .yml or "
                          ".toml file.")
    suffix = path.suffix.lower()
    if suffix not in YAML_SUFFIXES + TOML_SUFFIXES:
        raise ConfigError(
            f"config file {str(path)!r} has an unknown extension {suffix or '(none)'!r}; "
            "use .yaml, .yml or .toml."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from None
    if suffix in YAML_SUFFIXES:
        data, lines = _read_yaml(path, text)
    else:
        data, lines = _read_toml(path, text)
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of sections "
            f"(model:, scheduler:, ...), not a {type(data).__name__}."
        )
    return data, lines


def _read_yaml(path: Path, text: str) -> tuple[Any, dict[str, int]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}: {problem}.") from None
    lines: dict[str, int] = {}
    if node is not None:
        _yaml_lines(path, node, "", lines)
    return data, lines


def _yaml_lines(file: Path, node: yaml.Node, prefix: str, out: dict[str, int]) -> None:
    """The line of each key path under ``node``; a key given twice in one mapping is an
    error (YAML forbids it, and PyYAML would silently keep the last value)."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        key, line = str(key_node.value), key_node.start_mark.line + 1
        if key in seen and key != "<<":
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(f"config file {str(file)!r} sets {where!r} twice (lines "
                              f"{seen[key]} and {line}); keep one.")
        seen[key] = line
        path = f"{prefix}.{key}" if prefix else key
        out[path] = line
        _yaml_lines(file, value_node, path, out)


_TOML_TABLE = re.compile(r"^\s*\[+\s*([^\]]+?)\s*\]+")
_TOML_KEY = re.compile(r"^\s*([A-Za-z0-9_.\"' -]+?)\s*=")


def _read_toml(path: Path, text: str) -> tuple[Any, dict[str, int]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}.") from None
    return data, _toml_lines(text)


def _toml_lines(text: str) -> dict[str, int]:
    """Best-effort line numbers for ``[table]`` headers and ``key = value`` lines (tomllib
    keeps none). Keys inside inline tables or multi-line values are not found."""
    lines: dict[str, int] = {}
    table = ""
    for number, line in enumerate(text.splitlines(), start=1):
        if m := _TOML_TABLE.match(line):
            table = _toml_dotted(m.group(1))
            lines.setdefault(table, number)
        elif m := _TOML_KEY.match(line):
            key = _toml_dotted(m.group(1))
            lines.setdefault(f"{table}.{key}" if table else key, number)
    return lines


def _toml_dotted(key: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in key.split("."))
