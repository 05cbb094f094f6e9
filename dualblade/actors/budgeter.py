"""The budgeter actor: how much page cache dualblade may use, now and as it changes.

It reads the budget through a function the runtime gives it (the pipeline's memory discovery and
budget derivation: cgroup v2 ``memory.max``/``memory.current``/``memory.stat``, cgroup v1
``memory.limit_in_bytes``/``memory.usage_in_bytes``/``memory.stat``, ``/proc/meminfo``), answers
queries, and re-reads it periodically; a change larger than ``min_change`` is published to every
subscriber (the runtime re-plans new contexts, the strategy probe probes again).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskStatus

from dualblade.actors._base import Actor, Reply
from dualblade.logs import get_logger
from dualblade.telemetry import NULL_TRACER, Tracer

_log = get_logger(__name__)


@dataclass(frozen=True)
class Budget:
    """A page-cache budget and how it was derived (for display)."""

    page_cache_bytes: int
    limit_bytes: int | None
    derivation: dict[str, Any] = field(default_factory=dict, compare=False)
    #: The planner's own budget object, carried opaquely for the runtime.
    detail: object = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class GetBudget:
    reply: Reply[Budget]


@dataclass(frozen=True)
class Refresh:
    """Re-read the budget now; the reply is the (possibly unchanged) budget."""

    reply: Reply[Budget]


BudgeterMessage = GetBudget | Refresh

Subscriber = Callable[[Budget], Awaitable[None]]


class BudgeterActor(Actor[BudgeterMessage]):
    """Publishes the page-cache budget and its changes.

    Args:
        read_budget: computes the current budget (may read /proc and /sys).
        interval: seconds between re-reads; 0 disables polling (fixed budgets).
        min_change: bytes a new budget must differ by to be published. 32 MiB: with 64 MiB
            and a reading every 0.25 s, a serving run's brief dip (a new request's tensors)
            was published, and the readings that followed, 49 MiB higher, were not: the
            budget stayed low for the rest of the run, and the drop came in one step of
            64 MiB that the demotions took 0.2-0.4 s to follow (docs/serving-bench.md).
    """

    def __init__(
        self,
        read_budget: Callable[[], Budget],
        *,
        interval: float = 1.0,
        min_change: int = 32 << 20,
        tracer: Tracer = NULL_TRACER,
    ) -> None:
        super().__init__("budgeter", tracer=tracer)
        self._read = read_budget
        self.interval = interval
        self.min_change = min_change
        self.current: Budget | None = None
        self._subscribers: list[Subscriber] = []
        self.changes = 0

    def subscribe(self, subscriber: Subscriber) -> None:
        """Call ``subscriber`` with every published change (not with the initial budget)."""
        self._subscribers.append(subscriber)

    async def on_start(self) -> None:
        self.current = self._read()
        self._record(self.current)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            if self.interval > 0:
                tg.start_soon(self._poll)
            await super().run(task_status=task_status)
            tg.cancel_scope.cancel()

    async def _poll(self) -> None:
        while True:
            await anyio.sleep(self.interval)
            await self._refresh()

    async def _refresh(self) -> Budget:
        new = await anyio.to_thread.run_sync(self._read)
        old = self.current
        if old is None or abs(new.page_cache_bytes - old.page_cache_bytes) >= self.min_change:
            self.current = new
            self._record(new)
            if old is not None:
                self.changes += 1
                _log.info(
                    "page-cache budget changed", old=old.page_cache_bytes, new=new.page_cache_bytes
                )
                for subscriber in self._subscribers:
                    await subscriber(new)
        assert self.current is not None
        return self.current

    def _record(self, budget: Budget) -> None:
        self.tracer.counter("budget", page_cache_bytes=budget.page_cache_bytes)
        self.tracer.instant(
            self.name,
            "budget",
            page_cache_bytes=budget.page_cache_bytes,
            limit_bytes=budget.limit_bytes or 0,
        )

    async def handle(self, message: BudgeterMessage) -> None:
        if isinstance(message, GetBudget):
            assert self.current is not None
            message.reply.set(self.current)
        elif isinstance(message, Refresh):
            message.reply.set(await self._refresh())
