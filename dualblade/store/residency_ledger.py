"""The store's residency ledger: who holds which page-cache places, against one budget.

Each context charges the ledger for every layer it places on the page-cache path (the layer's
footprint at the context's own shape: K and V of all its rows) *before* its first byte goes
there, and is credited only *after* the layer's pages are gone (demoted, or the context closed).
So ``placed_bytes`` is always at least what the contexts can have cached, and a charge that
would take it past the budget is refused: the sum over live contexts never exceeds ``B_pc``.
The one exception is a budget that shrinks under placed bytes; the re-planner then demotes
until the ledger fits again, and :attr:`over_budget_bytes` says by how much it does not yet.

The ledger only keeps the books. The :class:`~.share_policy.SharePolicy` says what each context
should hold (:meth:`targets`), and the re-planner moves layers to get there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from dualblade.store.share_policy import ContextDemand, FairShares, SharePolicy


class LedgerFullError(RuntimeError):
    """A charge that does not fit the budget (the caller asked without checking :meth:`fits`)."""


@dataclass
class _Entry:
    demand: ContextDemand  # its layer_bytes in the context's page-cache order
    order: tuple[int, ...]  # the layers, in the order they take the page-cache path
    sizes: tuple[int, ...]  # each layer's footprint, by layer
    charged: set[int] = field(default_factory=set)

    def charged_bytes(self) -> int:
        return sum(self.sizes[layer] for layer in self.charged)


@dataclass(frozen=True)
class LedgerSnapshot:
    """The ledger at one instant, for stats and metrics."""

    budget_bytes: int
    placed_bytes: int
    shares: dict[int, int]  # bytes charged per context
    target_layers: dict[int, int]
    demotions: int
    promotions: int
    failed_moves: int
    policy: str

    @property
    def over_budget_bytes(self) -> int:
        """Placed bytes beyond the budget (after a cut, until the demotions are done)."""
        return max(0, self.placed_bytes - self.budget_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "placed_bytes": self.placed_bytes,
            "context_shares": {str(c): b for c, b in self.shares.items()},
            "target_layers": {str(c): n for c, n in self.target_layers.items()},
            "demotions": self.demotions,
            "promotions": self.promotions,
            "failed_moves": self.failed_moves,
            "policy": self.policy,
        }


class ResidencyLedger:
    """Page-cache bytes charged per context and layer, against the store's budget."""

    def __init__(self, budget_bytes: int, policy: SharePolicy | None = None) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self.policy: SharePolicy = policy if policy is not None else FairShares()
        self._entries: dict[int, _Entry] = {}
        # kept as charges come and go: summing the entries on every question was O(contexts)
        # per admission, and an LMCache adapter holds a context per object (hundreds of
        # thousands on a large disk)
        self._placed = 0
        self._arrivals = itertools.count()
        self._newest: int | None = None  # the context registered last
        self.demotions = 0
        self.promotions = 0
        self.failed_moves = 0  # moves that failed (the layer stayed where it was)

    # -- contexts ------------------------------------------------------------------------------
    def register(
        self, context: int, layer_bytes: tuple[int, ...], order: tuple[int, ...] | None = None
    ) -> None:
        """A new context whose layers (``layer_bytes``: each one's footprint, by layer) may take
        the page-cache path, in ``order`` (every layer once; None: lowest first). A context's
        share of ``n`` layers is the first ``n`` of its order."""
        order = tuple(range(len(layer_bytes))) if order is None else order
        if sorted(order) != list(range(len(layer_bytes))):
            raise ValueError(f"order {order} is not a permutation of {len(layer_bytes)} layers")
        demand = ContextDemand(context, next(self._arrivals), tuple(layer_bytes[i] for i in order))
        self._entries[context] = _Entry(demand, order, tuple(layer_bytes))
        self._newest = context

    def unregister(self, context: int) -> None:
        """The context is gone and its pages with it: credit everything it held."""
        entry = self._entries.pop(context, None)
        if entry is not None:
            self._placed -= entry.charged_bytes()

    def admit(self, context: int) -> tuple[int, ...]:
        """The layers a context just registered may place now: the first of its order, its
        target share cut to what is free (the rest comes later, by promotion, as others give
        room)."""
        entry = self._entries[context]
        newcomer = getattr(self.policy, "newcomer_share", None)
        if newcomer is not None and context == self._newest:
            target = int(newcomer(self.budget_bytes, entry.demand))  # see NewcomerShare
        else:
            target = self.targets().get(context, 0)
        left = self.free_bytes
        n = 0
        for size in entry.demand.layer_bytes[:target]:
            if size > left:
                break
            left -= size
            n += 1
        return entry.order[:n]

    # -- charges -------------------------------------------------------------------------------
    def fits(self, context: int, layer: int, budget_bytes: int | None = None) -> bool:
        """The layer fits what is free of the budget (or of ``budget_bytes``, if lower: the
        re-planner promotes against the lowest recent reading)."""
        budget = self._capped(budget_bytes)
        return self._entries[context].sizes[layer] <= max(0, budget - self.placed_bytes)

    def charge(self, context: int, layer: int) -> None:
        """Charge a layer before its bytes go to the page cache.

        Raises:
            LedgerFullError: the layer does not fit what is left of the budget.
        """
        entry = self._entries[context]
        if layer in entry.charged:
            return
        if not self.fits(context, layer):
            raise LedgerFullError(
                f"layer {layer} of context {context} needs {entry.sizes[layer]} B; "
                f"{self.free_bytes} B of the {self.budget_bytes} B page-cache budget are free"
            )
        entry.charged.add(layer)
        self._placed += entry.sizes[layer]

    def credit(self, context: int, layer: int) -> None:
        """Credit a layer after its pages are gone."""
        entry = self._entries.get(context)
        if entry is not None and layer in entry.charged:
            entry.charged.discard(layer)
            self._placed -= entry.sizes[layer]

    def charged_layers(self, context: int) -> frozenset[int]:
        entry = self._entries.get(context)
        return frozenset(entry.charged) if entry is not None else frozenset()

    def charged_in_order(self, context: int) -> list[int]:
        """The context's charged layers, in its order (the re-planner demotes from the end)."""
        entry = self._entries.get(context)
        if entry is None:
            return []
        return [layer for layer in entry.order if layer in entry.charged]

    def next_uncharged(self, context: int, count: int) -> int | None:
        """The first layer of the context's first ``count`` in its order that is not charged
        (the one to promote), or None."""
        entry = self._entries.get(context)
        if entry is None:
            return None
        return next((layer for layer in entry.order[:count] if layer not in entry.charged), None)

    # -- the budget ----------------------------------------------------------------------------
    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, budget_bytes)

    @property
    def placed_bytes(self) -> int:
        return self._placed

    @property
    def free_bytes(self) -> int:
        return max(0, self.budget_bytes - self.placed_bytes)

    @property
    def over_budget_bytes(self) -> int:
        return max(0, self.placed_bytes - self.budget_bytes)

    def targets(self, budget_bytes: int | None = None) -> dict[int, int]:
        """Per context, how many layers (the first of its order) the share policy gives it of
        the budget (or of ``budget_bytes``, if lower)."""
        demands = [entry.demand for entry in self._entries.values()]
        return dict(self.policy.shares(self._capped(budget_bytes), demands))

    def _capped(self, budget_bytes: int | None) -> int:
        return self.budget_bytes if budget_bytes is None else min(self.budget_bytes, budget_bytes)

    def contexts(self) -> list[int]:
        """Live contexts, oldest first."""
        return [c for c, _ in sorted(self._entries.items(), key=lambda i: i[1].demand.arrival)]

    def snapshot(self) -> LedgerSnapshot:
        return LedgerSnapshot(
            budget_bytes=self.budget_bytes,
            placed_bytes=self.placed_bytes,
            shares={c: e.charged_bytes() for c, e in self._entries.items()},
            target_layers=self.targets(),
            demotions=self.demotions,
            promotions=self.promotions,
            failed_moves=self.failed_moves,
            policy=type(self.policy).__name__,
        )
