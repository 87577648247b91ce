"""Paged attention on the CPU: lmkit's C decode and encoder kernels, torch for the rest.

In float32, a step in which every request decodes one token (single-stream and batched
decoding, the CPU's common step) goes through :mod:`lmkit_kernels.cpu.paged_decode`,
which stores the new K/V and attends each request's query straight from its cache
blocks. So does a causal step whose requests each have at most
:data:`MAX_FLAT_QUERY` query tokens (a speculative verification, a short prompt, the
draft head's catch-up), one kernel row per token: token ``j`` of a request's ``q``
attends its request's first ``seq_len - (q - 1 - j)`` keys, exactly what a decode step at
its position attends (``LMKIT_CPU_FLAT_QUERIES=0`` keeps such steps on the reference's
path). In float32 and bfloat16, an encoder's step (non-causal, every key one of the
step's tokens; head size a multiple of 16) goes through
:mod:`lmkit_kernels.cpu.encoder_attention`, which attends each request's packed rows in
place (no padding, no gathers). Any other step (longer prefills and chunks, mixed steps
with one, and every step with a draft tree, even one of single-token
queries) is planned and run exactly as :class:`TorchAttention` does, so
every property of the reference holds; the kernels differ from it only in the order
of float32 sums (and, in bfloat16, in rounding the float32 output once). When the kernel cannot be built on this machine the backend
logs why once and runs every step as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lmkit.api import AttentionMetadata, switched_off

from lmkit_plugins.attention.torch_ref import TorchAttention

#: causal steps whose requests have at most this many query tokens each run through the
#: decode kernel, one row per token (longer queries: the reference's prefill)
MAX_FLAT_QUERY = 16
#: ``0`` keeps multi-token queries on the reference's path (read when a backend is built)
FLAT_QUERIES_ENV = "LMKIT_CPU_FLAT_QUERIES"


@dataclass
class _DecodePlan:
    num_tokens: int
    slot_mapping: torch.Tensor  # int64 [num_tokens], contiguous
    block_tables: torch.Tensor  # int32 [num_tokens, max_blocks], unit stride along blocks
    seq_lens: torch.Tensor  # int32 [num_tokens], contiguous: the keys each row attends
    multi_token: bool = False  # rows are the tokens of multi-token queries


@dataclass
class _EncoderPlan:
    num_tokens: int
    cu_seqlens: torch.Tensor  # int64 [num_reqs + 1], contiguous


class CpuAttention(TorchAttention):
    """:class:`TorchAttention` with decode-only steps and short multi-token causal steps
    (float32, a kernel row per token) and encoder steps (float32, bfloat16) in C kernels."""

    supports_logits_soft_cap = False  # the C decode kernel does not soft-cap
    supports_paged_decode_args = True  # decode-only steps: the C kernel's arguments
    supports_tree_mask = True  # tree steps: always the reference's plan and run

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        kernel = None
        if (torch.device(self.device).type == "cpu" and self.dtype == torch.float32
                and not self.fp8_kv_cache):  # (an FP8 cache: decode steps as the reference)
            from lmkit_kernels.cpu.paged_decode import decode_attention_kernel

            kernel = decode_attention_kernel()
        self._decode_kernel = kernel
        self._flat_queries = (kernel is not None and self.causal
                              and not switched_off(FLAT_QUERIES_ENV))
        encoder = None
        if (torch.device(self.device).type == "cpu" and not self.causal
                and self.head_size % 16 == 0):
            from lmkit_kernels.cpu.encoder_attention import encoder_attention_kernel

            encoder = encoder_attention_kernel(self.dtype)
        self._encoder_kernel = encoder
        self._decode: _DecodePlan | None = None
        self._encoder: _EncoderPlan | None = None
        self._metadata: AttentionMetadata | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        """Decode-only and encoder steps: the kernel's arguments; other steps (draft-tree
        steps included): the reference plan."""
        md = metadata
        n = md.num_actual_tokens
        self._encoder = None
        no_tree = md.tree_mask is None  # the C kernels attend no draft tree: the reference does
        if (no_tree and self._encoder_kernel is not None and n > 0 and not md.cuda_graph
                and int(md.seq_lens_cpu[:md.num_reqs].sum()) == n):
            # every key is one of this step's tokens: request r's rows are
            # query_start_loc[r] .. query_start_loc[r + 1] - 1
            self._encoder = _EncoderPlan(
                n, md.query_start_loc_cpu[:md.num_reqs + 1].to(torch.int64).contiguous())
            self._decode, self._plan = None, None
            self._metadata = md
            return
        if no_tree and self._decode_kernel is not None and n > 0 and not md.cuda_graph:
            decode = _decode_plan(md) if n == md.num_reqs else (
                _flat_plan(md) if self._flat_queries else None)
            if decode is not None:
                self._decode, self._plan = decode, None
                self._metadata = md  # planned as the reference only if run() needs it
                return
        self._decode = None
        self._metadata = None
        super().plan(metadata)

    def paged_decode_args(self, multi_token: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The planned step's decode-kernel arguments, one row per token (see
        :meth:`lmkit.api.AttentionBackend.paged_decode_args`); a step of multi-token
        queries only with ``multi_token``; else ``None``."""
        plan = self._decode
        if plan is None or (plan.multi_token and not multi_token):
            return None
        return plan.slot_mapping, plan.block_tables, plan.seq_lens

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_cache: torch.Tensor) -> torch.Tensor:
        """As :meth:`TorchAttention.run`; decode-only and encoder steps through the C
        kernels."""
        encoder = self._encoder
        if encoder is not None:
            n = encoder.num_tokens
            q, k, v = q[:n], k[:n], v[:n]
            if not _heads_contiguous(q, k, v):  # head views the kernel cannot read
                if self._plan is None:
                    super().plan(self._metadata)  # type: ignore[arg-type]
                return super().run(layer, q, k, v, kv_cache)
            return self._encoder_kernel(q, k, v, encoder.cu_seqlens,  # type: ignore[misc]
                                        self.scale)
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


def _heads_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether each row's heads are contiguous (any row stride, as views of a fused QKV
    output have), as the kernels read them."""
    d = q.shape[2]  # spelled out, not a generator: this runs per layer and step
    return (q.stride(2) == 1 and q.stride(1) == d and k.stride(2) == 1 and k.stride(1) == d
            and v.stride(2) == 1 and v.stride(1) == d)


def _kernel_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kv_cache: torch.Tensor) -> bool:
    """Whether the decode kernel reads these tensors as they are: rows of contiguous
    heads and a contiguous cache."""
    return _heads_contiguous(q, k, v) and kv_cache.is_contiguous()


def _decode_plan(md: AttentionMetadata) -> _DecodePlan:
    """A step of one query token per request: the kernel's rows are the requests."""
    n = md.num_actual_tokens
    tables = md.block_tables[:n]
    return _DecodePlan(n, md.slot_mapping[:n].contiguous(),
                       tables if tables.stride(1) == 1 else tables.contiguous(),
                       md.seq_lens_cpu[:n].to(torch.int32).contiguous())


def _flat_plan(md: AttentionMetadata) -> _DecodePlan | None:
    """A causal step of at most :data:`MAX_FLAT_QUERY` query tokens per request as one
    decode row per token: its slot, its request's block table, and its request's
    context up to and including it; ``None`` for longer queries."""
    n, r = md.num_actual_tokens, md.num_reqs
    starts = md.query_start_loc_cpu[:r + 1].to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    if int(starts[-1]) != n or int(q_lens.max()) > MAX_FLAT_QUERY:
        return None
    req = torch.repeat_interleave(torch.arange(r), q_lens)  # each token's request
    after = starts[1:][req] - 1 - torch.arange(n)  # its request's tokens after it
    seq_lens = md.seq_lens_cpu[:r].to(torch.int64)[req] - after
    return _DecodePlan(n, md.slot_mapping[:n].contiguous(),
                       md.block_tables[:r].index_select(0, req.to(md.block_tables.device)),
                       seq_lens.to(torch.int32).contiguous(), multi_token=True)
