"""Building the effective configuration from its sources.

Precedence, lowest to highest: defaults < file < environment < CLI. Layers are
deep-merged (a layer that sets ``attention.options.x`` keeps the file's other options);
``plugins`` lists add up instead of replacing each other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lmkit.config.errors import format_validation_error, origin_in
from lmkit.config.schema import LMKitConfig
from lmkit.config.sources import Layer, cli_layer, deep_merge, env_layer, file_layer, flatten
from lmkit.errors import ConfigError

# Lists that every layer adds to, in precedence order, rather than replaces.
ADDITIVE_LISTS = ("plugins",)


def load_config(
    config_file: str | Path | None = None,
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    cli_flags: Mapping[str, str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> tuple[LMKitConfig, dict[str, str]]:
    """Load, merge and validate the configuration.

    :param config_file: a ``.yaml``/``.yml`` or ``.toml`` file, or ``None``.
    :param cli: settings from the command line by dotted path, e.g.
        ``{"scheduler.max_num_seqs": 8, "attention.backend": "torch"}``.
    :param env: the environment (``os.environ`` if ``None``); ``LMKIT_<SECTION>__<FIELD>``
        variables are read, see :func:`lmkit.config.sources.env_layer`.
    :param cli_flags: the flag that supplied each ``cli`` path (``{"attention.backend":
        "--attention"}``), so that errors can name it.
    :param base: values below every layer (a whole config's ``model_dump()``, as
        ``LLM(config=LMKitConfig(...), max_num_seqs=8)`` gives), reported as defaults.
    :return: the validated config, and for every leaf setting (dotted path) the layer
        that set it: ``"default"``, ``"file"``, ``"env"`` or ``"cli"``.
    :raises ConfigError: a missing or unparsable file, or invalid values; each problem
        names the field, the bad value, what was expected and where the value came from.
    """
    layers: list[Layer] = [Layer("base", dict(base))] if base is not None else []
    if config_file is not None:
        layers.append(file_layer(config_file))
    layers.append(env_layer(os.environ if env is None else env))
    layers.append(cli_layer(cli or {}, cli_flags))

    merged: dict[str, Any] = {}
    origins: dict[str, tuple[str, str]] = {}
    for layer in layers:
        merged = deep_merge(merged, layer.values)
        origins.update({path: (layer.name, label) for path, label in layer.origins.items()})
    for key in ADDITIVE_LISTS:
        parts = [layer.values[key] for layer in layers if key in layer.values]
        if parts and all(isinstance(p, list) for p in parts):
            merged[key] = [item for part in parts for item in part]

    try:
        config = LMKitConfig.model_validate(merged)
    except ValidationError as e:
        def where(path: str) -> str | None:
            found = origin_in(origins, path)
            return found[1] if found else None

        details = format_validation_error(e, model=LMKitConfig, origin=where)
        raise ConfigError(
            "invalid configuration:\n  " + details.replace("\n", "\n  ")
        ) from None
    config._origins = origins
    provenance = {}
    for path in flatten(config.model_dump()):
        found = origin_in(origins, path)
        provenance[path] = found[0] if found else "default"
    return config, provenance
