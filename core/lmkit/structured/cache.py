"""The grammar cache: compiled constraints, least recently used first out.

Compiled grammars can be large (xgrammar keeps a token-mask cache per grammar: tens of
kilobytes for a small schema, megabytes for one with many string patterns), and a
client can send a new schema with every request, so the cache is bounded both by
entries and by bytes (as the backend reports them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class GrammarCache:
    """A thread-safe LRU of ``key -> compiled grammar``.

    Args:
        max_entries: most entries kept (0 disables caching).
        max_bytes: most bytes kept, by the sizes given to :meth:`put` (0 = no limit);
            a single entry larger than this is not kept.
    """

    def __init__(self, max_entries: int, max_bytes: int = 0) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: str) -> Any | None:
        """The cached value (now most recently used), or ``None``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, value: Any, num_bytes: int = 0) -> None:
        """Keep ``value``, evicting the least recently used entries over the limits."""
        if self.max_entries <= 0 or (self.max_bytes and num_bytes > self.max_bytes):
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old[1]
            self._entries[key] = (value, num_bytes)
            self.num_bytes += num_bytes
            while len(self._entries) > self.max_entries or (
                    self.max_bytes and self.num_bytes > self.max_bytes):
                _, (_, size) = self._entries.popitem(last=False)
                self.num_bytes -= size
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def stats(self) -> dict[str, int]:
        """Entries, bytes, hits, misses and evictions since start."""
        return {"grammar_cache_entries": len(self._entries),
                "grammar_cache_bytes": self.num_bytes, "grammar_cache_hits": self.hits,
                "grammar_cache_misses": self.misses, "grammar_cache_evictions": self.evictions}
