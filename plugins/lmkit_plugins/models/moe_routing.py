"""How a mixture-of-experts layer picks each token's experts and weights them.

One :class:`MoERouting` describes every router lmkit knows, as Hugging Face computes
them:

* **Mixtral**: softmax over the router logits, the top ``k``, renormalised to sum to 1.
* **DeepSeek-V2**: softmax; ``topk_method="greedy"`` takes the top ``k`` of all
  experts, ``"group_limited_greedy"`` first keeps the ``topk_group`` groups (of
  ``n_group``) whose best expert scores highest; weights times
  ``routed_scaling_factor``, renormalised only when ``norm_topk_prob`` (as DeepSeek's
  own code; transformers' port never renormalises V2, the same for the released V2
  configs, which set ``norm_topk_prob: false``).
* **DeepSeek-V3** (``noaux_tc``): sigmoid scores; the choice adds a learned per-expert
  bias (``e_score_correction_bias``) and ranks groups by the sum of their two best
  biased scores; the weights are the unbiased scores of the chosen experts,
  renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lmkit.api import ModelLoadError

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class MoERouting:
    """A router's parameters (see the module doc for the families).

    Attributes:
        num_experts, top_k: experts per layer and experts per token.
        scoring: ``"softmax"`` or ``"sigmoid"`` of the router logits (in float32).
        renormalize: divide the chosen weights by their sum.
        num_groups, topk_groups: grouped top-k: only experts of the ``topk_groups``
            best of ``num_groups`` equal groups may be chosen (1, 1: no grouping).
        group_score: how a group ranks: ``"max"`` (its best score, DeepSeek-V2) or
            ``"top2_sum"`` (its two best biased scores, DeepSeek-V3).
        correction_bias: the choice adds a per-expert bias to the scores (V3); the
            weights stay the unbiased scores.
        scaling_factor: the weights' final factor (``routed_scaling_factor``).
        router_fp32: the router projection runs in float32 (DeepSeek's ``F.linear``
            over float32 inputs); otherwise in the model's dtype (Mixtral).
    """

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    correction_bias: bool = False
    scaling_factor: float = 1.0
    router_fp32: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ModelLoadError(f"MoE scoring {self.scoring!r} is not supported; lmkit "
                                 f"supports {', '.join(SCORINGS)}")
        if self.group_score not in GROUP_SCORES:
            raise ModelLoadError(f"MoE group score {self.group_score!r} is not supported; "
                                 f"lmkit supports {', '.join(GROUP_SCORES)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok={self.top_k} must be between 1 and the "
                                 f"number of experts ({self.num_experts})")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ModelLoadError(f"n_group={self.num_groups} must divide the number of "
                                 f"experts ({self.num_experts})")
        per_group = self.num_experts // self.num_groups
        if not 1 <= self.topk_groups <= self.num_groups or (
                self.topk_groups * per_group < self.top_k):
            raise ModelLoadError(
                f"topk_group={self.topk_groups} of n_group={self.num_groups} groups must "
                f"hold at least num_experts_per_tok={self.top_k} experts "
                f"({per_group} per group)")
        if self.group_score == "top2_sum" and self.num_groups > 1 and per_group < 2:
            raise ModelLoadError("grouped top-k by the two best scores needs at least two "
                                 f"experts per group; got {per_group}")

    @classmethod
    def from_hf(cls, cfg: Any) -> MoERouting:
        """The router of a Mixtral, DeepSeek-V2 or DeepSeek-V3 ``config.json``.

        Raises:
            ModelLoadError: another model type, or a routing method lmkit lacks.
        """
        model_type = getattr(cfg, "model_type", None)
        if model_type not in ("mixtral", "deepseek_v2", "deepseek_v3"):
            raise ModelLoadError(f"no MoE routing is known for model type {model_type!r}; "
                                 "lmkit routes mixtral, deepseek_v2 and deepseek_v3 (do "
                                 "config.json's architectures and model_type name the same "
                                 "model?)")
        top_k = int(cfg.num_experts_per_tok)
        if model_type == "mixtral":
            return cls(num_experts=int(cfg.num_local_experts), top_k=top_k)
        common: dict[str, Any] = dict(
            num_experts=int(cfg.n_routed_experts), top_k=top_k,
            renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
            scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0)), router_fp32=True)
        groups = int(getattr(cfg, "n_group", None) or 1)
        topk_groups = int(getattr(cfg, "topk_group", None) or 1)
        if model_type == "deepseek_v3":
            return cls(scoring="sigmoid", num_groups=groups, topk_groups=topk_groups,
                       group_score="top2_sum", correction_bias=True, **common)
        method = getattr(cfg, "topk_method", None) or "greedy"
        if method == "greedy":
            return cls(**common)
        if method == "group_limited_greedy":
            return cls(num_groups=groups, topk_groups=topk_groups, **common)
        raise ModelLoadError(f"DeepSeek-V2 topk_method {method!r} is not supported; lmkit "
                             "supports 'greedy' and 'group_limited_greedy'")


def route(logits: torch.Tensor, routing: MoERouting, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights from the router logits.

    :param logits: ``[T, num_experts]`` router logits (any float dtype).
    :param bias: ``[num_experts]`` float32 correction bias when ``routing.correction_bias``.
    :return: ``(weights, ids)``: float32 ``[T, top_k]`` weights, int64 ``[T, top_k]`` ids.
    """
    if routing.scoring == "softmax":
        scores = logits.float().softmax(dim=-1)
    else:
        scores = logits.float().sigmoid()
    if routing.correction_bias:
        if bias is None:
            raise ValueError("this routing adds a correction bias but none was given")
        choice = scores + bias
    else:
        choice = scores
    if routing.num_groups > 1:
        choice = _mask_groups(choice, routing)
    if routing.correction_bias:
        ids = torch.topk(choice, routing.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        weights, ids = torch.topk(choice, routing.top_k, dim=-1)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.scaling_factor != 1.0:
        weights = weights * routing.scaling_factor
    return weights, ids


def _mask_groups(choice: torch.Tensor, routing: MoERouting) -> torch.Tensor:
    """``choice`` with the experts outside each token's ``topk_groups`` best groups
    masked: to 0 for ``"max"`` (softmax scores, as HF's DeepSeek-V2), to ``-inf`` for
    ``"top2_sum"`` (as HF's DeepSeek-V3)."""
    grouped = choice.view(-1, routing.num_groups, routing.num_experts // routing.num_groups)
    if routing.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, routing.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    fill = 0.0 if routing.group_score == "max" else float("-inf")
    return grouped.masked_fill(~keep.unsqueeze(-1), fill).view_as(choice)
