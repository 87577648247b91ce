"""Choosing the engine core of each request when several run behind one server (data
parallel).

Two signals, in order:

1. **Prefix affinity.** The prompt's first full KV blocks (up to
   :data:`AFFINITY_BLOCKS` of ``block_size`` tokens) are hashed as a chain, as the
   engine's prefix cache hashes them. A request whose longest known chain was last
   served by engine ``e`` goes to ``e``, where those blocks are likely still cached,
   unless ``e`` is clearly busier than the least-loaded engine (more than
   ``slack + least / 2`` outstanding requests above it). The table is an LRU of at most
   ``max_affinity_entries`` chains.
2. **Load.** Otherwise the engine with the fewest outstanding requests, then the fewest
   outstanding tokens; ties rotate, so an idle server spreads requests evenly.

Outstanding means routed and not yet finished, as counted by :meth:`EngineRouter.add`
and :meth:`EngineRouter.release`; the frontend keeps every request (and its aborts) on
the engine chosen for it. Dead engines are never chosen.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

AFFINITY_BLOCKS = 8  # longest prompt prefix (in blocks) remembered for affinity
DEFAULT_AFFINITY_ENTRIES = 65_536
DEFAULT_AFFINITY_SLACK = 2


class EngineRouter:
    """Load-aware, prefix-affine choice among ``num_engines`` engines (pure logic)."""

    def __init__(self, num_engines: int, block_size: int, *,
                 max_affinity_entries: int = DEFAULT_AFFINITY_ENTRIES,
                 affinity_slack: int = DEFAULT_AFFINITY_SLACK) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be at least 1, got {num_engines}")
        self.num_engines = num_engines
        self.block_size = block_size
        self.max_affinity_entries = max_affinity_entries
        self.affinity_slack = affinity_slack
        self.num_requests = [0] * num_engines  # outstanding, per engine
        self.num_tokens = [0] * num_engines
        self.num_routed = [0] * num_engines  # chosen by choose(), since start
        self.num_affinity_hits = 0
        self._affinity: OrderedDict[int, int] = OrderedDict()  # prefix chain hash -> engine
        self._next = 0  # where ties start (rotates)

    def prefix_hashes(self, prompt_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the prompt's first full blocks, shortest prefix first."""
        hashes: list[int] = []
        parent = 0
        num_blocks = min(len(prompt_ids) // self.block_size, AFFINITY_BLOCKS)
        for b in range(num_blocks):
            block = tuple(prompt_ids[b * self.block_size:(b + 1) * self.block_size])
            parent = hash((parent, block))
            hashes.append(parent)
        return hashes

    def choose(self, prompt_ids: Sequence[int], alive: Sequence[bool]) -> int:
        """The engine for a new request with ``prompt_ids`` among the ``alive`` ones;
        remembers its prefix for the next requests. Call :meth:`add` once it is sent.

        :raises ValueError: when no engine is alive.
        """
        candidates = [e for e in range(self.num_engines) if alive[e]]
        if not candidates:
            raise ValueError("no engine is alive")
        least = self._least_loaded(candidates)
        hashes = self.prefix_hashes(prompt_ids)
        chosen = least
        for h in reversed(hashes):  # the longest prefix seen before wins
            engine = self._affinity.get(h)
            if engine is None:
                continue
            if alive[engine] and not self._clearly_busier(engine, least):
                chosen = engine
                self.num_affinity_hits += 1
            break
        for h in hashes:
            self._affinity[h] = chosen
            self._affinity.move_to_end(h)
        while len(self._affinity) > self.max_affinity_entries:
            self._affinity.popitem(last=False)
        self.num_routed[chosen] += 1
        return chosen

    def add(self, engine: int, num_tokens: int) -> None:
        """Count a request sent to ``engine`` as outstanding."""
        self.num_requests[engine] += 1
        self.num_tokens[engine] += num_tokens

    def release(self, engine: int, num_tokens: int) -> None:
        """Count a request of ``engine`` as done (finished, aborted or failed)."""
        self.num_requests[engine] = max(0, self.num_requests[engine] - 1)
        self.num_tokens[engine] = max(0, self.num_tokens[engine] - num_tokens)

    def forget_engine(self, engine: int) -> None:
        """Drop ``engine``'s affinities (it died: its prefix cache is gone)."""
        for h in [h for h, e in self._affinity.items() if e == engine]:
            del self._affinity[h]

    @property
    def num_affinity_entries(self) -> int:
        """Prefix chains remembered."""
        return len(self._affinity)

    def _least_loaded(self, candidates: list[int]) -> int:
        start = self._next
        self._next = (self._next + 1) % self.num_engines
        order = sorted(candidates, key=lambda e: (self.num_requests[e], self.num_tokens[e],
                                                  (e - start) % self.num_engines))
        return order[0]

    def _clearly_busier(self, engine: int, least: int) -> bool:
        base = self.num_requests[least]
        return self.num_requests[engine] > base + self.affinity_slack + base // 2
