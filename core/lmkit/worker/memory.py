"""How much memory the KV cache may use, and allocating it.

On the CPU the pool is a fixed size (``cache.kv_cache_memory_gb``, 2 GiB by default).
On CUDA it is what ``cache.gpu_memory_utilization`` of the device leaves after the
weights, the peak activations of a profiling forward at the largest step, and memory
held outside torch's allocator (the CUDA context, libraries, other processes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

DEFAULT_CPU_KV_CACHE_GB = 2.0


def kv_bytes_per_block(attn: Any, num_layers: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (K and V), from the backend's layout."""
    elems = math.prod(attn.kv_cache_shape(1))
    return elems * torch.empty((), dtype=dtype).element_size() * num_layers


def cpu_kv_budget(kv_cache_memory_gb: float | None) -> int:
    """The CPU pool size in bytes."""
    return int((kv_cache_memory_gb or DEFAULT_CPU_KV_CACHE_GB) * 2**30)


def cuda_kv_budget(device: torch.device, gpu_memory_utilization: float,
                   profile: Callable[[], None], baseline: int = 0) -> int:
    """Bytes left for the KV cache on ``device`` after running ``profile`` once.

    ``gpu_memory_utilization`` is this engine's share of the device (as in vLLM v1):
    memory that other engines of the same process held before this one started
    (``baseline``, bytes allocated through torch) is not counted against it, and the
    result never exceeds what is free now. ``profile`` runs the largest forward (and
    logits) the runner will ever run, with the weights already loaded. The result may
    be 0 (the caller reports it).
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # used on the device but not through torch's allocator: context, cuBLAS, others
    outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    budget = int(gpu_memory_utilization * total) - (peak - baseline) - outside_torch
    headroom = 256 * 2**20  # allocator fragmentation, cuBLAS workspaces created later
    return max(0, min(budget, free - headroom))


def allocate_kv_caches(attn: Any, num_layers: int, num_blocks: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer, shaped ``attn.kv_cache_shape(num_blocks)``.

    Zeroed so that slots never written (padding a backend may read and mask) hold no
    NaN bit patterns.
    """
    shape = attn.kv_cache_shape(num_blocks)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
