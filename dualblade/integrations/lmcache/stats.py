"""The adapter's typed snapshot: its objects, hits and failures, and its store's stats.

LMCache's disk tiers report no hit statistics (LMCache issue 1847); this one does, in the
adapter's :meth:`~.adapter.DualBladeL2Adapter.stats` and in LMCache's ``report_status``. The
store's own :class:`~dualblade.StoreStats` rides along: bytes per path, the page-cache hit rate
of the objects on the page-cache path, trims, the budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dualblade.integrations.lmcache.adapter import DualBladeL2Adapter


@dataclass(frozen=True)
class AdapterStats:
    """One adapter at one instant. Counters only grow; ``objects``, ``held_bytes`` and
    ``store`` are the current state."""

    objects: int  # ready objects held now
    held_bytes: int  # their padded bytes, and those of stores in progress
    capacity_bytes: int
    #: objects stored per medium the store placed them on ("page-cache", "direct")
    placed: Mapping[str, int]
    lookups: int  # keys looked up
    lookup_hits: int
    loads: int  # keys asked to load
    load_hits: int  # keys whose bytes landed
    load_failures: int  # held keys whose load failed (I/O error, bad buffer)
    load_bytes: int
    stored: int
    stored_bytes: int
    store_skipped: int  # already held
    store_failures: int  # I/O error, no room, unusable object
    evictions: int
    evicted_bytes: int
    deletes: int
    #: the store's :meth:`~dualblade.KVStore.metrics`
    store: Mapping[str, Any]

    @property
    def lookup_hit_rate(self) -> float | None:
        return self.lookup_hits / self.lookups if self.lookups else None

    @property
    def load_hit_rate(self) -> float | None:
        return self.load_hits / self.loads if self.loads else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, hit rates included."""
        data = asdict(self)
        data["placed"] = dict(self.placed)
        data["store"] = dict(self.store)
        data["lookup_hit_rate"] = self.lookup_hit_rate
        data["load_hit_rate"] = self.load_hit_rate
        return data


def collect_stats(adapter: DualBladeL2Adapter) -> AdapterStats:
    """Read the adapter's books and its store (on the adapter's event loop)."""
    objects = adapter.objects
    index, moved = objects.index, objects.counters
    books = index.counters
    return AdapterStats(
        objects=len(index),
        held_bytes=index.held_bytes,
        capacity_bytes=index.capacity,
        placed=dict(books.by_medium),
        lookups=books.lookups,
        lookup_hits=books.lookup_hits,
        loads=moved.loads,
        load_hits=moved.load_hits,
        load_failures=moved.load_failures,
        load_bytes=moved.load_bytes,
        stored=moved.stored,
        stored_bytes=moved.stored_bytes,
        store_skipped=moved.store_skipped,
        store_failures=moved.store_failures,
        evictions=books.evictions,
        evicted_bytes=books.evicted_bytes,
        deletes=books.deletes,
        store=objects.store.metrics(),
    )
