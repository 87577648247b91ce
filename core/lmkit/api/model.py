"""What a model architecture plugin implements, and what it is given."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from lmkit.api.attention import AttentionBackend


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


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model over packed tokens (no batch axis).

    ``__init__(hf_config, ctx: ModelBuildContext)`` builds it; it must create one
    attention backend instance (``ctx.attention_cls(...)``) and expose it as
    ``self.attn`` so the runner can plan it once per step.

    Optionally, a classmethod ``attention_needs(hf_config) -> lmkit.api.Needs`` declares
    what the model needs of the attention backend (e.g. the ``"sliding_window"``
    feature); stack resolution then refuses or avoids backends that lack it.
    """

    attn: AttentionBackend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 logits ``[n, vocab_size]``."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (fusing QKV and gate-up as needed); return the names used."""
        ...
