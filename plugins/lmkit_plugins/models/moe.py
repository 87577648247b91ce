"""A sparse mixture-of-experts MLP block for the Llama-style decoders (Mixtral's
``block_sparse_moe``, DeepSeek's ``mlp`` on its MoE layers).

A router (a bias-free projection to one logit per expert) picks each token's experts
(:mod:`lmkit_plugins.models.moe_routing`); the experts are SwiGLU MLPs whose weights
are stacked, ``w13 [E, 2 * I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``, and
run in one call: on CUDA lmkit's fused Triton kernel
(:func:`lmkit_kernels.moe.fused_moe`, grouped GEMMs over tokens sorted by expert) up to
:data:`~lmkit_plugins.models.fused_ops.FUSED_MOE_MAX_ROWS_PER_EXPERT` rows per expert,
above that and elsewhere its torch reference (:func:`lmkit_kernels.moe_ref.fused_moe_ref`, one pair
of matrix products per expert). Optional shared experts (DeepSeek) are one dense
:class:`~lmkit_plugins.models.llama.LlamaMLP` every token runs through, added last.

Under tensor parallelism every rank holds every expert, each cut like a dense MLP
(Megatron-style): ``intermediate / N`` of its gate and up rows and the matching
columns of its down projection. The router is replicated, so every rank routes every
token alike; each rank's weighted expert outputs are partial sums, all-reduced once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from lmkit_plugins.models.fused_ops import moe_experts
from lmkit_plugins.models.layers import Linear, _copy_checked
from lmkit_plugins.models.llama_dims import LlamaDims
from lmkit_plugins.models.llama_layers import LlamaMLP
from lmkit_plugins.models.moe_routing import MoERouting, route
from lmkit_plugins.models.tensor_parallel import TensorParallel

Loader = Callable[[torch.Tensor], None]

#: checkpoint names of an expert's gate, up and down projections
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")
DEEPSEEK_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


class SparseMoE(nn.Module):
    """Router, routed experts and optional shared experts over packed tokens.

    ``dims.intermediate_size`` is one routed expert's width (Mixtral's
    ``intermediate_size``, DeepSeek's ``moe_intermediate_size``);
    ``shared_intermediate_size`` is the shared experts' total width (0: none). With
    ``tp`` this rank holds ``1 / tp.size`` of every expert's width (see the module doc).
    """

    def __init__(self, dims: LlamaDims, routing: MoERouting, dtype: torch.dtype,
                 device: torch.device, *, shared_intermediate_size: int = 0,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.routing = routing
        self.tp = tp
        experts, hidden = routing.num_experts, dims.hidden_size
        inter = dims.intermediate_size // (tp.size if tp is not None else 1)
        self.intermediate_size = inter  # this rank's share
        self.gate = Linear(hidden, {"weight": experts}, bias=False,
                           dtype=torch.float32 if routing.router_fp32 else dtype, device=device)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden, dtype=dtype,
                                            device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter, dtype=dtype, device=device),
                               requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(experts, dtype=torch.float32, device=device), requires_grad=False
        ) if routing.correction_bias else None
        self.shared_experts = LlamaMLP(
            replace(dims, mlp_bias=False), dtype, device, tp,
            intermediate_size=shared_intermediate_size) if shared_intermediate_size else None
        self._experts: Callable[..., torch.Tensor] = moe_experts(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, hidden]`` in ``x``'s dtype."""
        logits = self.gate.forward(x.float() if self.routing.router_fp32 else x)
        weights, ids = route(logits, self.routing, self.e_score_correction_bias)
        out = self._experts(x, self.w13, self.w2, weights, ids)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.shared_experts is not None:  # all-reduces its own partial sums
            out = out + self.shared_experts.forward(x)
        return out

    def weight_targets(self, prefix: str, expert_names: tuple[str, str, str]
                       = MIXTRAL_EXPERT_NAMES) -> dict[str, Loader]:
        """Checkpoint name -> loader for every weight of this block.

        ``prefix`` is the block's checkpoint prefix (``model.layers.3.block_sparse_moe``);
        experts are ``{prefix}.experts.{e}.{gate|up|down}.weight`` under
        ``expert_names``; the router ``{prefix}.gate.weight`` (and V3's
        ``{prefix}.gate.e_score_correction_bias``); shared experts
        ``{prefix}.shared_experts.{gate_proj|up_proj|down_proj}.weight``.
        """
        inter = self.intermediate_size
        tp = self.tp
        gate_name, up_name, down_name = expert_names
        targets: dict[str, Loader] = {
            f"{prefix}.gate.weight": lambda t: self.gate.load_shard("weight", weight=t)}
        if self.e_score_correction_bias is not None:
            targets[f"{prefix}.gate.e_score_correction_bias"] = _into(
                self.e_score_correction_bias, "e_score_correction_bias")
        for e in range(self.routing.num_experts):
            p = f"{prefix}.experts.{e}"
            targets[f"{p}.{gate_name}.weight"] = _into(self.w13[e, :inter], f"{p}.{gate_name}",
                                                       tp, 0)
            targets[f"{p}.{up_name}.weight"] = _into(self.w13[e, inter:], f"{p}.{up_name}", tp, 0)
            targets[f"{p}.{down_name}.weight"] = _into(self.w2[e], f"{p}.{down_name}", tp, 1)
        shared = self.shared_experts
        if shared is not None:
            p = f"{prefix}.shared_experts"
            for name, linear, part in (("gate_proj", shared.gate_up_proj, "gate"),
                                       ("up_proj", shared.gate_up_proj, "up"),
                                       ("down_proj", shared.down_proj, "weight")):
                targets[f"{p}.{name}.weight"] = _shard(linear, part, tp,
                                                       1 if name == "down_proj" else 0)
        return targets


def _into(dst: torch.Tensor, what: str, tp: TensorParallel | None = None, dim: int = 0
          ) -> Loader:
    """Copy a checkpoint tensor (this rank's slice along ``dim`` under ``tp``) to ``dst``."""
    if tp is None:
        return lambda t: _copy_checked(dst, t, what)
    return lambda t: _copy_checked(dst, tp.shard(t, dim), what)


def _shard(linear: Linear, part: str, tp: TensorParallel | None, dim: int) -> Loader:
    if tp is None:
        return lambda t: linear.load_shard(part, weight=t)
    return lambda t: linear.load_shard(part, weight=tp.shard(t, dim))
