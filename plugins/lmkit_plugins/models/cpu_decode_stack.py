"""When a Llama-family model runs its decode step through lmkit's C decode-stack
executor (:mod:`lmkit_kernels.cpu.decode_stack`): every condition in one place.

The executor runs all decoder layers and the final norm of a decode step in one C
call, calling the kernels the Python-sequenced layers call (in the same order, with
the same arguments), so hidden states and logits are the same bits either way; it
saves the layers' Python glue, about a fifth of a SmolLM2-135M step at batch 1.

For the model (decided once, when its weights are loaded: :func:`build_cpu_decode_stack`):

* ``LMKIT_CPU_DECODE_STACK`` is not ``0`` and the executor's library builds (else one
  warning says why, and the Python layers run);
* float32 on the CPU, no tensor parallelism, one KV cache group, an attention backend
  declaring :attr:`~lmkit.api.AttentionBackend.supports_paged_decode_args`;
* the ``gguf`` quantization method, with every layer on the quantized fast path: plain
  :class:`~lmkit_plugins.models.llama_layers.LlamaDecoderLayer` / ``LlamaAttention`` /
  ``LlamaMLP`` (no q/k norms, no mixture of experts), the input norms folded into the
  QKV and gate-up projections, SiLU-and-multiply into the down projection (qgemv's
  AVX-512 VNNI build), RoPE over whole heads by the C kernel, C RMSNorm kernels.

For each step (:meth:`CpuDecodeStack.run`, which returns ``None`` to send the step
through the Python layers): at most :data:`~lmkit_kernels.cpu.decode_stack.MAX_ROWS`
tokens, the backend runs the step through its C decode kernel a row per token
(:meth:`~lmkit.api.AttentionBackend.paged_decode_args` with ``multi_token``: decode-only
steps, and causal steps of short queries such as a speculative verification or a short
prompt), the context's backend is the model's own, and the KV caches are float32,
contiguous and laid out as the kernel reads them. A draft head's taps
(``aux_hidden_layers``) are copied out inside the call.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from lmkit.api import ForwardContext

from lmkit_plugins.models.llama_layers import LlamaAttention, LlamaDecoderLayer, LlamaMLP

if TYPE_CHECKING:
    from lmkit_kernels.cpu.decode_stack import DecodeStack, QLinear

    from lmkit_plugins.models.layers import Linear
    from lmkit_plugins.models.llama import LlamaStack

logger = logging.getLogger(__name__)


class CpuDecodeStack:
    """A model's executor plan and its per-step conditions (module docstring)."""

    def __init__(self, stack: DecodeStack, attn: Any, max_rows: int,
                 block_size: int, num_kv_heads: int, head_dim: int, num_layers: int) -> None:
        self._stack = stack
        self._num_layers = num_layers
        self._attn = attn
        self._max_rows = max_rows
        self._cache_shape = (2, block_size, num_kv_heads, head_dim)  # but num_blocks
        self._caches: list[torch.Tensor] | None = None
        self._caches_ok = False

    def _caches_fit(self, caches: list[torch.Tensor]) -> bool:
        if caches is not self._caches:  # a new list: check its layout once
            shape = tuple(caches[0].shape) if caches else ()
            self._caches_ok = len(caches) == self._num_layers and len(shape) == 5 and all(
                c.dtype == torch.float32 and c.is_contiguous() and c.device.type == "cpu"
                and tuple(c.shape) == shape for c in caches) and (
                (shape[0],) + shape[2:] == self._cache_shape)
            self._caches = caches
        return self._caches_ok

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor | None:
        """The step's final hidden states ``[n, hidden]`` from the embeddings ``hidden``,
        or ``None`` when the executor does not apply to this step."""
        if (hidden.shape[0] > self._max_rows or ctx.attn is not self._attn
                or hidden.stride(1) != 1):
            return None
        args = ctx.attn.paged_decode_args(multi_token=True)  # a row per token
        if args is None or args[0].shape[0] != hidden.shape[0]:
            return None
        if not self._caches_fit(ctx.kv_caches):
            return None
        slot_mapping, block_tables, seq_lens = args
        # a draft head's features (aux_hidden_layers) are copied out in C
        return self._stack.run(hidden, cos, sin, slot_mapping, block_tables, seq_lens,
                               ctx.kv_caches, ctx.aux_hidden_layers, ctx.aux_hidden_states)


def _qlinear(method: Any, linear: Linear, kernel: Any, segments: int = 1
             ) -> list[QLinear] | None:
    """The packed projection(s) behind ``kernel``: one, or up to ``segments`` row ranges
    of different types (a fused projection of mixed types), each with its bias rows."""
    from lmkit_kernels.cpu.decode_stack import QLinear

    packed = method.packed_weight(kernel)
    parts = packed if isinstance(packed, tuple) else (packed,)
    if packed is None or len(parts) > segments:
        return None
    out, row = [], 0
    for p in parts:
        bias = None if linear.bias is None else linear.bias[row:row + p.n]
        out.append(QLinear(p.qtype, p.data, bias, p.n, p.k))
        row += p.n
    return out


def build_cpu_decode_stack(model: LlamaStack, quant: Any
                           ) -> tuple[CpuDecodeStack | None, str]:
    """The executor for ``model`` (its weights loaded; ``quant`` its quantization method
    or ``None``), or ``(None, why not)``."""
    from lmkit_kernels.cpu.decode_stack import (
        DISABLE_ENV,
        MAX_ROWS,
        LayerWeights,
        decode_stack_disabled,
        make_decode_stack,
    )

    from lmkit_plugins.quantization.gguf_cpu import GGUFCpuMethod

    if decode_stack_disabled():
        return None, f"turned off by {DISABLE_ENV}=0"
    dims, attn = model.dims, model.attn
    params = next(model.model.norm.parameters())
    if params.device.type != "cpu" or params.dtype != torch.float32:
        return None, "not a float32 CPU model"
    if model.tp is not None or model._layer_attn is not None:
        return None, "tensor parallel or several KV cache groups"
    if not type(attn).supports_paged_decode_args:
        return None, f"the attention backend {type(attn).__name__} does not hand out " \
                     "paged decode arguments"
    if not isinstance(quant, GGUFCpuMethod):
        return None, "not the gguf quantization method"
    if not model.model.norm.has_cpu_kernel:
        return None, "the C RMSNorm kernel is unavailable"
    layers: list[Any] = []
    for layer in model.model.layers:
        weights = _layer_weights(layer, quant, LayerWeights)
        if weights is None:
            return None, f"layer {len(layers)} is not on the quantized fast path"
        # the C executor sizes its strides and scratch from the model's dimensions
        if weights.o.n != dims.hidden_size or weights.down.k != dims.intermediate_size:
            return None, f"layer {len(layers)}'s projections do not have the model's widths"
        layers.append(weights)
    stack, reason = make_decode_stack(
        layers, hidden=dims.hidden_size, num_heads=dims.num_heads,
        num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
        intermediate=dims.intermediate_size, block_size=attn.block_size, scale=attn.scale,
        window=attn.sliding_window or 0, final_norm=model.model.norm.weight,
        final_eps=model.model.norm.eps)
    if stack is None:
        return None, reason
    return CpuDecodeStack(stack, attn, MAX_ROWS, attn.block_size, dims.num_kv_heads,
                          dims.head_dim, len(layers)), ""


def _layer_weights(layer: Any, quant: Any, make: Any) -> Any:
    """``LayerWeights`` of a layer on the quantized fast path, else ``None``."""
    if (type(layer) is not LlamaDecoderLayer or not layer._norm_folded
            or type(layer.self_attn) is not LlamaAttention or type(layer.mlp) is not LlamaMLP):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if (attn._cpu_rope is None or attn.q_norm is not None or attn._rotary_qk is not None
            or not mlp._silu_folded or mlp.tp is not None):
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(n.has_cpu_kernel for n in norms):
        return None
    qkv_parts = _qlinear(quant, attn.qkv_proj, attn.qkv_proj._qnorm, segments=2)
    parts = [_qlinear(quant, attn.o_proj, attn.o_proj._qkernel),
             _qlinear(quant, mlp.gate_up_proj, mlp.gate_up_proj._qnorm),
             _qlinear(quant, mlp.down_proj, mlp.down_proj._qsilu)]
    if qkv_parts is None or any(p is None for p in parts):
        return None
    (o,), (gate_up,), (down,) = parts  # type: ignore[misc]
    qkv, tail = qkv_parts[0], (qkv_parts[1] if len(qkv_parts) > 1 else None)
    if tail is not None and tail.k != qkv.k:
        return None
    qkv_n = qkv.n + (0 if tail is None else tail.n)
    if (qkv_n != attn.q_size + 2 * attn.kv_size or o.k != attn.q_size
            or gate_up.n != 2 * down.k or qkv.k != o.n or gate_up.k != o.n or down.n != o.n):
        return None
    return make(qkv, o, gate_up, down, norms[0].weight, norms[0].eps, norms[1].weight,
                norms[1].eps, qkv_tail=tail)
