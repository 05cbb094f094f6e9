"""The soak's memory pressure: the page-cache budget shrinks and grows while contexts decode.

Every second or so (seeded) the store's budget is capped at a random share of what the soak
gave it — nothing, a quarter, a half, all — and the store's re-planner demotes and promotes the
live contexts' layers to fit. Within a few seconds of each cut the ledger must hold no more
than the budget; the workers check every byte they read as always, whatever moved under them.

Faults stay off in this mode (the options refuse a fault rate): a fault on a layer move is the
store's, not any context operation's, and the soak's accounting attributes every fault to the
operation it hit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import anyio

from dualblade.store import KVStore

#: Seconds the demotions have to bring the ledger within a cut budget.
FIT_WITHIN_S = 5.0

#: Shares of the soak's budget the squeeze moves between (None: no cap).
SHARES: tuple[float | None, ...] = (0.0, 0.25, 0.5, None)


@dataclass
class PressureLog:
    """What the squeezes did."""

    changes: int = 0
    over_budget_after_moves: list[str] = field(default_factory=list)
    budgets: list[int | None] = field(default_factory=list)

    def to_dict(self, store: KVStore) -> dict[str, Any]:
        ledger = store.stats().ledger
        return {
            "budget_changes": self.changes,
            "demotions": ledger.demotions,
            "promotions": ledger.promotions,
            "failed_moves": ledger.failed_moves,
            "over_budget_after_moves": self.over_budget_after_moves[:10],
            "ok": not self.over_budget_after_moves and ledger.failed_moves == 0,
        }


async def squeeze(store: KVStore, seed: int, log: PressureLog, period_s: float = 1.0) -> None:
    """Change the store's budget cap every ``period_s`` (jittered) until cancelled."""
    rng = random.Random(seed * 7919 + 17)
    full = store.stats().ledger.budget_bytes
    try:
        while True:
            await anyio.sleep(period_s * rng.uniform(0.5, 1.5))
            share = rng.choice(SHARES)
            cap = None if share is None else int(full * share)
            store.set_page_cache_budget(cap)
            log.changes += 1
            log.budgets.append(cap)
            # Contexts keep coming and going, so the re-planner is seldom idle: wait for the
            # ledger to fit again, not for every share to be reached.
            with anyio.move_on_after(FIT_WITHIN_S):
                while store.stats().ledger.over_budget_bytes:
                    await anyio.sleep(0.01)
            ledger = store.stats().ledger
            if ledger.placed_bytes > ledger.budget_bytes:
                log.over_budget_after_moves.append(
                    f"change {log.changes}: {ledger.placed_bytes} B placed of a "
                    f"{ledger.budget_bytes} B budget {FIT_WITHIN_S} s later"
                )
    finally:
        store.set_page_cache_budget(None)
