"""MLA attention with FlashInfer's MLA paged wrapper (``flashinfer.mla``).

Same latent cache as ``mla_triton`` (``[num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim]``, ``c_kv`` then ``k_pe``), and the same split of a step: the leading
short queries (decode, speculative verification) go through FlashInfer's
``BatchMLAPagedAttentionWrapper`` in the absorbed form -- ``q_lat = q_nope @ w_uk`` per
head before, ``out = out_lat @ w_uv^T`` per head after -- and longer queries (prefill,
cached prefix, chunked prefill) through lmkit's decompressed Triton prefill, inherited
from :class:`~lmkit_plugins.attention.mla_triton.MLATritonAttention` (FlashInfer's MLA
wrapper computes prefill in the absorbed form too, with four times the FLOPs at
DeepSeek's shapes). The new latent entries are written by lmkit's Triton kernel.

The wrapper takes the cache as two tensors, ``ckv_cache [num_pages, page_size, 512]``
and ``kpe_cache [num_pages, page_size, 64]``; it reads their page and token strides
(``ckv_stride_page``, ``ckv_stride_n`` in its ``run``) and needs only a unit last
stride, so the two are the views ``kv_cache[..., :kv_lora_rank]`` and
``kv_cache[..., kv_lora_rank:]`` of the contract's one tensor: nothing is copied.

FlashInfer compiles its MLA kernels for ``head_dim_ckv = 512`` and ``head_dim_kpe =
64`` (DeepSeek-V2/V3's dimensions); other dimensions are refused when the backend is
built.

CUDA graphs: a pure-decode step with ``metadata.cuda_graph`` plans a wrapper built with
``use_cuda_graph=True`` and fixed index buffers, one per batch size (created on first
use, kept for the graphs captured with it); its ``plan()`` rewrites those buffers in
place before each replay. Padding requests (no context) are given a context of one
token of their first block so that no request is empty; their rows are never read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from lmkit.api import AttentionMetadata

from lmkit_plugins.attention.mla_options import MLAFlashInferAttentionOptions
from lmkit_plugins.attention.mla_triton import MLATritonAttention, _MLATritonPlan
from lmkit_plugins.attention.page_lists import used_blocks

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
#: (kv_lora_rank, qk_rope_head_dim) FlashInfer's MLA kernels are built for
FLASHINFER_MLA_DIMS = (512, 64)


class MLAFlashInferAttention(MLATritonAttention):
    """Paged MLA on CUDA: FlashInfer's MLA wrapper for decode, lmkit's Triton prefill
    (float16, bfloat16; kv_lora_rank 512, rope 64)."""

    def __init__(self, **kwargs) -> None:
        options = kwargs.pop("options", None) or MLAFlashInferAttentionOptions()
        super().__init__(options=options, **kwargs)
        self._fi_options: MLAFlashInferAttentionOptions = options
        import flashinfer.mla  # the heavy import happens when the backend is built

        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"mla_flashinfer supports float16 and bfloat16, not {self.dtype}; "
                             "use --dtype bfloat16 or --attention mla_triton")
        dims = (self.kv_lora_rank, self.qk_rope_head_dim)
        if dims != FLASHINFER_MLA_DIMS:
            raise ValueError(f"mla_flashinfer needs kv_lora_rank={FLASHINFER_MLA_DIMS[0]} and "
                             f"qk_rope_head_dim={FLASHINFER_MLA_DIMS[1]} (FlashInfer's MLA "
                             f"kernels); this model has {dims[0]} and {dims[1]}. Use "
                             "--attention mla_triton")
        self._mla = flashinfer.mla
        # FlashInfer wants a zeroed float workspace on first use; one stream, one buffer
        self._workspace = torch.zeros(self._fi_options.workspace_mb * 1024 * 1024,
                                      dtype=torch.uint8, device=self.device)
        self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            self._workspace, backend=self._fi_options.backend)
        self._graph_wrappers: dict[int, Any] = {}  # batch size -> use_cuda_graph wrapper
        self._planned: Any = None  # the wrapper planned for this step's absorbed part

    def _plan_absorbed(self, md: AttentionMetadata, num_decodes: int,
                       max_query_len: int) -> int:
        """Plan FlashInfer's wrapper for the leading ``num_decodes`` requests."""
        self._planned = None
        nd, bs = num_decodes, self.block_size
        if nd == 0:
            return 1
        qo_indptr = md.query_start_loc_cpu[: nd + 1].to(torch.int32)
        seq_lens = md.seq_lens_cpu[:nd].numpy().astype(np.int64)
        kv_len = np.maximum(seq_lens, 1)  # a padding request reads one (ignored) token
        num_pages = (kv_len + bs - 1) // bs
        kv_indptr = torch.zeros(nd + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.from_numpy(np.cumsum(num_pages))
        kv_indices = used_blocks(md.block_tables[:nd], num_pages)
        wrapper = (self._graph_wrapper(nd, md.block_tables.shape[1]) if md.cuda_graph
                   else self._wrapper)
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, torch.from_numpy(kv_len.astype(np.int32)),
                     self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, bs, True,
                     self.scale, self.dtype, self.dtype)
        self._planned = wrapper
        return 1

    def _graph_wrapper(self, batch_size: int, max_blocks_per_req: int) -> Any:
        """The ``use_cuda_graph=True`` wrapper for ``batch_size`` (fixed index buffers)."""
        wrapper = self._graph_wrappers.get(batch_size)
        if wrapper is None:
            def buffer(n: int) -> torch.Tensor:
                return torch.zeros(n, dtype=torch.int32, device=self.device)

            wrapper = self._mla.BatchMLAPagedAttentionWrapper(
                self._workspace, use_cuda_graph=True, qo_indptr=buffer(batch_size + 1),
                kv_indptr=buffer(batch_size + 1),
                kv_indices=buffer(batch_size * max_blocks_per_req),
                kv_len_arr=buffer(batch_size), backend=self._fi_options.backend)
            self._graph_wrappers[batch_size] = wrapper
        return wrapper

    def attend_latent(self, plan: _MLATritonPlan, q_lat: torch.Tensor, q_pe: torch.Tensor,
                         kv_cache: torch.Tensor) -> torch.Tensor:
        """FlashInfer's MLA over the latent cache views (no copy of the cache)."""
        rank = self.kv_lora_rank
        q_lat = q_lat.contiguous()
        out_lat = torch.empty_like(q_lat)
        self._planned.run(q_lat, q_pe.contiguous(), kv_cache[..., :rank], kv_cache[..., rank:],
                          out=out_lat)
        return out_lat
