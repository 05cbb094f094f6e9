"""Live re-planning: keep every context's page-cache layers at its share of the budget.

The share policy says how many layers each live context should hold on the page-cache path (the
first of the context's page-cache order: :func:`dualblade.pipeline.page_cache_order`)
(:meth:`ResidencyLedger.targets`); this task moves layers until they do. It wakes when a context
opens or closes and when the budget changes (the budgeter's readings, or
:meth:`KVStore.set_page_cache_budget`), and works in two passes:

1. **Demote** first: a context above its target gives up the page-cache layer latest in its order
   that it has not written yet (free to move), else the latest one;
   the ledger is credited once the layer's pages are gone. After a budget cut this is what brings
   the ledger back under the budget, before the kernel has to evict anything.
2. **Promote** into what is free: the context holding the fewest bytes below its target gets
   the next layer of its order; the ledger is charged before a byte goes to the page cache.
   Promotions plan against the lowest budgeter reading of the last second
   (:mod:`.budget_watermark`), so a reading that does not hold moves nothing in. A written
   layer is promoted only while its context has :data:`PAYBACK_ROWS` rows or more left to
   append (decode steps to come): the move reads the layer from the disk, and the memory limit
   soon has the kernel write its pages back, so it costs more than the first few of the disk
   reads that the page cache then saves, one a step.

Moves run one at a time, each between the layer's uses (:meth:`KVContext.move_layer`), so a
reader waits for at most one layer's move. They yield the copy threads to decode steps, except
demotions while the ledger is over the budget: the kernel would evict the pages otherwise.
Arrivals and departures are gathered for :data:`SETTLE_S` before anything moves, so a request
that comes and goes within it moves nobody's layers (budget changes are acted on at once). A
budget that falls below what is placed cuts that wait short: a newcomer's own memory often
lowers the budget just after it opens, and the kernel would evict pages while the re-planner
waited (the serving preset sampled the page cache 12 % over its budget for 0.2 s).
A move that fails leaves the layer where it was; the context is skipped until the next
wake-up, and the failure is logged and counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskStatus

from dualblade.errors import DualbladeError
from dualblade.logs import get_logger
from dualblade.pipeline import Medium
from dualblade.store.budget_watermark import LowWatermark
from dualblade.store.residency_ledger import ResidencyLedger

if TYPE_CHECKING:
    from dualblade.store.context import KVContext

_log = get_logger(__name__)

#: The policies whose page-cache layers the ledger budgets: (medium of a layer inside the
#: context's share, medium of one outside it). ``page-cache`` and ``baseline`` put every layer
#: through the page cache by definition; ``direct`` puts none there.
BUDGETED_MEDIA: dict[str, tuple[Medium, Medium]] = {
    "dual": (Medium.PAGE_CACHE, Medium.DIRECT),
    "cache-policy": (Medium.PAGE_CACHE, Medium.PAGE_CACHE_DROPPED),
}


#: Seconds the re-planner waits after a context opens or closes before it moves layers.
SETTLE_S = 0.25
#: A written layer is promoted only if its context may still read it this many more steps.
#: The move costs a disk read of the layer, a copy into the page cache and, under a memory
#: limit, a write-back soon after; it runs while the layer's readers wait, one move at a time.
#: Each later step saves one disk read of the layer, but on two cores its hit is a memory copy
#: that competes for the CPU. Measured in the quick preset at 1.69 and 2 GiB (5 new tokens, so
#: with 5 its promotions land in the first decode step): that step took 0.09-0.28 s more than
#: the steps after it, each of which a promotion made 0.02-0.03 s faster, so a promotion paid
#: back after about 7 steps; three alternating pairs decoded in 2.65 / 2.22 s (medians) with 5
#: and 2.62 / 2.06 s with no promotion (docs/bench.md, 2026-12-04). Of the three VMs that
#: measured this, one found the opposite (2.16-2.22 s against 2.27-2.44 at 2 GiB).
PAYBACK_ROWS = 8


class Replanner:
    """The store's re-planning task (see the module docstring)."""

    def __init__(self, ledger: ResidencyLedger, contexts: Mapping[int, KVContext]) -> None:
        self.ledger = ledger
        self._contexts = contexts
        self._readings = LowWatermark()
        self._wakeup = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self.enabled = True
        self._settle = 0.0
        self._over_budget = anyio.Event()  # cuts a settling wait short

    def follow_budget(self, budget_bytes: int, *, reading: bool) -> None:
        """A new page-cache budget: the ledger's at once (demotions follow it), and, if it is a
        budgeter ``reading``, one more for the low watermark that promotions plan against (an
        operator's cap holds at once, both ways)."""
        self.ledger.set_budget(budget_bytes)
        if reading:
            self._readings.observe(budget_bytes)
        else:
            self._readings.reset(budget_bytes)
        if self.ledger.over_budget_bytes > 0:
            self._over_budget.set()
        self.wake()

    def wake(self, *, settle: bool = False) -> None:
        """Something changed: re-plan soon (never blocks). ``settle``: a context opened or
        closed; wait :data:`SETTLE_S` for more before moving anything."""
        if self.enabled:
            self._idle = anyio.Event() if self._idle.is_set() else self._idle
            self._settle = SETTLE_S if settle else 0.0
            self._wakeup.set()

    async def settled(self) -> None:
        """Wait until every context holds what the policy gives it (or a move failed)."""
        while not self._idle.is_set():
            await self._idle.wait()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        held = False  # promotions wait for a higher reading to hold
        while True:
            with anyio.move_on_after(self._readings.rises_in() if held else None):
                await self._wakeup.wait()
            if self._settle:
                with anyio.move_on_after(self._settle):
                    await self._over_budget.wait()
            self._wakeup = anyio.Event()
            self._over_budget = anyio.Event()
            skipped: set[int] = set()
            await self._demote(skipped)
            held = await self._promote(skipped)
            if not self._wakeup.is_set() and not held:
                self._idle.set()

    async def _demote(self, skipped: set[int]) -> None:
        targets = self.ledger.targets()
        # The youngest first: under FirstComeShares the oldest keep theirs longest.
        for context in reversed(self.ledger.contexts()):
            ctx = self._contexts.get(context)
            if ctx is None:
                continue
            _, outside = BUDGETED_MEDIA[ctx.plan.config.policy]
            while context not in skipped:
                charged = self.ledger.charged_in_order(context)
                if len(charged) <= targets.get(context, 0):
                    break
                layer = _to_demote(ctx, charged)
                urgent = self.ledger.over_budget_bytes > 0
                if await self._move(ctx, layer, outside, skipped, urgent=urgent):
                    self.ledger.credit(context, layer)
                    self.ledger.demotions += 1

    async def _promote(self, skipped: set[int]) -> bool:
        """Promote while a context is below its target; returns whether a promotion waits for
        a reading to hold (the current budget would allow more than the low watermark)."""
        while True:
            low = self._readings.low(default=self.ledger.budget_bytes)
            targets = self.ledger.targets(low)
            candidates = []
            for context in self.ledger.contexts():
                charged = self.ledger.charged_layers(context)
                if context in skipped or len(charged) >= targets.get(context, 0):
                    continue
                layer = self.ledger.next_uncharged(context, targets[context])
                ctx = self._contexts.get(context)
                if layer is not None and ctx is not None and not _pays_back(ctx, layer):
                    skipped.add(context)  # its requests end before the move would pay
                    continue
                if layer is not None and self.ledger.fits(context, layer, low):
                    bytes_held = self.ledger.snapshot().shares.get(context, 0)
                    candidates.append((bytes_held, context, layer))
            if not candidates:
                if low >= self.ledger.budget_bytes:
                    return False
                now = self.ledger.targets()  # what the current reading alone would give
                return any(
                    context not in skipped
                    and len(self.ledger.charged_layers(context)) < now.get(context, 0)
                    for context in self.ledger.contexts()
                )
            _, context, layer = min(candidates)
            ctx = self._contexts.get(context)
            if ctx is None:
                skipped.add(context)
                continue
            inside, _ = BUDGETED_MEDIA[ctx.plan.config.policy]
            self.ledger.charge(context, layer)
            if await self._move(ctx, layer, inside, skipped):
                self.ledger.promotions += 1
            else:
                self.ledger.credit(context, layer)

    async def _move(
        self,
        ctx: KVContext,
        layer: int,
        medium: Medium,
        skipped: set[int],
        *,
        urgent: bool = False,
    ) -> bool:
        try:
            moved = await ctx.move_layer(layer, medium, urgent=urgent)
        except DualbladeError as error:
            self.ledger.failed_moves += 1
            skipped.add(ctx.id)
            _log.warning(
                "layer move failed; it stays where it was",
                context=ctx.id,
                layer=layer,
                to=str(medium),
                error=str(error),
            )
            return False
        if not moved:  # the context closed under the move (or the layer was there already)
            skipped.add(ctx.id)
        return moved or ctx.media[layer] is medium


def _pays_back(ctx: KVContext, layer: int) -> bool:
    """Whether promoting ``layer`` can save the disk more than it costs it: a layer not
    written yet moves for free; a written one needs :data:`PAYBACK_ROWS` steps to come."""
    written = ctx.length(layer)
    return written == 0 or ctx.max_len - written >= PAYBACK_ROWS


def _to_demote(ctx: KVContext, charged: list[int]) -> int:
    """Which of a context's charged layers (in its order) to give back first: the last one it
    has not written yet, else the last one.

    Why unwritten first: moving a layer that holds no rows copies nothing, so the budget is met
    at once. A budget that drops while a context is still prefilling (the application's own
    tensors grow) otherwise demoted a written layer, a read and a write through the disk,
    while the prefill went on writing the unwritten ones into the page cache: the serving
    preset sampled the page cache 11 % above its budget for 0.1-0.2 s.
    """
    unwritten = [layer for layer in charged if ctx.length(layer) == 0]
    return (unwritten or charged)[-1]
