"""Paged attention with FlashInfer's batch decode and batch prefill wrappers.

Cache layout: lmkit's ``[2, num_blocks, block_size, num_kv_heads, head_size]``. Each
half is FlashInfer's ``NHD`` paged cache (``[num_pages, page_size, num_kv_heads,
head_dim]``), passed to ``run`` as the ``(k_cache, v_cache)`` tuple FlashInfer accepts,
so this backend shares caches with the torch and triton backends. New K/V are written
by lmkit's Triton ``reshape_and_cache`` (through ``slot_mapping``).

Per step, :meth:`FlashInferAttention.plan` turns the metadata into FlashInfer's page
lists -- ``paged_kv_indptr`` and ``paged_kv_last_page_len`` on the host from
``seq_lens_cpu``, ``paged_kv_indices`` gathered on the device from ``block_tables``
(no sync) -- and calls ``plan()`` on the decode wrapper for the leading one-token
requests and on the prefill wrapper (causal) for the rest. :meth:`run` then calls the
wrappers' ``run()`` for every layer.

CUDA graphs: a step the runner captures or replays must say so with
``metadata.cuda_graph = True`` (and be pure decode). Such steps use a decode
wrapper built with ``use_cuda_graph=True`` and fixed index buffers, one per batch size
(created on first use, kept for the graphs that captured it), whose ``plan()`` rewrites
those buffers in place before each replay. Other steps use the ordinary wrappers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lmkit.api import AttentionBackend, AttentionMetadata
from lmkit_kernels.cache_write import reshape_and_cache

from lmkit_plugins.attention import FlashInferAttentionOptions

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_SIZES = (64, 128, 256)


@dataclass
class _FlashInferPlan:
    num_reqs: int
    num_tokens: int
    num_decodes: int  # leading requests with one query token
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    decode: Any  # the planned decode wrapper, or None
    prefill: Any  # the planned prefill wrapper, or None


class FlashInferAttention(AttentionBackend):
    """FlashInfer paged attention (float16/bfloat16, head sizes 64/128/256, GQA,
    sliding window, attention-score soft cap, mixed prefill/decode, cached prefixes,
    chunked prefill)."""

    supports_model_kv_write = True  # kv_write_slots(), run(..., kv_written=True)
    supports_logits_soft_cap = True  # FlashInfer's logits_soft_cap (planned per step)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        import flashinfer  # the heavy import happens when the backend is built

        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"flashinfer attention supports float16 and bfloat16, not "
                             f"{self.dtype}; use --dtype bfloat16 or --attention triton")
        if self.head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"flashinfer attention supports head sizes {SUPPORTED_HEAD_SIZES},"
                             f" not {self.head_size}; use --attention triton or --attention torch")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        self.options = self.options or FlashInferAttentionOptions()
        self._flashinfer = flashinfer
        group = self.num_heads // self.num_kv_heads
        self._use_tensor_cores = (group >= 4 if self.options.use_tensor_cores is None
                                  else self.options.use_tensor_cores)
        # window_left: keys at positions >= pos - window_left are visible (inclusive)
        self._window_left = -1 if self.sliding_window is None else self.sliding_window - 1
        # FlashInfer requires a zeroed float workspace on first use; wrappers share it
        # because they run one after another on the same stream.
        self._workspace = torch.zeros(self.options.workspace_mb * 1024 * 1024,
                                      dtype=torch.uint8, device=self.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self._use_tensor_cores)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._graph_decode: dict[int, Any] = {}  # batch size -> use_cuda_graph wrapper
        self._plan: _FlashInferPlan | None = None

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``: keys, then values."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    # ------------------------------------------------------------------ plan

    def plan(self, metadata: AttentionMetadata) -> None:
        """Build FlashInfer's page lists for this step and plan both wrappers."""
        self.refuse_tree_metadata(metadata)
        md = metadata
        num_reqs, bs = md.num_reqs, self.block_size
        qsl = md.query_start_loc_cpu[: num_reqs + 1].to(torch.int32)
        seq_lens = md.seq_lens_cpu[:num_reqs].to(torch.int32)
        query_lens = qsl[1:] - qsl[:-1]
        not_decode = torch.nonzero(query_lens != 1)
        num_decodes = int(not_decode[0, 0]) if len(not_decode) else num_reqs
        # pages per request, and how full each request's last page is (0 if none)
        num_pages = (seq_lens + bs - 1) // bs
        last_page_len = torch.where(num_pages > 0, seq_lens - (num_pages - 1) * bs, 0)
        kv_indptr = torch.zeros(num_reqs + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(num_pages, 0)
        kv_indices = self._gather_page_indices(md.block_tables[:num_reqs], num_pages, kv_indptr)

        use_graph = md.cuda_graph
        if use_graph and num_decodes != num_reqs:
            raise RuntimeError("flashinfer attention can capture only pure-decode steps in a "
                               f"CUDA graph; this step has {num_reqs - num_decodes} requests "
                               "with several query tokens. Run such steps eagerly.")
        common = dict(num_qo_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                      page_size=bs, window_left=self._window_left, sm_scale=self.scale,
                      logits_soft_cap=self.logits_soft_cap, q_data_type=self.dtype,
                      kv_data_type=self.dtype)
        decode = prefill = None
        nd = num_decodes
        if nd:
            decode = (self._graph_decode_wrapper(nd, md.block_tables.shape[1]) if use_graph
                      else self._decode)
            decode.plan(self._to_host_pinned(kv_indptr[: nd + 1]),
                        kv_indices[: int(kv_indptr[nd])],
                        self._to_host_pinned(last_page_len[:nd]),
                        head_dim=self.head_size, pos_encoding_mode="NONE", **common)
        if nd < num_reqs:
            prefill = self._prefill
            prefill.plan(self._to_host_pinned(qsl[nd:] - qsl[nd]),
                         self._to_host_pinned(kv_indptr[nd:] - kv_indptr[nd]),
                         kv_indices[int(kv_indptr[nd]):],
                         self._to_host_pinned(last_page_len[nd:]),
                         head_dim_qk=self.head_size, causal=True, **common)
        self._plan = _FlashInferPlan(num_reqs, md.num_actual_tokens, nd,
                                     md.slot_mapping[: md.num_actual_tokens], decode, prefill)

    def _gather_page_indices(self, block_tables: torch.Tensor, num_pages: torch.Tensor,
                             kv_indptr: torch.Tensor) -> torch.Tensor:
        """int32 ``[total_pages]`` on the device: each request's used block ids, in order."""
        total = int(kv_indptr[-1])
        width = block_tables.shape[1]
        rows = torch.repeat_interleave(torch.arange(len(num_pages)), num_pages)
        cols = torch.arange(total) - torch.repeat_interleave(kv_indptr[:-1].long(), num_pages)
        flat = self._to_device(rows * width + cols)
        return block_tables.reshape(-1).index_select(0, flat)

    def _graph_decode_wrapper(self, batch_size: int, max_blocks_per_req: int) -> Any:
        """The ``use_cuda_graph=True`` decode wrapper for ``batch_size`` (fixed buffers)."""
        wrapper = self._graph_decode.get(batch_size)
        if wrapper is None:
            device = self.device
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=self._use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32,
                                                   device=device),
                paged_kv_indices_buffer=torch.zeros(batch_size * max_blocks_per_req,
                                                    dtype=torch.int32, device=device),
                paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32,
                                                          device=device))
            self._graph_decode[batch_size] = wrapper
        return wrapper

    def _to_host_pinned(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host copy, so FlashInfer's non-blocking uploads never wait."""
        t = t.contiguous()
        return t.pin_memory() if torch.device(self.device).type == "cuda" else t

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return self._to_host_pinned(t).to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ run

    def kv_write_slots(self) -> torch.Tensor:
        """This step's ``slot_mapping``: models may write K/V themselves (the cache is
        lmkit's layout) and call ``run(..., kv_written=True)``."""
        if self._plan is None:
            raise RuntimeError("FlashInferAttention.kv_write_slots() called before plan()")
        return self._plan.slot_mapping

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_cache: torch.Tensor, *, kv_written: bool = False) -> torch.Tensor:
        """Write ``k``/``v`` at ``slot_mapping`` (unless the caller already did:
        ``kv_written``), then attend every request causally.

        :param q: ``[num_tokens, num_heads, head_size]`` (rows past the step's tokens,
            CUDA-graph padding, come back as zeros)
        :param k: ``[num_tokens, num_kv_heads, head_size]``
        :param v: ``[num_tokens, num_kv_heads, head_size]``
        :param kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``
        :return: ``[num_tokens, num_heads, head_size]`` in ``q``'s dtype
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("FlashInferAttention.run() called before plan() for this step")
        if not kv_written:
            reshape_and_cache(k, v, kv_cache, plan.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        n, nd = plan.num_tokens, plan.num_decodes
        if q.shape[0] > n:
            out[n:].zero_()
        paged_kv = (kv_cache[0], kv_cache[1])  # NHD: [num_blocks, block_size, heads, dim]
        if plan.decode is not None:
            plan.decode.run(q[:nd], paged_kv, out=out[:nd])
        if plan.prefill is not None:
            plan.prefill.run(q[nd:n], paged_kv, out=out[nd:n])
        return out
