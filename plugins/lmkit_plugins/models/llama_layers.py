"""The Llama family's layers: attention (fused QKV, RoPE, optional q/k norms, sliding
window), the gated MLP (fused gate-up) and the decoder layer; reused by the Gemma,
Mixtral, DeepSeek and EAGLE modules. The model around them is in
:mod:`lmkit_plugins.models.llama`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lmkit.api import AttentionBackend
from torch import nn

from lmkit_plugins.models.fused_ops import (
    fused_ops_enabled,
    rotary_qk_kernel,
    silu_and_mul_kernel,
)
from lmkit_plugins.models.layers import Linear, RMSNorm, silu_and_mul
from lmkit_plugins.models.llama_dims import LlamaDims
from lmkit_plugins.models.rotary import CPU_ROPE_MAX_ROWS, RotaryEmbedding, cpu_rope_kernel
from lmkit_plugins.models.tensor_parallel import TensorParallel


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional q/k norm, RoPE, paged attention, output projection.

    Under tensor parallelism (``tp``) this rank holds its KV groups' query and KV heads
    (:meth:`TensorParallel.heads`: ``num_heads / N`` and ``num_kv_heads / N`` when they
    divide; column-parallel QKV) and a row-parallel o_proj whose partial sums are
    all-reduced.
    """

    def __init__(self, dims: LlamaDims, layer_idx: int, rotary: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None, quant: Any = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        #: this rank's query and key/value heads (all of them without tensor parallelism)
        self.q_heads, self.kv_heads = ((range(dims.num_heads), range(dims.num_kv_heads))
                                       if tp is None else tp.heads(dims.num_heads,
                                                                   dims.num_kv_heads))
        self.num_heads, self.num_kv_heads = len(self.q_heads), len(self.kv_heads)
        self.head_dim = dims.head_dim
        self.q_size = self.num_heads * dims.head_dim
        self.kv_size = self.num_kv_heads * dims.head_dim
        self.rotary = rotary
        kw = {"dtype": dtype, "device": device}
        qkw = {**kw, "quantization": quant}
        self.qkv_proj = Linear(dims.hidden_size, {"q": self.q_size, "k": self.kv_size,
                                                  "v": self.kv_size}, bias=dims.qkv_bias,
                               fold="norm", **qkw)
        self.o_proj = Linear(self.q_size, {"weight": dims.hidden_size}, bias=dims.o_bias, **qkw)
        self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, **kw) if dims.qk_norm else None
        self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, **kw) if dims.qk_norm else None
        # CUDA half precision: q/k norm + RoPE in one in-place kernel (fused_ops)
        self._rotary_qk = rotary_qk_kernel() if fused_ops_enabled(device, dtype) else None
        # CPU float32 decode: RoPE in place on the fused QKV output (lmkit's C kernel)
        self._cpu_rope = cpu_rope_kernel(rotary, device, dtype) if not dims.qk_norm else None
        self._head_counts = [self.num_heads, self.num_kv_heads, self.num_kv_heads]

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend, kv_cache: torch.Tensor,
                kv_slots: torch.Tensor | None = None) -> torch.Tensor:
        """``kv_slots``: the backend's :meth:`~lmkit.api.AttentionBackend.kv_write_slots`;
        with the fused kernel, K/V then go to the cache in the RoPE kernel."""
        return self.attend(self.qkv_proj.forward(hidden), cos, sin, attn, kv_cache, kv_slots)

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attn: AttentionBackend, kv_cache: torch.Tensor,
               kv_slots: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` from the QKV projection's output ``[n, q_size + 2 *
        kv_size]`` on (a caller that computed it, e.g. with its norm folded in)."""
        n = qkv.shape[0]
        kv_written = kv_slots is not None and self._rotary_qk is not None
        if self._cpu_rope is not None and n <= CPU_ROPE_MAX_ROWS:
            # CPU float32 decode: q and k heads rotated in place (qkv is this call's own
            # output), then all three as views of one split: few ops per layer
            heads = qkv.view(n, -1, self.head_dim)  # [n, num_heads + 2 * num_kv_heads, d]
            self._cpu_rope(heads, cos, sin, self.num_heads + self.num_kv_heads)
            q, k, v = heads.split_with_sizes(self._head_counts, 1)
        else:
            q, k, v = self._rotated_heads(qkv, cos, sin, kv_cache, kv_slots if kv_written
                                          else None)
        if kv_written:  # [n, num_heads, head_dim]
            out = attn.run(self.layer_idx, q, k, v, kv_cache, kv_written=True)
        else:
            out = attn.run(self.layer_idx, q, k, v, kv_cache)
        out = self.o_proj.forward(out.reshape(n, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _rotated_heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: torch.Tensor, kv_slots: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v`` ``[n, heads, head_dim]`` of a fused QKV output, q/k normed (when
        the model has q/k norms) and rotated: the fused CUDA kernel (which also writes
        K/V to the cache when ``kv_slots`` is given), else torch ops."""
        n = qkv.shape[0]
        qk_end = self.q_size + self.kv_size
        v = qkv[:, qk_end:].view(n, self.num_kv_heads, self.head_dim)
        if self._rotary_qk is not None:
            self._rotary_qk(qkv, cos, sin, num_heads=self.num_heads,
                            num_kv_heads=self.num_kv_heads, head_size=self.head_dim,
                            q_norm=None if self.q_norm is None else self.q_norm.weight,
                            k_norm=None if self.k_norm is None else self.k_norm.weight,
                            eps=1e-6 if self.q_norm is None else self.q_norm.eps,
                            kv_cache=kv_cache if kv_slots is not None else None,
                            slot_mapping=kv_slots)
            q = qkv[:, :self.q_size].view(n, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:qk_end].view(n, self.num_kv_heads, self.head_dim)
        elif self.q_norm is None:
            # rotate query and key heads together: [n, num_heads + num_kv_heads, head_dim]
            qk = self.rotary.apply(qkv[:, :qk_end].view(n, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:
            q = self.q_norm.forward(qkv[:, :self.q_size].view(n, self.num_heads, self.head_dim))
            k = self.k_norm.forward(
                qkv[:, self.q_size:qk_end].view(n, self.num_kv_heads, self.head_dim))
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        return q, k, v


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate-up projection (column-parallel under
    ``tp``; down_proj row-parallel, all-reduced)."""

    def __init__(self, dims: LlamaDims, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None, quant: Any = None,
                 intermediate_size: int | None = None,
                 act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        # intermediate_size: instead of dims.intermediate_size (e.g. a MoE's shared experts);
        # act: ``[n, 2 * size]`` gate-up -> ``[n, size]``, instead of SiLU-and-multiply
        super().__init__()
        kw = {"dtype": dtype, "device": device, "quantization": quant}
        self.tp = tp
        size = (intermediate_size or dims.intermediate_size) // (tp.size if tp is not None else 1)
        # SiLU-and-multiply in the gate-up kernel's epilogue for decode sizes
        # (Linear.forward_glu): lmkit's own activation, one device
        self.gate_up_proj = Linear(dims.hidden_size, {"gate": size, "up": size},
                                   bias=dims.mlp_bias, fold="norm",
                                   glu=act is None and tp is None, **kw)
        self.down_proj = Linear(size, {"weight": dims.hidden_size}, bias=dims.mlp_bias,
                                fold="silu_mul", **kw)
        self.act = act if act is not None else (
            silu_and_mul_kernel() if fused_ops_enabled(device, dtype) else silu_and_mul)
        # a quantization method that folds SiLU-and-multiply into the down projection (the
        # torch op's, or with tp off lmkit's CUDA kernel's), or (dense, CUDA half
        # precision, tp off) the small-batch kernel that does
        self._silu_folded = ((quant is not None and quant.supports_silu_mul_linear
                              and (self.act is silu_and_mul or (act is None and tp is None)))
                             or (act is None and tp is None
                                 and self.down_proj.gemv_fold is not None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.glu_takes(x):
            return self.down_from_gate_up(self.gate_up_proj.forward_glu(x), activated=True)
        return self.down_from_gate_up(self.gate_up_proj.forward(x))

    def down_from_gate_up(self, gate_up: torch.Tensor, activated: bool = False
                          ) -> torch.Tensor:
        """:meth:`forward` from the gate-up projection's output on; ``activated``: that
        output is already ``silu(gate) * up`` (the projection's epilogue,
        :meth:`Linear.forward_glu`)."""
        if activated:
            out = self.down_proj.forward(gate_up)
        elif self._silu_folded:
            out = self.down_proj.forward_silu_mul(gate_up, self.act)
        else:
            out = self.down_proj.forward(self.act(gate_up))
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks around a residual stream. ``mlp`` replaces the
    dense :class:`LlamaMLP` (e.g. a mixture of experts): any module whose ``forward``
    maps ``[n, hidden]`` to ``[n, hidden]``."""

    def __init__(self, dims: LlamaDims, layer_idx: int, rotary: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None, quant: Any = None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, **kw)
        self.self_attn = LlamaAttention(dims, layer_idx, rotary, dtype, device, tp, quant)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, **kw)
        self.mlp = mlp if mlp is not None else LlamaMLP(dims, dtype, device, tp, quant)
        # a quantization method that folds norms into projections, or (dense, CUDA half
        # precision) the small-batch kernel that does: each norm runs inside the QKV /
        # gate-up projection's kernel (Linear.forward_add_rms_norm)
        self._norm_folded = tp is None and isinstance(self.mlp, LlamaMLP) and (
            (quant is not None and quant.supports_norm_linear)
            or self.self_attn.qkv_proj.gemv_fold is not None)

    def replace_input_norm(self, norm: nn.Module) -> None:
        """Use ``norm`` (``forward(x) -> x'``, e.g. an identity) as the input norm instead
        of the RMSNorm (an EAGLE-1/2 head's first layer has none). Folding the input
        norm into the QKV projection only ever folds an RMSNorm, so it stops here."""
        self.input_layernorm = norm
        self._norm_folded = False

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attn: AttentionBackend, kv_cache: torch.Tensor,
                kv_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # submodules' forward is called directly: nn.Module.__call__ (hooks, which
        # nothing here uses) costs ~0.5 ms per step over 30 layers on a CPU
        if self._norm_folded:
            attn_in = self.self_attn
            qkv, residual = attn_in.qkv_proj.forward_add_rms_norm(
                hidden, residual, self.input_layernorm)
            hidden = attn_in.attend(qkv, cos, sin, attn, kv_cache, kv_slots)
            mlp = self.mlp
            glu = mlp.gate_up_proj.glu_takes(hidden)  # SiLU in the gate-up kernel
            gate_up, residual = mlp.gate_up_proj.forward_add_rms_norm(
                hidden, residual, self.post_attention_layernorm, glu)
            return mlp.down_from_gate_up(gate_up, activated=glu), residual
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(hidden, cos, sin, attn, kv_cache, kv_slots)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual
