"""The public API for plugin authors. Plugins import from here (and ``lmkit``) only.

Light names are imported eagerly; names whose modules import torch are loaded on first
access, so that ``from lmkit.api import Spec`` in a plugin module stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from lmkit.api.attention import AttentionBackend, AttentionMetadata
from lmkit.api.executor import Executor, ModelInfo
from lmkit.api.model import CausalLM, ForwardContext, ModelBuildContext
from lmkit.api.offload import OffloadManager, TransferJob
from lmkit.api.scheduler import Scheduler
from lmkit.api.source import ModelSource
from lmkit.api.spec_decode import Proposal, ProposerInput, SpecProposer
from lmkit.api.structured_output import Grammar, StructuredOutputBackend
from lmkit.config.schema import LMKitConfig
from lmkit.engine.outputs import EngineCoreOutput, TokenLogprob
from lmkit.engine.request import Request, RequestStatus
from lmkit.engine.sampling_params import SamplingParams
from lmkit.errors import (
    ConfigError,
    InvalidRequestError,
    LMKitError,
    ModelLoadError,
    ModelNotFoundError,
    PluginError,
)
from lmkit.plugins.hookspecs import hookimpl
from lmkit.plugins.manager import PluginHost
from lmkit.plugins.registry import Registration
from lmkit.plugins.resolve import ResolvedStack
from lmkit.plugins.spec import Caps, Needs, NoOptions, Spec
from lmkit.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from lmkit.version import PLUGIN_API_VERSION
from lmkit.worker.output import ModelRunnerOutput

# name -> module, imported on first attribute access
_LAZY = {
    "PagedScheduler": "lmkit.scheduler.paged",
    "KVCacheManager": "lmkit.kv_cache.manager",
    "BlockPool": "lmkit.kv_cache.block_pool",
    "WaitingQueue": "lmkit.scheduler.queues",
    "FCFSWaitingQueue": "lmkit.scheduler.queues",
    "PriorityWaitingQueue": "lmkit.scheduler.queues",
    "ModelRunner": "lmkit.worker.model_runner",
    "Sampler": "lmkit.sample.sampler",
    "default_cache_dir": "lmkit.loading.cache",
    "fetch_pypi_model": "lmkit.loading.pypi",
    "convert_gguf_to_safetensors": "lmkit.loading.gguf",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lmkit.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "PLUGIN_API_VERSION", "AttentionBackend", "AttentionMetadata", "CachedRequestData", "Caps",
    "CausalLM", "ConfigError", "EngineCoreOutput", "Executor", "ForwardContext", "Grammar",
    "InvalidRequestError", "LMKitConfig", "LMKitError", "ModelBuildContext", "ModelInfo",
    "ModelLoadError", "ModelNotFoundError", "ModelRunnerOutput", "ModelSource", "Needs",
    "NewRequestData", "NoOptions", "OffloadManager", "PluginError", "PluginHost", "Proposal", "ProposerInput",
    "Registration", "Request", "RequestStatus", "ResolvedStack", "SamplingParams", "Scheduler",
    "SchedulerOutput", "Spec", "SpecProposer", "StructuredOutputBackend", "TokenLogprob",
    "TransferJob", "hookimpl", *_LAZY,
]
