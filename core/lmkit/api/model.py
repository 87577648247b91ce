"""What a model architecture plugin implements, and what it is given."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lmkit.api.attention import AttentionBackend
    from lmkit.plugin_host.spec import Needs


@dataclass
class ModelBuildContext:
    """Given to a model's constructor: how to build its attention layers."""

    dtype: Any  # torch.dtype
    device: Any  # torch.device
    block_size: int
    attention_cls: type[AttentionBackend]
    attention_options: Any = None
    # the chosen quantization method (a QuantizationMethod), or None for dense weights
    quantization: Any = None


@dataclass
class ForwardContext:
    """Given to ``forward`` each step: the planned attention backend and the KV caches."""

    attn: AttentionBackend
    kv_caches: list[torch.Tensor]


class CausalLM(ABC):
    """A decoder-only language model over packed tokens (no batch axis).

    Constructor (the one signature the model runner uses)::

        cls(hf_config, ctx: ModelBuildContext)

    ``hf_config`` is the model directory's ``config.json`` (a transformers
    ``PretrainedConfig``). The model must create one attention backend instance
    (``ctx.attention_cls(...)``, see :class:`~lmkit.api.AttentionBackend`) and expose it
    as ``self.attn`` so the runner can plan it once per step. Model classes usually
    subclass ``torch.nn.Module`` too: ``class MyModel(torch.nn.Module, CausalLM)``.
    """

    attn: AttentionBackend

    @classmethod
    def attention_needs(cls, hf_config: Any) -> Needs:
        """What the model needs of the attention backend, known from its config alone
        (e.g. ``Needs({"sliding_window"})``); stack resolution then refuses or avoids
        backends that lack it, before weights load. The head size is added by lmkit.
        Optional: the default needs nothing."""
        from lmkit.plugin_host.spec import Needs

        return Needs()

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 logits ``[n, vocab_size]``."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (fusing QKV and gate-up as needed); return the names used."""
