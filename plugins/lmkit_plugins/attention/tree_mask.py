"""Draft-tree attention shared by the backends that declare ``supports_tree_mask``.

A step's metadata may carry a draft tree (:class:`lmkit.api.AttentionMetadata`
``tree_region``, ``tree_mask``): request ``r`` with ``seq_lens`` entry ``L`` and tree
region ``R > 0`` lets every query token see the keys before ``L - R`` and, of the
region's keys ``L - R + j``, those whose bit ``j`` is set in the token's int64 mask
entry (bit 63 is the sign bit); ``R = 0`` is ordinary causal attention.
:func:`tree_regions` reads and checks the regions on the host at plan time;
:func:`apply_tree` turns a causal visibility mask into the tree's (the torch reference).
"""

from __future__ import annotations

import numpy as np
import torch
from lmkit.api import MAX_TREE_REGION, AttentionMetadata

#: the highest mask bit (int64's sign bit)
MAX_TREE_BIT = MAX_TREE_REGION - 1


def tree_regions(md: AttentionMetadata) -> np.ndarray | None:
    """Each request's tree region (int64 ``[num_reqs]``, host) when the step carries a
    draft tree (``md.tree_mask`` set), else ``None``.

    :raises ValueError: when the tree metadata is incomplete or breaks the contract: a
        region outside ``0 .. MAX_TREE_REGION`` or longer than the request's context, a
        tree request with more query tokens than its region, a mask shorter than the
        step's tokens.
    """
    if md.tree_mask is None:
        return None
    if md.tree_region is None or md.tree_region_cpu is None:
        raise ValueError("the step's metadata carries tree_mask but not tree_region and "
                         "tree_region_cpu; a tree step gives all three")
    if md.tree_mask.shape[0] < md.num_actual_tokens:
        raise ValueError(f"tree_mask has {md.tree_mask.shape[0]} entries for "
                         f"{md.num_actual_tokens} query tokens")
    n = md.num_reqs
    regions = md.tree_region_cpu[:n].numpy().astype(np.int64)
    seq_lens = md.seq_lens_cpu[:n].numpy().astype(np.int64)
    query_lens = np.diff(md.query_start_loc_cpu[: n + 1].numpy().astype(np.int64))
    bad = ((regions < 0) | (regions > MAX_TREE_REGION) | (regions > seq_lens)
           | ((regions > 0) & (query_lens > regions)))
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"request {r}: tree region {int(regions[r])} does not fit (at most "
            f"{MAX_TREE_REGION}, its context {int(seq_lens[r])}, and at least its "
            f"{int(query_lens[r])} query tokens)")
    return regions


def apply_tree(allowed: torch.Tensor, keys: torch.Tensor, seq_lens: np.ndarray,
               regions: np.ndarray, bits: torch.Tensor) -> torch.Tensor:
    """``allowed`` (bool ``[num_reqs, max_q, kv_len]``: query ``i`` of request ``r`` sees
    key ``k``) with every tree request's rows replaced by the tree's visibility.

    :param keys: int64 ``[kv_len]``, the key indices ``0 .. kv_len - 1``.
    :param seq_lens: int64 ``[num_reqs]`` (host), each request's ``L``.
    :param regions: int64 ``[num_reqs]`` (host), each request's ``R`` (0: left causal).
    :param bits: int64 ``[num_reqs, max_q]`` on ``allowed``'s device, each query token's
        mask entry.
    """
    device = allowed.device
    lens = torch.from_numpy(seq_lens).to(device)[:, None, None]
    start = torch.from_numpy(seq_lens - regions).to(device)[:, None, None]
    j = keys[None, None, :] - start  # [R, 1, kv_len]: index in the region (< 0: before)
    in_region = (j >= 0) & (keys[None, None, :] < lens)
    bit = (bits[:, :, None] >> j.clamp(0, MAX_TREE_BIT)) & 1  # arithmetic shift: bit 63 too
    tree = (j < 0) | (in_region & (bit != 0))
    is_tree = torch.from_numpy(regions > 0).to(device)[:, None, None]
    return torch.where(is_tree, tree, allowed)
