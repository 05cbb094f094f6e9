"""The adapter's books: which objects it holds, their bytes against the capacity, locks, LRU.

Pure bookkeeping with no I/O, so it is tested on its own (like the store's plan). It runs on the
adapter's event-loop thread only, which is why it has no lock: LMCache's threads hand every
request to that loop first.

An object is *pending* while its bytes are being written (it holds a reservation against the
capacity, so concurrent stores cannot overshoot it, but lookups do not see it yet), then
*ready*. A lookup-and-lock pins it (``locks``) until LMCache unlocks it, and a load in progress
holds it (``readers``): neither kind is chosen for eviction. An object evicted or deleted is
*retired*: gone from the index at once, but its bytes stay held against the capacity until its
storage is released (:meth:`ObjectIndex.released`) — at once, or when the last load still
reading it is done (:meth:`ObjectIndex.finish_read` says when). So the capacity never promises
room that the direct extent has not got back yet.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Entry:
    """One object: its key, its sizes and whatever holds its bytes (``slot``, opaque here)."""

    key: Hashable
    size: int  # the object's bytes, as LMCache counts them
    footprint: int  # what it takes of the capacity (padded to whole rows)
    slot: Any = None
    ready: bool = False
    locks: int = 0
    readers: int = 0
    retired: bool = False
    medium: str = ""  # "page-cache" or "direct": where the store placed it


@dataclass
class IndexCounters:
    """What the books saw; only grows."""

    lookups: int = 0
    lookup_hits: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    deletes: int = 0
    refused_no_room: int = 0
    by_medium: dict[str, int] = field(default_factory=dict)


class ObjectIndex:
    """Objects by key in least-recently-used order, within ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self._held = 0  # footprints of pending, ready and retired-but-unreleased entries
        self.counters = IndexCounters()

    # -- reading ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.ready)

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is known at all, pending or ready."""
        return key in self._entries

    @property
    def held_bytes(self) -> int:
        """Footprints of every pending and ready object, and of retired ones whose storage is
        not released yet: what the capacity must cover."""
        return self._held

    def ready(self, key: Hashable) -> Entry | None:
        """The ready object of ``key``, or None."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.ready else None

    def entries(self) -> list[Entry]:
        """Every pending and ready object, least recently used first (a copy)."""
        return list(self._entries.values())

    # -- storing ---------------------------------------------------------------------------------
    def victims(self, footprint: int) -> list[Entry] | None:
        """The least recently used ready objects, free of locks and readers, whose eviction
        makes room for ``footprint`` more bytes ([] when it fits already); None when even
        evicting every such object would not (too much is locked, pending or being read)."""
        need = self._held + footprint - self.capacity
        if need <= 0:
            return []
        chosen: list[Entry] = []
        for entry in self._entries.values():
            if entry.ready and entry.locks == 0 and entry.readers == 0:
                chosen.append(entry)
                need -= entry.footprint
                if need <= 0:
                    return chosen
        return None

    def reserve(self, key: Hashable, size: int, footprint: int) -> Entry:
        """A pending entry for ``key``, its footprint held against the capacity.

        Raises:
            KeyError: ``key`` is already known.
            ValueError: it does not fit (call :meth:`victims` and evict first).
        """
        if key in self._entries:
            raise KeyError(key)
        if self._held + footprint > self.capacity:
            raise ValueError(
                f"{footprint} more bytes do not fit: {self._held} of {self.capacity} are held"
            )
        entry = Entry(key, size, footprint)
        self._entries[key] = entry
        self._held += footprint
        return entry

    def commit(self, entry: Entry, slot: Any, medium: str) -> None:
        """The pending ``entry`` has its bytes: it becomes ready, most recently used."""
        assert self._entries.get(entry.key) is entry
        assert not entry.ready
        entry.slot, entry.ready, entry.medium = slot, True, medium
        self._entries.move_to_end(entry.key)
        by_medium = self.counters.by_medium
        by_medium[medium] = by_medium.get(medium, 0) + 1

    def abandon(self, entry: Entry) -> None:
        """The pending ``entry``'s write failed: forget it and its reservation."""
        assert self._entries.get(entry.key) is entry
        assert not entry.ready
        del self._entries[entry.key]
        self._held -= entry.footprint

    # -- looking up, locking, loading ------------------------------------------------------------
    def lookup_and_lock(self, keys: Iterable[Hashable]) -> list[bool]:
        """Which ``keys`` are ready; each of those gains a lock and becomes most recently used."""
        found = []
        for key in keys:
            entry = self.ready(key)
            self.counters.lookups += 1
            if entry is not None:
                self.counters.lookup_hits += 1
                entry.locks += 1
                self._entries.move_to_end(key)
            found.append(entry is not None)
        return found

    def unlock(self, keys: Iterable[Hashable]) -> None:
        """Drop one lock of each key; unknown or unlocked keys are ignored (LMCache unlocks the
        keys a lookup missed too)."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.locks > 0:
                entry.locks -= 1

    def start_read(self, key: Hashable) -> Entry | None:
        """Hold the ready object of ``key`` for a load (None: there is none)."""
        entry = self.ready(key)
        if entry is not None:
            entry.readers += 1
            self._entries.move_to_end(key)
        return entry

    def finish_read(self, entry: Entry) -> bool:
        """A load of ``entry`` is done; True when it was the last reader of a retired object,
        whose storage the caller now releases."""
        assert entry.readers > 0
        entry.readers -= 1
        return entry.retired and entry.readers == 0

    # -- letting go --------------------------------------------------------------------------------
    def remove(self, key: Hashable, *, evicted: bool) -> Entry | None:
        """Take the ready object of ``key`` out (an eviction, or a delete); None if there is
        none. It is retired: if a load still reads it, :meth:`finish_read` says when to release
        its storage; otherwise the caller releases it now (``entry.readers == 0``). Either way
        the caller then calls :meth:`released`."""
        entry = self.ready(key)
        if entry is None:
            return None
        del self._entries[key]
        entry.retired = True
        if evicted:
            self.counters.evictions += 1
            self.counters.evicted_bytes += entry.footprint
        else:
            self.counters.deletes += 1
        return entry

    def released(self, entry: Entry) -> None:
        """The retired ``entry``'s storage is released: its footprint is free again."""
        assert entry.retired
        self._held -= entry.footprint

    def drain(self) -> list[Entry]:
        """Take every ready object out (closing); pending ones stay with their writers."""
        return [
            entry
            for entry in [self.remove(k, evicted=False) for k in list(self._entries)]
            if entry is not None
        ]
