"""Paged attention for float32 on the CPU: lmkit's C decode kernel, torch for the rest.

A step in which every request decodes one token (single-stream and batched decoding,
the CPU's common step) goes through :mod:`lmkit_kernels.cpu.paged_decode`, which
stores the new K/V and attends each request's query straight from its cache blocks.
Any other step (prefill, chunked prefill, prefill over a cached prefix, mixed steps,
multi-token queries) is planned and run exactly as :class:`TorchAttention` does, so
every property of the reference holds; the decode path differs from it only in the
order of float32 sums. When the kernel cannot be built on this machine the backend
logs why once and runs every step as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lmkit.api import AttentionMetadata

from lmkit_plugins.attention.torch_ref import TorchAttention


@dataclass
class _DecodePlan:
    num_tokens: int
    slot_mapping: torch.Tensor  # int64 [num_tokens], contiguous
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks], unit stride along blocks
    seq_lens: torch.Tensor  # int32 [num_reqs], contiguous


class CpuAttention(TorchAttention):
    """:class:`TorchAttention` with decode-only steps in a C kernel (CPU, float32)."""

    supports_logits_soft_cap = False  # the C decode kernel does not soft-cap

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        kernel = None
        if torch.device(self.device).type == "cpu" and self.dtype == torch.float32:
            from lmkit_kernels.cpu.paged_decode import decode_attention_kernel

            kernel = decode_attention_kernel()
        self._decode_kernel = kernel
        self._decode: _DecodePlan | None = None
        self._metadata: AttentionMetadata | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        """Decode-only steps: the kernel's arguments; other steps: the reference plan."""
        md = metadata
        n = md.num_actual_tokens
        if self._decode_kernel is not None and n == md.num_reqs > 0 and not md.cuda_graph:
            tables = md.block_tables[:n]
            self._decode = _DecodePlan(
                n, md.slot_mapping[:n].contiguous(),
                tables if tables.stride(1) == 1 else tables.contiguous(),
                md.seq_lens_cpu[:n].to(torch.int32).contiguous())
            self._plan = None
            self._metadata = md  # planned as the reference only if run() needs it
            return
        self._decode = None
        self._metadata = None
        super().plan(metadata)

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_cache: torch.Tensor) -> torch.Tensor:
        """As :meth:`TorchAttention.run`; decode-only steps through the C kernel."""
        plan = self._decode
        if plan is None:
            return super().run(layer, q, k, v, kv_cache)
        if q.shape[0] != plan.num_tokens or not _kernel_layout(q, k, v, kv_cache):
            # padded rows, or head views the kernel cannot read: the reference
            if self._plan is None:
                super().plan(self._metadata)  # type: ignore[arg-type]
            return super().run(layer, q, k, v, kv_cache)
        return self._decode_kernel(q, k, v, kv_cache, plan.slot_mapping,  # type: ignore[misc]
                                   plan.block_tables, plan.seq_lens, self.scale,
                                   self.sliding_window or 0)


def _kernel_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kv_cache: torch.Tensor) -> bool:
    """Whether the kernel reads these tensors as they are: rows of contiguous heads
    (any row stride, as views of a fused QKV output have) and a contiguous cache."""
    d = q.shape[2]
    return (all(t.stride(2) == 1 and t.stride(1) == d for t in (q, k, v))
            and kv_cache.is_contiguous())
