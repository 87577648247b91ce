"""Mixtral (``MixtralForCausalLM``): the Llama-family decoder with a sparse mixture of
experts in place of each dense MLP.

Attention, RoPE, norms, the sliding window (when ``config.json`` sets
``sliding_window``), the LM head and the loading of those weights are
:class:`~lmkit_plugins.models.llama.LlamaForCausalLM`'s; each layer's
``block_sparse_moe`` is a :class:`~lmkit_plugins.models.moe.SparseMoE` with Mixtral's
routing (softmax over ``num_local_experts`` router logits, the top
``num_experts_per_tok``, renormalised). Checkpoint names: ``block_sparse_moe.gate``
(the router) and ``block_sparse_moe.experts.N.w1/w3/w2`` (gate, up, down).

Under tensor parallelism attention splits as the Llama family's does and every expert
is cut across the ranks like a dense MLP (:class:`~lmkit_plugins.models.moe.SparseMoE`):
``intermediate_size`` must be divisible by the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lmkit_plugins.models.llama import LlamaDims, LlamaForCausalLM
from lmkit_plugins.models.moe import MIXTRAL_EXPERT_NAMES, SparseMoE
from lmkit_plugins.models.moe_routing import MoERouting


class MixtralForCausalLM(LlamaForCausalLM):
    """A Mixtral causal LM over packed tokens (tensor-parallel like the Llama family)."""

    supports_tensor_parallel = True

    def _mlp_builder(self, hf_config: Any, dims: LlamaDims, dtype: torch.dtype,
                     device: torch.device) -> Callable[[int], nn.Module]:
        routing = MoERouting.from_hf(hf_config)
        return lambda layer_idx: SparseMoE(dims, routing, dtype, device, tp=self.tp)

    def _add_mlp_targets(self, targets: dict[str, Callable[[torch.Tensor], None]],
                         prefix: str, mlp: nn.Module, linear_names: Callable[..., None]
                         ) -> None:
        assert isinstance(mlp, SparseMoE)
        targets.update(mlp.weight_targets(f"{prefix}.block_sparse_moe", MIXTRAL_EXPERT_NAMES))
