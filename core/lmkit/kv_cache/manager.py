"""Per-request block tables over a :class:`BlockPool`, with prefix caching.

The scheduler drives it: :meth:`KVCacheManager.get_computed_blocks` when a request is
admitted (what its prefix already has in the cache), :meth:`allocate_slots` before
each step a request runs in, :meth:`free` when it finishes or is preempted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmkit.kv_cache.block_pool import BlockPool, KVCacheBlock
from lmkit.kv_cache.hashing import DEFAULT_SEED, BlockHash, update_block_hashes

if TYPE_CHECKING:
    from lmkit.api.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Owns every request's block table and the prefix cache.

    Args:
        num_blocks: KV pool size in blocks, the reserved null block included.
        block_size: tokens per block.
        enable_prefix_caching: reuse full blocks across requests by content hash.
        max_model_len: if given, no request gets slots past this many tokens
            (lookahead slots are clipped to it).
        hash_seed: root of the block-hash chains (see :mod:`lmkit.kv_cache.hashing`).
        sliding_window: when every attention layer reads only the last ``sliding_window``
            keys (:attr:`lmkit.api.ModelInfo.kv_window`), a running request's blocks
            wholly behind the window of its next token are released (its block table
            keeps the null block there; backends never read keys behind the window).
            ``None``: a request keeps all its blocks.

    Counters: :attr:`prefix_cache_queries` / :attr:`prefix_cache_hits` are in tokens
    (tokens looked up / tokens found), :attr:`num_evictions` in blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        hash_seed: BlockHash = DEFAULT_SEED,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.hash_seed = hash_seed
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # request id -> its blocks, in token order
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its leading blocks are registered in the prefix cache
        self.num_cached_blocks: dict[str, int] = {}
        # request id -> how many of its leading blocks were released (behind the window)
        self.num_released_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- counters -----------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (they may still be prefix-cache hits)."""
        return self.block_pool.num_free_blocks

    @property
    def num_evictions(self) -> int:
        """Cached blocks whose hash was dropped because they were reallocated."""
        return self.block_pool.num_evictions

    # -- admission ----------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks matching ``request``'s leading full blocks.

        Called for a request with no computed tokens (new, or resumed after a
        preemption). The hit never covers the last token, so at least one token is
        computed and yields logits. Requests asking for prompt logprobs and pooling
        requests skip the cache (every prompt position must be computed). Counts the query and the hit.

        Returns:
            ``(blocks, num_computed_tokens)``; pass ``blocks`` to :meth:`allocate_slots`,
            which takes the references.
        """
        if (not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None
                or request.pooling_params is not None):
            return [], 0
        hashes = update_block_hashes(request, self.block_size, self.hash_seed)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hit_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return blocks, num_hit_tokens

    # -- allocation ---------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (plus lookahead).

        Args:
            request: its ``num_computed_tokens`` tokens already have slots.
            num_new_tokens: tokens to compute this step (after any prefix hit).
            num_lookahead_tokens: extra slots reserved past them (draft tokens a
                proposer will write).
            new_computed_blocks: prefix-cache hits from :meth:`get_computed_blocks`
                (only when the request is admitted); they are referenced and prepended.

        Returns:
            The ids of the newly allocated blocks (hits excluded), or ``None`` when the
            pool has too few free blocks, in which case nothing was allocated (blocks
            behind a sliding window may have been released: they are not read again).

        Full blocks holding tokens computed up to the end of this step are registered
        in the prefix cache at once, so a request admitted later in the same step
        already hits them (the attention backend writes a step's KV before any of the
        step's attention reads it).
        """
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks and not new_computed_blocks and self.sliding_window is None:
            # a running request (every decode step): the same as below with nothing to
            # release and no hits, and no new block while its blocks hold the slots
            num_computed = request.num_computed_tokens
            num_slots = self._num_slots(num_computed, num_new_tokens, num_lookahead_tokens)
            if num_slots <= len(req_blocks) * self.block_size:
                if self.enable_prefix_caching:
                    self.cache_blocks(request, min(num_computed + num_new_tokens,
                                                   request.num_tokens))
                return []
        hits = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if req_blocks:  # running: first give back what fell behind the window
            self._release_behind_window(request.request_id, req_blocks,
                                        request.num_computed_tokens)
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_slots = self._num_slots(num_computed, num_new_tokens, num_lookahead_tokens)
        num_blocks_needed = max(0, cdiv(num_slots, self.block_size) - len(req_blocks) - len(hits))
        # hits sitting in the free queue stop being free once referenced
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_blocks_needed + num_free_hits > self.block_pool.num_free_blocks:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if hits:
            assert not req_blocks, "prefix hits are only taken when a request is admitted"
            self.block_pool.touch(hits)
            req_blocks.extend(hits)
            self.num_cached_blocks[request.request_id] = len(hits)
        new_blocks = self.block_pool.get_new_blocks(num_blocks_needed)
        req_blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def _num_slots(self, num_computed: int, num_new: int, num_lookahead: int) -> int:
        """The slots a request needs to compute ``num_new`` tokens after
        ``num_computed``, plus ``num_lookahead`` reserved past them (those clipped to
        ``max_model_len``)."""
        num_slots = num_computed + num_new + num_lookahead
        if self.max_model_len is not None:
            num_slots = min(num_slots, max(self.max_model_len, num_computed + num_new))
        return num_slots

    def _release_behind_window(self, request_id: str, req_blocks: list[KVCacheBlock],
                               num_computed: int) -> None:
        """Free the blocks holding only keys before ``num_computed - window + 1`` (the
        earliest key the next query, at ``num_computed``, reads), oldest last; they stay
        findable in the prefix cache until evicted."""
        if self.sliding_window is None:
            return
        end = min(max(0, num_computed - self.sliding_window + 1) // self.block_size,
                  len(req_blocks))
        start = self.num_released_blocks.get(request_id, 0)
        if end <= start:
            return
        released = req_blocks[start:end]
        req_blocks[start:end] = [self.block_pool.null_block] * (end - start)
        self.num_released_blocks[request_id] = end
        self.block_pool.free_blocks(reversed(released))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register ``request``'s full blocks among its first ``num_tokens`` tokens
        (whose KV is computed or being computed this step) in the prefix cache."""
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = update_block_hashes(request, self.block_size, self.hash_seed)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    # -- release ------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release ``request``'s blocks, last block first (tail blocks are evicted
        before the shared prefix). Cached blocks stay findable until evicted.

        Blocks registered for tokens past ``request.num_computed_tokens`` (scheduled
        this step, then preempted before the step ran) are withdrawn from the cache
        first: their KV was never written.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        num_released = self.num_released_blocks.pop(request.request_id, 0)
        if not blocks:
            return
        for block in blocks[request.num_computed_tokens // self.block_size:num_cached]:
            self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks[num_released:]))

    def has_pending_shared_blocks(self, request: Request) -> bool:
        """Whether another request references one of ``request``'s blocks that is
        registered but not computed yet (it hit them this step, counting on
        ``request`` to compute them in this step). Such a request must not be
        preempted now."""
        start = request.num_computed_tokens // self.block_size
        end = self.num_cached_blocks.get(request.request_id, 0)
        blocks = self.req_to_blocks.get(request.request_id, ())
        return any(b.ref_cnt > 1 for b in blocks[start:end])

    def get_block_ids(self, request: Request) -> list[int]:
        """``request``'s block table (a new list)."""
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]

    def reset_prefix_cache(self) -> int:
        """Drop every cached hash (e.g. after new weights are loaded); returns how many.

        Running requests keep their blocks; blocks they fill from now on are cached."""
        return self.block_pool.reset_prefix_cache()
