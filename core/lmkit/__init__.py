"""lmkit: a plugin-framework SDK for LLM inference backends.

``from lmkit import LLM, SamplingParams`` for offline use; ``lmkit.hookimpl`` for plugins.
Importing lmkit is cheap: torch and every backend library load only when used.
"""

from __future__ import annotations

from typing import Any

from lmkit.api.sampling_params import SamplingParams
from lmkit.plugin_host.hookspecs import hookimpl, hookspec
from lmkit.version import PLUGIN_API_VERSION, __version__


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from lmkit.frontend.llm import LLM

        return LLM
    raise AttributeError(f"module 'lmkit' has no attribute {name!r}")


__all__ = ["LLM", "PLUGIN_API_VERSION", "SamplingParams", "__version__", "hookimpl", "hookspec"]
