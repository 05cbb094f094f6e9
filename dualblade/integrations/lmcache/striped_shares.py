"""How the adapter's objects share the page-cache budget: striped over the order they arrive in.

Why striped, and not the first (or newest) objects that fit: a load asks for many objects at
once — a prompt's chunks, stored together — and the two paths only add up when each load reads
from both at the same time. The page cache answers at memory speed and the disk at its own, so
a batch whose objects all sit on one path runs at that path's speed; a batch split between them
runs both at once (the paper's split of a decode step's layers, applied to LMCache's objects).
Objects stored together are loaded together, so the split follows the store order: of every
``capacity / budget`` objects stored, one takes the page-cache path.

That fraction is the budget's share of a full cache: an L2 tier fills to its ``capacity`` and
stays there (LMCache evicts to make room), and then the page cache can hold ``budget /
capacity`` of its objects. Until the cache is full some budget stays unused, as it would at any
fixed share; a deployment whose stored set stays below ``capacity`` should say so by giving a
smaller ``capacity``.

The choice is a function of the arrival number and the budget alone (the Bresenham rule: the
object at arrival ``a`` is picked when ``floor((a + 1) f) > floor(a f)``), so the policy keeps
no state per object and the newcomer's share on admission is its share in a pass over all.
"""

from __future__ import annotations

from collections.abc import Sequence

from dualblade.store import ContextDemand


class StripedShares:
    """A :class:`dualblade.store.SharePolicy` (and :class:`dualblade.store.NewcomerShare`) that
    gives the page cache to one object in every ``capacity / budget``, by arrival (see the module
    docstring). A picked object holds its layers while the budget has room, newest first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 byte, not {capacity}")
        self.capacity = capacity

    def picked(self, budget: int, arrival: int) -> bool:
        """Whether the object that arrived ``arrival``-th takes the page-cache path at
        ``budget``: ``floor((a + 1) f) > floor(a f)`` for ``f = budget / capacity``, in
        integers (every object when the budget covers the capacity)."""
        if budget >= self.capacity:
            return True
        if budget <= 0:
            return False
        return (arrival + 1) * budget // self.capacity > arrival * budget // self.capacity

    def shares(self, budget: int, demands: Sequence[ContextDemand]) -> dict[int, int]:
        result: dict[int, int] = {}
        left = max(0, budget)
        for demand in sorted(demands, key=lambda d: -d.arrival):
            n = 0
            if self.picked(budget, demand.arrival):
                n = _layers_within(demand.layer_bytes, left)
                left -= sum(demand.layer_bytes[:n])
            result[demand.context] = n
        return result

    def newcomer_share(self, budget: int, demand: ContextDemand) -> int:
        """The newest object's share, which :meth:`shares` gives it first: the ledger asks this
        on admission, with no pass over the other objects."""
        if not self.picked(budget, demand.arrival):
            return 0
        return _layers_within(demand.layer_bytes, max(0, budget))


def _layers_within(layer_bytes: Sequence[int], room: int) -> int:
    """How many of the first layers fit ``room`` bytes together."""
    n = 0
    for size in layer_bytes:
        if size > room:
            break
        room -= size
        n += 1
    return n
