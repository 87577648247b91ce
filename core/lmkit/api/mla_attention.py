"""The MLAAttentionBackend contract: multi-head latent attention (DeepSeek-V2/V3).

MLA stores one small latent entry per token instead of per-head keys and values: the
normalized compressed KV ``c_kv`` (``kv_lora_rank`` wide) and the rotated RoPE key
``k_pe`` (``qk_rope_head_dim`` wide, shared by all heads). Per-head keys and values are
the latent times the model's ``kv_b_proj`` weight, which a backend may apply to the
cache (decompress, as prefill does) or fold into the query and output (absorb, as
decode does, reading only the latent cache).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any

from lmkit.api.attention import AttentionBackend

if TYPE_CHECKING:
    import torch

#: The ``attention_kind`` value an MLA model needs (``ModelFacts.needs``) and an MLA
#: backend declares in its caps; ordinary multi-head/GQA backends declare ``"mha"``.
MLA = "mla"
MHA = "mha"


class MLAAttentionBackend(AttentionBackend):
    """Paged multi-head latent attention over a latent KV cache, for one model.

    Constructor: :class:`AttentionBackend`'s keywords plus the MLA dimensions::

        cls(*, num_heads, num_kv_heads, head_size, scale, dtype, device, block_size,
            sliding_window=None, options=None, causal=True,
            kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)

    Models pass ``num_kv_heads=1`` and ``head_size=kv_lora_rank + qk_rope_head_dim`` (one
    latent entry per token); ``scale`` is the softmax scale over the full query/key width
    ``qk_nope_head_dim + qk_rope_head_dim``, YaRN's mscale included. ``num_heads`` is the
    number of query heads on this rank.

    Cache layout per layer: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``
    in the model dtype; token ``t`` lives at ``[slot // block_size, slot % block_size]``,
    ``[:kv_lora_rank]`` holding ``c_kv`` (after ``kv_a_layernorm``) and the rest
    ``k_pe`` (after RoPE). Layers call :meth:`run_mla`, never :meth:`run`.
    """

    def __init__(self, *, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)``."""
        return (num_blocks, self.block_size, self.kv_lora_rank + self.qk_rope_head_dim)

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_cache: torch.Tensor, *, kv_written: bool = False) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} is an MLA backend: layers call run_mla(), "
                        "not run()")

    @abstractmethod
    def run_mla(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                w_kv_b: torch.Tensor) -> torch.Tensor:
        """Write this step's latent entries at ``slot_mapping``, then attend.

        As in :meth:`AttentionBackend.run`, every new token's entry is written before
        any attention is computed; must do no host work and no device-to-host sync when
        the backend declares ``"cuda_graphs"``.

        :param q_nope: ``[num_tokens, num_heads, qk_nope_head_dim]``
        :param q_pe: ``[num_tokens, num_heads, qk_rope_head_dim]``, RoPE applied.
        :param kv_c: ``[num_tokens, kv_lora_rank]``, after ``kv_a_layernorm``.
        :param k_pe: ``[num_tokens, qk_rope_head_dim]``, RoPE applied.
        :param kv_cache: this layer's cache, shaped as :meth:`kv_cache_shape`.
        :param w_kv_b: the layer's ``kv_b_proj`` weight on this rank,
            ``[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``; the rows of
            head ``h`` are its ``qk_nope_head_dim`` key rows then its ``v_head_dim``
            value rows (HF's layout). The same tensor on every call for a layer.
        :return: ``[num_tokens, num_heads, v_head_dim]``, causal within each request:
            ``softmax(scale * (q_nope . k_nope + q_pe . k_pe)) @ v`` with
            ``[k_nope | v] = c_kv @ w_kv_b.T`` per head.
        """
