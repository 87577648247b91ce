"""The pool of KV-cache blocks: reference counts, an LRU free queue, and the map from
content hash to cached block.

A block is *in use* while some request holds it (``ref_cnt > 0``). When the last
holder frees it, it goes to the tail of the free queue but keeps its hash, so a later
request with the same prefix can take it back (a prefix-cache hit) until it reaches
the head of the queue and is handed out as a fresh block; only then is its hash
dropped (an eviction). Requests free their blocks last-first, so a request's tail
blocks, the least likely to be shared, are evicted before its prefix.

Block 0 is reserved as the *null block*: never allocated, never freed, never cached.
Model runners may point padded block-table entries at it; whatever is written there
is garbage nobody reads. ``num_blocks`` counts it, so ``num_blocks - 1`` blocks hold
requests' tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from lmkit.kv_cache.hashing import BlockHash

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One block of the paged KV cache, as the host tracks it.

    ``block_hash`` is set while the block is registered in the prefix cache.
    ``prev_free``/``next_free`` link it into the free queue (``None`` when not free).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Free blocks in eviction order (head = least recently freed), as a doubly linked
    list through the blocks themselves so that a block can leave from the middle in
    O(1) when a prefix-cache hit takes it back."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # sentinels: head.next_free is the first free block, tail.prev_free the last
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free KV-cache blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` (which must be in this queue) in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (the last to be evicted)."""
        assert block.prev_free is None and block.next_free is None, f"{block} already free"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks from head (next evicted) to tail."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """A fixed set of ``num_blocks`` blocks with reference counts and a prefix cache.

    Args:
        num_blocks: size of the pool, the null block included (at least 2).
        enable_caching: keep freed blocks findable by hash; when off, hashes are never
            registered and every free block is simply free.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the KV-cache pool needs at least 2 blocks (1 is the reserved null block), "
                f"got {num_blocks}; give the KV cache more memory or set cache.num_blocks"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[NULL_BLOCK_ID + 1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        # on_evict(block_id, block_hash): a cached block is being handed out as a fresh
        # one; its contents are still intact (an offload tier stores them)
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        # on_cache(block): ``block`` was just registered under its hash (an offload
        # tier's write-through stores it once the step computing it has run)
        self.on_cache: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold tokens (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-free ones included)."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under ``block_hash``, in use or free, if any."""
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, ``ref_cnt = 1``.

        A taken block that was still cached loses its hash (counted in
        :attr:`num_evictions`). Raises ``ValueError`` if fewer are free; callers check
        :attr:`num_free_blocks` first.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self.on_evict is not None:
            self.on_evict(block.block_id, block.block_hash)
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its content hash.

        Returns False (and leaves ``block`` unregistered) when caching is off, the
        block is already registered, or another block already holds this hash (two
        requests computed the same content independently); the first one stays the
        one hits find.
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.on_cache is not None:
            self.on_cache(block)
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Withdraw ``block`` from the prefix cache without evicting it: it was
        registered for a step that then did not run it, so its contents are not the
        tokens its hash names."""
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order; blocks reaching zero go
        to the free-queue tail in that order (so pass a request's blocks last-first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their contents; they are just no
        longer shareable). Returns how many hashes were dropped."""
        num = len(self.cached_blocks)
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return num
