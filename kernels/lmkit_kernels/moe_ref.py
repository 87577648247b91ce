"""The torch reference of the mixture-of-experts kernel (:mod:`lmkit_kernels.moe`), and
the CPU path of lmkit's MoE layers. Imports torch only (no Triton).

A MoE layer routes each token to ``top_k`` of ``E`` experts, each a SwiGLU MLP
(``down(silu(gate(x)) * up(x))``), and sums the experts' outputs weighted by the
router. Expert weights are stacked: ``w13 [E, 2 * I, H]`` (each expert's gate rows,
then its up rows) and ``w2 [E, H, I]``.

:func:`fused_moe_ref` sorts the ``(token, slot)`` pairs by expert and runs one pair of
matrix products per expert over its tokens, adding each expert's weighted output in
expert order: the sums (and so the float32 results) of Hugging Face's Mixtral and
DeepSeek experts modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["check_moe_args", "fused_moe_ref"]


def check_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Raise ValueError unless the MoE arguments agree in shape, device and dtype.

    :param x: ``[T, H]`` hidden states.
    :param w13: ``[E, 2 * I, H]`` stacked gate and up projections, in ``x``'s dtype.
    :param w2: ``[E, H, I]`` stacked down projections, in ``x``'s dtype.
    :param topk_weights: ``[T, top_k]`` router weights (any float dtype).
    :param topk_ids: ``[T, top_k]`` expert ids in ``[0, E)`` (an integer dtype).
    """
    for name, t, ndim in (("x", x, 2), ("w13", w13, 3), ("w2", w2, 3),
                          ("topk_weights", topk_weights, 2), ("topk_ids", topk_ids, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != ndim:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a {ndim}-dimensional tensor, got {shape}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    num_tokens, hidden = x.shape
    num_experts, two_i, w13_hidden = w13.shape
    if two_i % 2 or w13_hidden != hidden:
        raise ValueError(f"w13 must have shape [E, 2 * I, {hidden}] (gate rows, then up rows), "
                         f"got {list(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w2 must have shape [{num_experts}, {hidden}, {two_i // 2}] to match "
                         f"w13 {list(w13.shape)}, got {list(w2.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must have x's dtype {x.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} and topk_weights "
                         f"{list(topk_weights.shape)} must both be [{num_tokens}, top_k]")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must hold integer expert ids, got {topk_ids.dtype}")


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for every token ``t``.

    Tokens are sorted by expert (a stable sort of the flattened ``(token, slot)``
    pairs) and each expert with tokens runs once over its contiguous slice: its
    gate-up projection, ``silu(gate) * up``, its down projection (each rounded to
    ``x``'s dtype, as torch's modules do), times the router weight (in float32), added
    to the output in ``x``'s dtype, expert after expert.

    :return: a new ``[T, H]`` tensor in ``x``'s dtype.
    :raises ValueError: on mismatched shapes (see :func:`check_moe_args`).
    """
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    weights = topk_weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start:start + count]
        start += count
        tokens = rows // top_k
        gate_up = F.linear(x[tokens], w13[expert])
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(hidden, w2[expert]) * weights[rows, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
