"""Eviction policies over a fixed number of entries: LRU, and ARC as an option.

A policy only orders keys (block hashes); the tier owns the data. ``insert`` of a new
key returns the keys that must leave to make room, ``touch`` records a hit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable


class EvictionPolicy(ABC):
    """Keeps at most ``capacity`` keys; decides which leave when a new one arrives."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an eviction policy needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is held."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of keys held."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """Record a hit on held ``key``."""

    @abstractmethod
    def insert(self, key: Hashable) -> list[Hashable]:
        """Hold new ``key``; returns the keys evicted to make room (never ``key``)."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """Forget held ``key`` (e.g. its entry turned out to be damaged)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used leaves first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._keys: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def touch(self, key: Hashable) -> None:
        self._keys.move_to_end(key)

    def insert(self, key: Hashable) -> list[Hashable]:
        evicted = []
        while len(self._keys) >= self.capacity:
            evicted.append(self._keys.popitem(last=False)[0])
        self._keys[key] = None
        return evicted

    def remove(self, key: Hashable) -> None:
        self._keys.pop(key, None)


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo and Modha, 2003).

    ``t1`` holds keys seen once recently, ``t2`` keys hit again; ``b1``/``b2`` remember
    keys recently evicted from each (ghosts, no data). A new key that is a ghost of
    ``b1`` says recency deserved more room, one of ``b2`` says frequency did, and the
    target size ``p`` of ``t1`` adapts. Scans of one-time blocks (a long prompt read
    once) then cannot flush the blocks that are reused.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def touch(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]
        self.t2[key] = None

    def insert(self, key: Hashable) -> list[Hashable]:
        c = self.capacity
        evicted: list[Hashable] = []
        if key in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self._replace(in_b2=False, evicted=evicted)
            self.t2[key] = None
            return evicted
        if key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self._replace(in_b2=True, evicted=evicted)
            self.t2[key] = None
            return evicted
        if len(self.t1) + len(self.b1) >= c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                self._replace(in_b2=False, evicted=evicted)
            else:
                evicted.append(self.t1.popitem(last=False)[0])
        else:
            total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
            if total >= c:
                if total >= 2 * c:
                    self.b2.popitem(last=False)
                self._replace(in_b2=False, evicted=evicted)
        self.t1[key] = None
        return evicted

    def _replace(self, in_b2: bool, evicted: list[Hashable]) -> None:
        """Make room for one key when the cache is full: from ``t1`` while it is over
        its target ``p``, else from ``t2``; the victim becomes a ghost."""
        if len(self.t1) + len(self.t2) < self.capacity:
            return
        take_t1 = bool(self.t1) and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)
                                     or not self.t2)
        if take_t1:
            victim = self.t1.popitem(last=False)[0]
            self.b1[victim] = None
        else:
            victim = self.t2.popitem(last=False)[0]
            self.b2[victim] = None
        evicted.append(victim)

    def remove(self, key: Hashable) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` (``lru`` or ``arc``) for ``capacity`` entries."""
    try:
        return POLICIES[name](capacity)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}") from None
