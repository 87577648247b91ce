"""Attention backends as pytest parameters for the GPU tests: each optional one skips,
with the registry's reasons, where it cannot run (library not installed, wrong device)."""

from __future__ import annotations

import pytest
from lmkit.api import PluginHost

OPTIONAL = ("flashinfer", "flash_attn")


def unavailable(name: str) -> str:
    """Why attention backend ``name`` cannot run here ("" when it can)."""
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return "; ".join(host.registry.get("attention", name).spec.unavailable_reasons())


def backend_params(*names: str) -> list:
    """``names`` as parameters; the optional backends skip with the reason they cannot run."""
    params = []
    for name in names:
        reason = unavailable(name) if name in OPTIONAL else ""
        params.append(pytest.param(name, marks=pytest.mark.skipif(
            bool(reason), reason=f"{name}: {reason}")))
    return params
