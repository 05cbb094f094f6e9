"""How a store shares its page-cache budget among live contexts: a pluggable policy.

The budget ``B_pc`` is the store's (DESIGN §5b). A policy turns the budget and each context's demand
— its layers' page-cache footprints, in the order its layers take the page cache — into how many of
each context's first layers may hold page-cache places. Algorithm 1 then runs per context on the
bytes of those layers, so the page cache is never asked to hold more than the budget, however many
requests are open.

Two policies come with the store:

- :class:`FairShares` (the default): max-min fair by bytes, a layer at a time. Equal contexts
  get equal shares (to one layer); what one context cannot use (it has fewer layers, or its
  layers are larger than what is left) goes to the others, so no budget is left idle while
  some context still has a layer that fits.
- :class:`FirstComeShares`: the oldest contexts keep their layers; a new context gets what is
  left. No layer ever moves to make room for a newcomer, at the price of fairness.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ContextDemand:
    """One live context as the policy sees it.

    ``layer_bytes``: the page-cache footprint of each layer that may take the page-cache path,
    in the order they take it (a context holds a prefix of them, as Algorithm 1 places:
    :func:`dualblade.pipeline.page_cache_order`). ``arrival``: the
    order contexts opened in (ties go to the older one, so shares do not flap).
    """

    context: int
    arrival: int
    layer_bytes: tuple[int, ...]


class SharePolicy(Protocol):
    """Maps a budget and the live contexts to page-cache layers per context.

    The result must fit: the sum over contexts of their first ``n`` layers' bytes is at most
    ``budget``, and each ``n`` is at most the context's number of layers.
    """

    def shares(self, budget: int, demands: Sequence[ContextDemand]) -> Mapping[int, int]: ...


class NewcomerShare(Protocol):
    """What a policy may add: the share of the newest context, without the others' demands.

    Admitting a context asks for its share only. Where a policy's answer for the newest context
    does not depend on the others (the LMCache adapter's newest-first policy), the ledger asks
    this instead of running :meth:`SharePolicy.shares` over every live context: with a context
    per stored object that pass made each admission O(objects), 16 ms at 100,000 objects.
    """

    def newcomer_share(self, budget: int, demand: ContextDemand) -> int: ...


class FairShares:
    """Max-min fair by bytes: repeatedly give the next layer to the context that holds the
    fewest bytes and whose next layer still fits (the older context on a tie)."""

    def shares(self, budget: int, demands: Sequence[ContextDemand]) -> dict[int, int]:
        layers = {d.context: 0 for d in demands}
        held = {d.context: 0 for d in demands}
        left = max(0, budget)
        waiting = sorted(demands, key=lambda d: d.arrival)
        while waiting:
            fitting = [
                d
                for d in waiting
                if layers[d.context] < len(d.layer_bytes)
                and d.layer_bytes[layers[d.context]] <= left
            ]
            if not fitting:
                break
            pick = min(fitting, key=lambda d: (held[d.context], d.arrival))
            size = pick.layer_bytes[layers[pick.context]]
            layers[pick.context] += 1
            held[pick.context] += size
            left -= size
            waiting = fitting
        return layers


class FirstComeShares:
    """The oldest context takes all the layers it can, then the next one, and so on."""

    def shares(self, budget: int, demands: Sequence[ContextDemand]) -> dict[int, int]:
        result: dict[int, int] = {}
        left = max(0, budget)
        for demand in sorted(demands, key=lambda d: d.arrival):
            n = 0
            for size in demand.layer_bytes:
                if size > left:
                    break
                left -= size
                n += 1
            result[demand.context] = n
        return result
