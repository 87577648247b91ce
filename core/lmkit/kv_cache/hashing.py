"""Content hashes of KV-cache blocks, chained so that a hash names a whole prefix.

A full block's hash is ``H(parent_hash, token ids of the block, extra keys)``: two
blocks have the same hash only when every token before and in them is the same, and
so are the extra keys (the request's ``cache_salt`` on the first block; later blocks
inherit it through the chain). Hashes are ``bytes`` from BLAKE2b over a fixed byte
encoding, so they are stable across processes and restarts: an offload tier may store
blocks on disk under them. Give each model a different ``seed`` (the root parent) if
blocks of several models can share a store.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmkit.api.request import Request

BlockHash = bytes

HASH_SIZE = 32  # bytes per block hash
DEFAULT_SEED: BlockHash = hashlib.blake2b(b"lmkit-kv-block-v1", digest_size=HASH_SIZE).digest()

ExtraKey = str | int | bytes

_BIG_ENDIAN = sys.byteorder == "big"


def _encode_extra(key: ExtraKey) -> bytes:
    """Type-tagged, length-prefixed bytes of one extra key, so encodings never collide."""
    if isinstance(key, bytes):
        tag, raw = b"b", key
    elif isinstance(key, str):
        tag, raw = b"s", key.encode("utf-8")
    elif isinstance(key, int):
        tag, raw = b"i", str(key).encode("ascii")
    else:
        raise TypeError(f"block hash extra keys must be str, int or bytes, got {type(key).__name__}")
    return tag + len(raw).to_bytes(4, "little") + raw


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] = (),
    seed: BlockHash = DEFAULT_SEED,
) -> BlockHash:
    """The chained hash of one full block.

    Args:
        parent_hash: the previous block's hash, or ``None`` for a request's first block
            (``seed`` stands in for it).
        token_ids: the block's tokens (exactly ``block_size`` of them).
        extra_keys: anything else that changes the KV of these tokens (cache salt,
            adapter name); empty for most blocks.
        seed: the root of every chain (see the module docstring).

    Returns:
        ``HASH_SIZE`` bytes.
    """
    h = hashlib.blake2b(digest_size=HASH_SIZE)
    h.update(seed if parent_hash is None else parent_hash)
    tokens = array("q", token_ids)  # int64, little-endian below
    if _BIG_ENDIAN:
        tokens.byteswap()
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(tokens.tobytes())
    h.update(len(extra_keys).to_bytes(4, "little"))
    for key in extra_keys:
        h.update(_encode_extra(key))
    return h.digest()


def request_extra_keys(request: Request, block_index: int) -> tuple[ExtraKey, ...]:
    """Extra keys of block ``block_index`` of ``request``: the cache salt on block 0."""
    if block_index == 0 and request.cache_salt:
        return (request.cache_salt,)
    return ()


def update_block_hashes(
    request: Request, block_size: int, seed: BlockHash = DEFAULT_SEED
) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of ``all_token_ids``.

    Incremental: only blocks filled since the last call are hashed, so calling this
    every step costs O(new blocks). Returns ``request.block_hashes``.
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        start = i * block_size
        parent = hash_block_tokens(
            parent, tokens[start:start + block_size], request_extra_keys(request, i), seed
        )
        hashes.append(parent)
    return hashes
