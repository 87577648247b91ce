"""Facts about the model that every process agrees on, computed once.

The engine core derives them (:func:`lmkit.loading.model_facts.load_model_facts`) from
the model directory, its ``config.json`` / ``generation_config.json`` / tokenizer
config, the engine configuration and the plugin host, before any weights load; the
executor and its model runner, and the frontend's input processor, read them instead of
deriving their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lmkit.api.pooling import ModelPooling

if TYPE_CHECKING:
    from lmkit.plugin_host.spec import Needs


#: the weight format of a checkpoint of dense float weights (no quantization declared)
DENSE_WEIGHT_FORMAT = "safetensors"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What lmkit knows about a model before loading its weights.

    Attributes:
        model_dir: the local model directory.
        architecture: the first of ``config.json``'s ``architectures`` that a model
            plugin registers (by name or alias).
        vocab_size: the width of the model's logits (``config.json``'s ``vocab_size``).
        num_layers: ``num_hidden_layers``.
        head_size: the attention head size (``head_dim``, else ``hidden_size /
            num_attention_heads``).
        max_model_len: the context length every process enforces: the configured
            ``model.max_model_len`` (never more than the model's own context), else the
            model's context, else :data:`~lmkit.loading.model_facts.DEFAULT_MAX_MODEL_LEN`.
        native_max_model_len: the model's own context (``max_position_embeddings`` or a
            synonym), ``None`` when its config does not say.
        eos_token_ids: every token that ends generation, the primary one first (see
            :func:`~lmkit.loading.model_facts.eos_token_ids_of`); empty when the model
            declares none.
        attention_needs: what the model needs of the attention backend: its head size
            and ``attention_kind`` (``"mha"`` unless the model declares ``"mla"``), plus what the architecture's :meth:`~lmkit.api.CausalLM.attention_needs`
            declares (e.g. ``"sliding_window"``), plus ``"non_causal"`` for a model
            whose :attr:`~lmkit.api.Model.pooling` declares bidirectional attention.
        generates: whether the model can generate text (its class is a
            :class:`~lmkit.api.CausalLM`); ``False`` for a
            :class:`~lmkit.api.PoolingModel`, which serves pooling requests only.
        pooling: the model class's declared :class:`~lmkit.api.ModelPooling` (default
            pooler, causal or bidirectional attention, classification head).
        num_attention_heads, num_key_value_heads, intermediate_size: the sizes tensor
            parallelism splits over ranks (``config.json``'s values; the key/value heads
            default to the attention heads; 0 when the config does not state one).
        weight_format: the format of the weights a quantization method must read:
            ``"gguf"`` when the directory keeps its GGUF file, else the
            ``quantization_config.quant_method`` its ``config.json`` declares
            (``"compressed-tensors"``, ``"fp8"``), else :data:`DENSE_WEIGHT_FORMAT`
            (see :func:`lmkit.loading.gguf.weight_format`).
    """

    model_dir: Path
    architecture: str
    vocab_size: int
    num_layers: int
    head_size: int
    max_model_len: int
    native_max_model_len: int | None
    eos_token_ids: tuple[int, ...]
    attention_needs: Needs
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    intermediate_size: int = 0
    generates: bool = True
    pooling: ModelPooling = field(default_factory=ModelPooling)
    weight_format: str = "safetensors"

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (requests carry it; ``min_tokens`` bans it), or ``None``."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def extra_eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids past the primary one; they stop generation like EOS does."""
        return self.eos_token_ids[1:]
