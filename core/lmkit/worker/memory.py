"""How much memory the KV cache may use, and allocating it.

On the CPU the pool holds what the load can use, ``max_num_seqs x max_model_len``
tokens, but at most :data:`CPU_KV_RAM_FRACTION` of the machine's memory (and never less
than one request of ``max_model_len`` tokens); ``cache.kv_cache_memory_gb`` fixes it. On CUDA it is what ``cache.gpu_memory_utilization`` of the device leaves after the
weights, the peak activations of a profiling forward at the largest step, and memory
held outside torch's allocator (the CUDA context, libraries, other processes).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmkit.errors import ConfigError

if TYPE_CHECKING:
    from lmkit.api.kv_cache_spec import KVCacheGroup

# the CPU pool's default cap: this share of the machine's (or the cgroup's) memory
CPU_KV_RAM_FRACTION = 0.05


def kv_bytes_per_block(groups: Sequence[KVCacheGroup]) -> int:
    """Bytes one KV block takes across all layers of all KV cache groups, from each
    group's backend layout and dtype (:attr:`~lmkit.api.KVCacheGroup.page_bytes`)."""
    return sum(group.bytes_per_block for group in groups)


def cpu_kv_budget(kv_cache_memory_gb: float | None, bytes_per_block: int, block_size: int,
                  max_num_seqs: int, max_model_len: int, total_memory: int | None = None) -> int:
    """The CPU pool size in bytes.

    ``kv_cache_memory_gb`` when set; otherwise room for ``max_num_seqs`` requests of
    ``max_model_len`` tokens each (what the scheduler can ever hold at once, plus the
    null block), capped at :data:`CPU_KV_RAM_FRACTION` of ``total_memory`` (default: the
    machine's or the container's memory), but never below one request of
    ``max_model_len`` tokens, which the engine needs to start.
    """
    if kv_cache_memory_gb is not None:
        return int(kv_cache_memory_gb * 2**30)
    blocks_per_seq = -(-max_model_len // block_size)
    load = (max_num_seqs * blocks_per_seq + 1) * bytes_per_block
    one_request = (blocks_per_seq + 1) * bytes_per_block
    total = total_memory if total_memory is not None else system_memory_bytes()
    return max(one_request, min(load, int(CPU_KV_RAM_FRACTION * total)))


def system_memory_bytes() -> int:
    """Physical memory of this machine, or the cgroup v2 limit when lower (containers)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def cuda_kv_budget(device: torch.device, gpu_memory_utilization: float,
                   profile: Callable[[], None], baseline: int = 0,
                   reserve_for_graphs: bool = False) -> int:
    """Bytes left for the KV cache on ``device`` after running ``profile`` once.

    ``gpu_memory_utilization`` is this engine's share of the device (as in vLLM v1):
    memory that other engines of the same process held before this one started
    (``baseline``, bytes allocated through torch) is not counted against it, and the
    result never exceeds what is free now, less a margin. ``profile`` runs the largest
    forward (and logits) the runner will ever run, with the weights already loaded.
    ``reserve_for_graphs``: CUDA graphs are captured after the KV cache, and their
    memory pool holds up to one such forward's activations, so those stay free too
    (see :func:`kv_budget_bytes`). The result may be 0 (the caller reports it).
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return kv_budget_bytes(gpu_memory_utilization, total=total, free=free,
                           reserved=torch.cuda.memory_reserved(device), peak=peak,
                           baseline=baseline,
                           graph_reserve=max(0, peak - before) if reserve_for_graphs else 0)


HEADROOM_BYTES = 256 * 2**20  # allocator fragmentation, cuBLAS workspaces created later


def kv_budget_bytes(gpu_memory_utilization: float, *, total: int, free: int, reserved: int,
                    peak: int, baseline: int = 0, graph_reserve: int = 0) -> int:
    """The KV cache's bytes from a profile's measurements (:func:`cuda_kv_budget`).

    This engine's share is ``gpu_memory_utilization * total`` less what it used at the
    profile's peak (``peak - baseline``: the weights and the largest step's activations)
    and less memory held outside torch's allocator (``total - free - reserved``: the
    CUDA context, libraries, other processes). It never exceeds ``free`` less
    :data:`HEADROOM_BYTES` and ``graph_reserve``: when other engines hold memory (or the
    share is near 1), free memory binds, and the graphs captured after the KV cache must
    still fit.
    """
    outside_torch = max(0, (total - free) - reserved)
    budget = int(gpu_memory_utilization * total) - (peak - baseline) - outside_torch
    return max(0, min(budget, free - HEADROOM_BYTES - graph_reserve))


def allocate_kv_caches(groups: Sequence[KVCacheGroup], num_blocks: int,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer (indexed by layer), shaped by its group's
    backend, ``attn.kv_cache_shape(num_blocks)``, in the backend's KV cache dtype.

    Zeroed so that slots never written (padding a backend may read and mask) hold no
    NaN bit patterns.
    """
    caches: dict[int, torch.Tensor] = {}
    for group in groups:
        shape = group.attn.kv_cache_shape(num_blocks)
        for layer in group.layers:
            caches[layer] = torch.zeros(shape, dtype=group.attn.kv_cache_dtype, device=device)
    return [caches[layer] for layer in range(len(caches))]


def check_head_blocks_offloadable(target: list[torch.Tensor], head: list[torch.Tensor]
                                  ) -> None:
    """The offload tiers copy one block of every layer as one host row, so a draft head's
    KV cache must be laid out like the target's to ride along.

    Raises:
        ConfigError: the head's per-layer cache differs in shape or dtype.
    """
    want = target[0]
    for cache in head:
        if cache.shape != want.shape or cache.dtype != want.dtype:
            raise ConfigError(
                f"the KV offload tier carries the draft head's KV blocks beside the "
                f"target's, one layout for all: the head's cache is {list(cache.shape)} "
                f"{cache.dtype} per layer, the target's {list(want.shape)} {want.dtype} "
                "(a head with other KV head counts or sizes); turn offload off "
                "(--offload none) or use a head shaped like the target.")
