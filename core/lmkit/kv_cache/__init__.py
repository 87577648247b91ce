"""The paged KV cache on the host side: block hashing, the block pool, and the
per-request block tables with prefix caching. Pure Python; no torch."""

from lmkit.kv_cache.block_pool import BlockPool, KVCacheBlock
from lmkit.kv_cache.hashing import BlockHash, hash_block_tokens, update_block_hashes
from lmkit.kv_cache.manager import KVCacheManager

__all__ = [
    "BlockHash", "BlockPool", "KVCacheBlock", "KVCacheManager", "hash_block_tokens",
    "update_block_hashes",
]
