"""What the model runner checks and builds before a model's weights load: the chosen
quantization method (its checkpoint checked) and the refusals of what the model or the
method cannot do over several tensor-parallel ranks; where the weights come from (the
checkpoint, or random ones with ``model.load_format: dummy``); the runner-hosted
speculative proposer (a draft head), checked against the target; and, once the model is
built, its KV cache groups, checked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmkit.api.contract import build
from lmkit.api.kv_cache_spec import KVCacheGroup, KVCacheSpec, check_kv_cache_groups
from lmkit.api.model import CausalLM
from lmkit.api.model_facts import DENSE_WEIGHT_FORMAT
from lmkit.api.quantization import QuantizationMethod
from lmkit.api.spec_decode import RUNNER_HOSTED_FEATURES, RunnerProposer
from lmkit.errors import ConfigError, ModelLoadError, PluginError

if TYPE_CHECKING:
    from lmkit.api.model import Model, ModelBuildContext
    from lmkit.api.model_facts import ModelFacts
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.registry import Registration
    from lmkit.plugin_host.resolve import ResolvedStack


def quantization_method(stack: ResolvedStack, facts: ModelFacts) -> QuantizationMethod | None:
    """The stack's quantization method, built for the model's ``facts``, with the
    checkpoint checked (a malformed file is refused here, before the model is built);
    ``None`` for dense weights.

    :raises ModelLoadError: the model dtype is not one the method computes in (its
        caps' ``dtype`` values; float32 for a method that declares none); or no method
        is chosen for a checkpoint whose ``config.json`` declares quantized weights
        (they cannot load dense; a GGUF model loads its dense conversion).
    """
    reg = stack.get("quantization")
    if reg is None:
        if facts.weight_format not in (DENSE_WEIGHT_FORMAT, "gguf"):
            raise ModelLoadError(
                f"{facts.model_dir} holds quantized weights ({facts.weight_format}, "
                "declared by config.json's quantization_config), which load only through "
                "a quantization method, and none is chosen; use --quantization auto (fp8 "
                "reads FP8 checkpoints on CUDA; `lmkit plugins list` shows the methods), "
                "or a dense copy of the model.")
        return None
    dtypes = sorted(reg.spec.caps.values.get("dtype", {"float32"}))
    if stack.dtype not in dtypes:
        raise ModelLoadError(
            f"quantization {reg.name!r} computes in {' or '.join(dtypes)} but the model "
            f"dtype is {stack.dtype}; use --dtype {dtypes[0]}"
            + (" (or auto on the CPU)" if dtypes == ["float32"] else "")
            + ", or --quantization none.")
    method: QuantizationMethod = build(
        "quantization", reg.spec.load(), facts,
        options=stack.options["quantization"], plugin=reg.origin)
    method.check()
    return method


def check_load_format(config: LMKitConfig, stack: ResolvedStack) -> None:
    """Refuse ``model.load_format: dummy`` beside a quantization method (random weights
    are dense; the method reads its own checkpoint format).

    :raises ConfigError: naming the method and what to use instead.
    """
    reg = stack.get("quantization")
    if config.model.load_format == "dummy" and reg is not None:
        raise ConfigError(
            f"model.load_format dummy draws dense random weights, which quantization "
            f"{reg.name!r} cannot read; use --quantization none, or --load-format auto")


def weight_source(config: LMKitConfig, model_dir: Path, hf_config: Any,
                  quant: QuantizationMethod | None, dtype: torch.dtype,
                  device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` stream the model loads: random weights of the config's
    shapes (``load_format: dummy``, drawn on ``device``), the quantization method's, or
    the checkpoint's safetensors."""
    if config.model.load_format == "dummy":
        from lmkit.loading.dummy import dummy_weights

        return dummy_weights(hf_config, dtype, device, config.model.seed)
    if quant is not None:
        return quant.iterate_weights()
    from lmkit.loading.weights import iterate_weights

    return iterate_weights(model_dir)


def check_tensor_parallel(model_cls: type[Model], registration: Registration, architecture: str,
                          ctx: ModelBuildContext, facts: ModelFacts) -> None:
    """Refuse splitting over ``ctx.tp_size > 1`` ranks a model class that does not declare
    ``supports_tensor_parallel``, quantized weights (``ctx.quantization``: their layers are
    not sharded), or key/value heads (``facts.num_key_value_heads``) that do not divide by
    the size for a model that does not declare ``supports_uneven_tensor_parallel``.

    :raises ModelLoadError: naming the plugin and what to use instead.
    """
    tp_size, quant, num_kv_heads = ctx.tp_size, ctx.quantization, facts.num_key_value_heads
    if tp_size <= 1:
        return
    if not model_cls.supports_tensor_parallel:
        raise ModelLoadError(
            f"architecture {architecture} (plugin {registration.origin}) does not "
            "declare supports_tensor_parallel, so it cannot be split over "
            f"{tp_size} ranks; use --tp 1, or a model plugin that shards it.")
    if num_kv_heads and num_kv_heads % tp_size and not model_cls.supports_uneven_tensor_parallel:
        raise ModelLoadError(
            f"architecture {architecture} (plugin {registration.origin}) has {num_kv_heads} "
            f"key/value heads, which do not divide by {tp_size} ranks, and the plugin does not "
            "declare supports_uneven_tensor_parallel (some ranks holding one KV group more); "
            f"use a size that divides {num_kv_heads}.")
    if quant is not None:
        raise ModelLoadError(
            f"quantized weights ({type(quant).__name__}) cannot be split over "
            f"{tp_size} ranks yet (quantized layers are not sharded); use --tp 1, "
            "or --quantization none to run the dense weights split.")


def kv_cache_torch_dtype(config: LMKitConfig) -> torch.dtype | None:
    """The dtype ``cache.kv_cache_dtype`` asks the KV cache to store: ``None`` for
    ``auto`` (the model's dtype), ``torch.float8_e4m3fn`` for ``fp8`` / ``fp8_e4m3``."""
    return torch.float8_e4m3fn if config.cache.fp8_kv_cache else None


def kv_cache_groups(model: Model, specs: tuple[KVCacheSpec, ...] | None, num_layers: int,
                    kv_cache_dtype: torch.dtype | None = None) -> tuple[KVCacheGroup, ...]:
    """The built model's KV cache groups, checked: they cover every layer once, each
    backend serves its group's spec, (for a model that declares
    :meth:`~lmkit.api.Model.kv_cache_specs`) each layer has the spec it declared, and
    each backend stores ``kv_cache_dtype`` when one is asked for.

    :raises ModelLoadError: naming the model class and what is inconsistent.
    """
    groups = model.kv_cache_groups(num_layers)
    name = type(model).__name__
    for group in groups:
        if kv_cache_dtype is not None and group.attn.kv_cache_dtype != kv_cache_dtype:
            raise ModelLoadError(
                f"cache.kv_cache_dtype asks for a {kv_cache_dtype} KV cache, but {name} "
                f"built its attention backend with {group.attn.kv_cache_dtype}: the model "
                "must pass kv_cache_dtype=ctx.kv_cache_dtype to the backends it builds; "
                "set cache.kv_cache_dtype: auto for this model")
    try:
        check_kv_cache_groups(groups, num_layers)
    except ValueError as e:
        raise ModelLoadError(f"{name}.kv_cache_groups(): {e}") from None
    if specs is not None:
        built = {layer: group.spec for group in groups for layer in group.layers}
        for layer, spec in enumerate(specs):
            if built[layer] != spec:
                raise ModelLoadError(
                    f"{name}.kv_cache_specs() declares layer {layer} "
                    f"{spec.describe()}, but its kv_cache_groups() put it in a "
                    f"{built[layer].describe()} group; build the groups from the declared "
                    "specs (lmkit.api.build_kv_cache_groups)")
    return groups


def build_draft_proposer(config: LMKitConfig, stack: ResolvedStack, model_cls: type,
                         architecture: str, target_hf_config: Any) -> RunnerProposer | None:
    """The stack's runner-hosted proposer, built and checked against the target before
    any weights load; ``None`` when speculation is off or token-based.

    Raises:
        ConfigError: the target cannot host a draft head, or the head does not fit it.
        PluginError: the plugin declares runner-hosted features but its class is not a
            :class:`~lmkit.api.RunnerProposer`.
    """
    reg = stack.get("speculative")
    if reg is None or not RUNNER_HOSTED_FEATURES & reg.spec.caps.features:
        return None
    if not (issubclass(model_cls, CausalLM) and model_cls.supports_draft_heads):
        raise ConfigError(
            f"speculative proposer {reg.name!r} reads the target's hidden states and input "
            f"embedding, but the model plugin of architecture {architecture} does not declare "
            "supports_draft_heads; use a token-based proposer (--speculative ngram).")
    proposer = build("speculative", reg.spec.load(), config,
                     options=stack.options["speculative"], plugin=reg.origin)
    if not isinstance(proposer, RunnerProposer):
        raise PluginError(
            f"speculative proposer {reg.name!r} (plugin {reg.origin}) declares "
            f"{', '.join(sorted(RUNNER_HOSTED_FEATURES & reg.spec.caps.features))} but its "
            f"class {type(proposer).__qualname__} does not subclass lmkit.api.RunnerProposer; "
            "runner-hosted proposers must (see docs/speculative-decoding.md).")
    proposer.check_target(target_hf_config)
    return proposer
