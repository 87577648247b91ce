"""Deriving :class:`~lmkit.api.model_facts.ModelFacts` from a model directory: one rule
each for the architecture, the context length, the EOS ids and the attention needs.

The engine core calls :func:`load_model_facts` once, before any weights load, and hands
the result to the executor (and through it to the model runner) and to the frontend.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmkit.api.contract import interface_problem
from lmkit.api.kv_cache_spec import KVCacheSpec, specs_needs
from lmkit.api.mla_attention import MHA
from lmkit.api.model import CausalLM, Model, PoolingModel
from lmkit.api.model_facts import ModelFacts
from lmkit.errors import (
    ConfigError,
    LMKitError,
    ModelLoadError,
    PluginError,
    UnknownBackendError,
)
from lmkit.plugin_host.spec import Needs

if TYPE_CHECKING:
    from lmkit.plugin_host.manager import PluginHost
    from lmkit.plugin_host.registry import Registration

logger = logging.getLogger(__name__)

# The context length when neither the configuration nor the model's config gives one.
DEFAULT_MAX_MODEL_LEN = 2048
# The longest sequence: lengths and positions are int32 on the device (seq_lens).
MAX_CONTEXT = 2**31 - 1
# config.json keys that state a model's context length (the smallest present wins).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "max_sequence_length")


def load_model_facts(model_dir: Path, host: PluginHost, max_model_len: int | None = None,
                     hf_config: Any = None, tokenizer: str | Path | None = None,
                     check_weights: bool = True) -> ModelFacts:
    """The facts of the model in ``model_dir``, served by the architectures ``host`` knows.

    Args:
        model_dir: a local Hugging Face-style model directory.
        host: the plugin host whose registry knows the model architectures.
        max_model_len: the configured ``model.max_model_len`` (``None``: the model's own).
        hf_config: the directory's loaded ``config.json``, when the caller has it.
        tokenizer: the ``model.tokenizer`` setting: a directory whose tokenizer replaces
            the model's (its EOS token is the primary one).
        check_weights: check the config's sizes against the weights files' headers
            (``False`` for ``model.load_format: dummy``, which reads no weights).

    Raises:
        ModelLoadError: no registered architecture serves the model, or its config is
            invalid or does not fit its weights
            (:func:`lmkit.loading.config_check.check_model_config`).
        PluginError: the registered class does not subclass :class:`lmkit.api.Model`
            (through :class:`~lmkit.api.CausalLM` or :class:`~lmkit.api.PoolingModel`).
        ConfigError: ``max_model_len`` exceeds the model's context.
    """
    from lmkit.loading.config_check import check_model_config
    from lmkit.loading.gguf import weight_format
    from lmkit.loading.weights import load_hf_config

    model_dir = Path(model_dir)
    if hf_config is None:
        hf_config = load_hf_config(model_dir)
    check_model_config(hf_config, model_dir, check_weights)  # before a plugin reads a size
    architecture, registration = model_registration(host, hf_config, model_dir)
    model_cls = model_class(registration)
    head_size = head_size_of(hf_config)
    native = native_max_model_len(hf_config)
    # every model needs one attention kind: multi-head (the default) or latent (MLA,
    # declared by the model's attention_needs)
    with plugin_reads_config(architecture, registration, hf_config, model_dir):
        needs = Needs(values={"head_size": head_size, "attention_kind": MHA}).merge(
            model_cls.attention_needs(hf_config))
        specs = model_cls.kv_cache_specs(hf_config)
    if specs is not None:  # what a backend needs to serve every KV cache group
        needs = needs.merge(kv_specs_needs(specs, architecture, int(hf_config.num_hidden_layers)))
    if not model_cls.pooling.causal:  # an encoder: bidirectional attention
        needs = needs.merge(Needs(features=frozenset({"non_causal"})))
    return ModelFacts(
        model_dir=model_dir, architecture=architecture,
        vocab_size=int(hf_config.vocab_size), num_layers=int(hf_config.num_hidden_layers),
        head_size=head_size,
        max_model_len=resolve_max_model_len(native, max_model_len, model_dir),
        native_max_model_len=native,
        eos_token_ids=eos_token_ids_of(model_dir, hf_config, tokenizer),
        attention_needs=needs, generates=issubclass(model_cls, CausalLM),
        pooling=model_cls.pooling, weight_format=weight_format(model_dir),
        **split_sizes(hf_config))


@contextlib.contextmanager
def plugin_reads_config(architecture: str, registration: Registration, hf_config: Any,
                        model_dir: Path) -> Iterator[None]:
    """Turn a model plugin's failure to read the config (a missing attribute, a value of
    the wrong type) into a :class:`ModelLoadError` naming ``config.json`` and the plugin:
    usually ``architectures`` and ``model_type`` name different models."""
    try:
        yield
    except LMKitError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
        model_type = hf_config.to_dict().get("model_type")
        raise ModelLoadError(
            f"architecture {architecture} (plugin {registration.origin}) cannot read "
            f"{Path(model_dir) / 'config.json'} (model_type={model_type!r}): "
            f"{type(e).__name__}: {e}. Check that its architectures and model_type name the "
            "same model, and that the fields that model needs are there.") from e


def kv_specs_needs(specs: tuple[KVCacheSpec, ...], architecture: str, num_layers: int
                   ) -> Needs:
    """What an attention backend needs to serve each of a model's declared KV cache
    specs (:meth:`lmkit.api.Model.kv_cache_specs`).

    Raises:
        ModelLoadError: the specs are not one per layer, or need backends of two kinds.
    """
    if len(specs) != num_layers:
        raise ModelLoadError(
            f"architecture {architecture} declares {len(specs)} KV cache specs for a model "
            f"of {num_layers} layers (num_hidden_layers); kv_cache_specs() must return one "
            "spec per layer")
    try:
        return specs_needs(specs)
    except ValueError as e:
        raise ModelLoadError(f"architecture {architecture}: {e}") from None


def model_registration(host: PluginHost, hf_config: Any, model_dir: Path
                       ) -> tuple[str, Registration]:
    """``(architecture, registration)``: the first of ``config.json``'s ``architectures``
    that a model plugin registers (by name or alias), and its registration."""
    archs = [str(a) for a in (hf_config.to_dict().get("architectures") or [])]
    for arch in archs:
        try:
            reg = host.registry.get("model", arch)
        except UnknownBackendError:
            continue
        return arch, reg
    known = sorted({k for r in host.registry.all("model") for k in (r.name, *r.spec.aliases)})
    raise ModelLoadError(
        f"model architecture {', '.join(archs) or '(none: config.json has no architectures)'}"
        f" of {model_dir} is not supported; supported architectures: "
        f"{', '.join(known) or 'none (no model plugin is loaded)'}. Install a plugin that "
        "registers it (register_models) or use a supported model.")


def model_class(registration: Registration) -> type[Model]:
    """The model class a registration loads, checked against the :class:`Model` contract
    (a :class:`CausalLM` or a :class:`PoolingModel`)."""
    cls = registration.spec.load()
    problem = interface_problem("model", cls)
    if problem is None and not issubclass(cls, (CausalLM, PoolingModel)):
        problem = f"{cls.__qualname__} subclasses lmkit.api.Model directly"
    if problem is not None:
        raise PluginError(
            f"model {registration.name!r} (plugin {registration.origin}): {problem}; make "
            "the model class inherit from lmkit.api.CausalLM (a model that generates, e.g. "
            "class MyModel(torch.nn.Module, CausalLM)) or lmkit.api.PoolingModel (no "
            "language-model head: embeddings and classification only).")
    return cls


def head_size_of(hf_config: Any) -> int:
    """``head_dim`` when the config states it, else ``hidden_size // num_attention_heads``."""
    head_dim = hf_config.to_dict().get("head_dim")
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


def split_sizes(hf_config: Any) -> dict[str, int]:
    """The sizes tensor parallelism divides over ranks: attention heads, key/value heads
    (the attention heads when the config states none) and the MLP's intermediate size;
    0 for a size the config does not state."""
    values = hf_config.to_dict()

    def size(key: str) -> int:
        value = values.get(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0

    heads = size("num_attention_heads")
    return {"num_attention_heads": heads,
            "num_key_value_heads": size("num_key_value_heads") or heads,
            "intermediate_size": size("intermediate_size")}


def native_max_model_len(hf_config: Any) -> int | None:
    """The model's own context length: the smallest positive value among
    :data:`CONTEXT_KEYS` in its config, ``None`` when it states none."""
    values = hf_config.to_dict()
    found = [int(values[k]) for k in CONTEXT_KEYS if isinstance(values.get(k), int)
             and not isinstance(values.get(k), bool) and values[k] > 0]
    return min(found) if found else None


def resolve_max_model_len(native: int | None, asked: int | None, model_dir: Path) -> int:
    """The context length: ``asked`` if given (refused when it exceeds ``native`` or
    :data:`MAX_CONTEXT`), else ``native`` (refused above :data:`MAX_CONTEXT`), else
    :data:`DEFAULT_MAX_MODEL_LEN`."""
    if asked is not None and asked > MAX_CONTEXT:
        raise ConfigError(f"model.max_model_len={asked} exceeds {MAX_CONTEXT} tokens, the "
                          "most a sequence can hold (its length is an int32).")
    if asked is None and native is not None and native > MAX_CONTEXT:
        raise ModelLoadError(
            f"{Path(model_dir) / 'config.json'} states a context of {native} tokens (the "
            f"smallest of {', '.join(CONTEXT_KEYS)}), more than the {MAX_CONTEXT} a sequence "
            "can hold (its length is an int32); set model.max_model_len (--set "
            "model.max_model_len=N) or fix config.json.")
    if asked is not None and native is not None and asked > native:
        raise ConfigError(
            f"model.max_model_len={asked} exceeds the model's context of {native} tokens "
            f"(stated in {Path(model_dir) / 'config.json'}); lower "
            f"model.max_model_len to at most {native}, or leave it unset to use {native}.")
    if asked is None and native is None:
        logger.warning("%s states no context length (%s); using %d tokens: set "
                       "model.max_model_len to change it", Path(model_dir) / "config.json",
                       ", ".join(CONTEXT_KEYS), DEFAULT_MAX_MODEL_LEN)
    return int(asked or native or DEFAULT_MAX_MODEL_LEN)


def eos_token_ids_of(model_dir: Path, hf_config: Any, tokenizer: str | Path | None = None
                     ) -> tuple[int, ...]:
    """Every token id that ends generation, the primary first, without repeats:

    1. the tokenizer's EOS token (``eos_token`` of ``tokenizer_config.json``, its id
       from that file's ``added_tokens_decoder`` or ``tokenizer.json``), which chat
       templates end a turn with; the tokenizer in ``tokenizer`` (the ``model.tokenizer``
       setting) when given, else the model's;
    2. ``eos_token_id`` of ``generation_config.json`` (an id or a list), or when that
       file does not give one, ``eos_token_id`` of ``config.json``.
    """
    model_dir = Path(model_dir)
    ids: list[int] = []
    tokenizer_eos = _tokenizer_eos_id(Path(tokenizer) if tokenizer is not None else model_dir)
    if tokenizer_eos is not None:
        ids.append(tokenizer_eos)
    generation = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    declared = generation if generation is not None else hf_config.to_dict().get("eos_token_id")
    ids.extend(_as_ids(declared))
    return tuple(dict.fromkeys(ids))


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {type(e).__name__}: {e}; fix or delete "
                             "the file.") from e
    return data if isinstance(data, dict) else {}


def _tokenizer_eos_id(model_dir: Path) -> int | None:
    """The id of ``tokenizer_config.json``'s ``eos_token``, when the tokenizer files
    name it (``added_tokens_decoder``, ``tokenizer.json``'s added tokens or vocabulary)."""
    config = _read_json(model_dir / "tokenizer_config.json")
    eos = config.get("eos_token")
    content = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(content, str):
        return None
    for token_id, token in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(token, dict) and token.get("content") == content:
            return int(token_id)
    tokenizer = _read_json(model_dir / "tokenizer.json")
    for token in tokenizer.get("added_tokens") or []:
        if isinstance(token, dict) and token.get("content") == content:
            return int(token["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(content), int):
        return int(vocab[content])
    return None
