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

The choice is a function of the arrival number and the budget alone, so the policy keeps no
state per object and the newcomer's share on admission is its share in a pass over all: the
object that arrived ``a``-th is picked when ``frac(a * g) < budget / capacity``, ``g`` the golden
ratio's fraction. That sequence spreads the picks evenly (of any run of consecutive arrivals,
the count picked is within 3.2 objects of ``count * budget / capacity``, checked for every run
of up to 500 arrivals starting at any of the first 500),
and it is monotone in the budget: a larger budget picks every object a smaller one did, and
more. So where the store re-plans (``adapter_params.replan``), a budget that moves by a little
moves only the objects whose ``frac(a * g)`` lies between the old and the new fraction — not
the whole stripe, as a rule that re-spaced the picks for each budget (every n-th) would.
"""

from __future__ import annotations

from collections.abc import Sequence

from dualblade.store import ContextDemand

#: The golden ratio's fractional part: ``frac(a * g)`` for a = 0, 1, 2, ... is the most evenly
#: spread sequence of its kind (a Kronecker sequence).
_GOLDEN = (5**0.5 - 1) / 2


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
        ``budget`` (see the module docstring; every object when the budget covers the
        capacity)."""
        if budget >= self.capacity:
            return True
        if budget <= 0:
            return False
        return (arrival * _GOLDEN) % 1.0 < budget / self.capacity

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
