"""The strategy probe: skip 1, Intra at 2, Cross at 3, lock the faster; fixed modes; re-probe."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from dualblade.actors import OverlapGate, Reply, StrategyProbeActor
from dualblade.actors.strategy_probe import (
    BudgetChanged,
    GetStrategy,
    IterationEnd,
    IterationStart,
    ProbeState,
)

pytestmark = pytest.mark.anyio

MB = 1 << 20


class Driver:
    """Feeds decode iterations to a running probe."""

    def __init__(self, probe: StrategyProbeActor) -> None:
        self.probe = probe

    async def start(self, step: int) -> str:
        reply: Reply[str] = Reply()
        return await self.probe.ask(IterationStart(step, reply), reply)  # type: ignore[arg-type]

    async def end(self, step: int, mb_per_s: float) -> None:
        await self.probe.send(IterationEnd(step, int(mb_per_s * MB), 1.0))

    async def step(self, step: int, mb_per_s: float = 100.0) -> str:
        strategy = await self.start(step)
        await self.end(step, mb_per_s)
        return strategy

    async def state(self) -> ProbeState:
        reply: Reply[ProbeState] = Reply()
        return await self.probe.ask(GetStrategy(reply), reply)


@pytest.fixture
async def running(request) -> AsyncIterator[tuple[Driver, OverlapGate]]:
    mode = getattr(request, "param", "auto")
    gate = OverlapGate(copy_threads=3)
    probe = StrategyProbeActor(gate, mode)
    async with anyio.create_task_group() as tg:
        await tg.start(probe.run)
        yield Driver(probe), gate
        probe.close()


@pytest.mark.parametrize(
    ("intra", "cross", "winner"), [(200.0, 100.0, "intra"), (100.0, 300.0, "cross")]
)
async def test_probe_runs_intra_then_cross_and_locks_the_faster(running, intra, cross, winner):
    driver, gate = running
    assert not (await driver.state()).locked
    await driver.step(1, mb_per_s=1.0)  # warm-up: its (slow, cold) throughput is ignored
    assert await driver.start(2) == "intra"
    assert gate.strategy == "intra"
    await driver.end(2, intra)
    assert await driver.start(3) == "cross"
    assert gate.strategy == "cross"
    await driver.end(3, cross)
    state = await driver.state()
    assert state.locked
    assert state.strategy == winner
    assert state.throughput == pytest.approx({"intra": intra * MB, "cross": cross * MB})
    for step in range(4, 10):  # locked for the rest, whatever later steps measure
        assert await driver.step(step, mb_per_s=intra + cross if step % 2 else 1.0) == winner
    assert gate.strategy == winner


@pytest.mark.parametrize("running", ["intra", "cross"], indirect=True)
async def test_fixed_mode_never_changes(running):
    driver, gate = running
    fixed = gate.strategy
    assert (await driver.state()).locked
    for step in range(1, 5):
        assert await driver.step(step, mb_per_s=float(step)) == fixed
    await driver.probe.send(BudgetChanged(1 << 30))
    for step in range(5, 10):
        assert await driver.step(step, mb_per_s=float(10 - step)) == fixed
    state = await driver.state()
    assert state.locked
    assert state.strategy == fixed
    assert gate.strategy == fixed


async def test_budget_change_restarts_the_probe_at_the_next_iteration(running):
    driver, gate = running
    await driver.step(1)
    await driver.step(2, mb_per_s=300.0)
    await driver.step(3, mb_per_s=100.0)
    assert (await driver.state()).strategy == "intra"
    assert await driver.step(4) == "intra"
    await driver.probe.send(BudgetChanged(123 * MB))
    state = await driver.state()
    assert not state.locked
    assert state.throughput == {}
    # Step 5 is the new probe's warm-up, 6 runs Intra, 7 Cross; this time Cross wins.
    await driver.step(5, mb_per_s=1.0)
    assert await driver.step(6, mb_per_s=100.0) == "intra"
    assert await driver.step(7, mb_per_s=400.0) == "cross"
    state = await driver.state()
    assert state.locked
    assert state.strategy == "cross"
    assert await driver.step(8) == "cross"
    assert gate.strategy == "cross"


async def test_budget_change_during_a_probe_iteration_still_reprobes(running):
    """An iteration that straddles a budget change measured the old placement: it must not
    decide the new probe."""
    driver, _gate = running
    await driver.step(1)
    await driver.step(2, mb_per_s=100.0)
    assert await driver.start(3) == "cross"
    await driver.probe.send(BudgetChanged(64 * MB))  # arrives while step 3 (Cross) runs
    await driver.end(3, 500.0)
    assert not (await driver.state()).locked
    await driver.step(4)  # warm-up of the new probe
    assert await driver.step(5, mb_per_s=300.0) == "intra"
    assert await driver.step(6, mb_per_s=100.0) == "cross"
    state = await driver.state()
    assert state.locked
    assert state.strategy == "intra"


async def test_gate_tokens_follow_the_strategy():
    gate = OverlapGate(copy_threads=4)
    assert gate.strategy == "intra"
    assert gate.limiter_for("direct").total_tokens == 4
    gate.set("cross")
    assert gate.limiter_for("direct").total_tokens == 1
    assert gate.limiter_for("page-cache").total_tokens == 4  # a memory copy: never delayed
    assert gate.limiter_for("baseline").total_tokens == 4  # made after the switch
    gate.set("intra")
    assert gate.limiter_for("direct").total_tokens == 4
    assert gate.limiter_for("page-cache").total_tokens == 4
    cross = OverlapGate(copy_threads=4, strategy="cross")
    assert cross.limiter_for("direct").total_tokens == 1
    assert cross.limiter_for("page-cache").total_tokens == 4


@pytest.mark.parametrize(("strategy", "concurrent"), [("intra", 3), ("cross", 1)])
async def test_gate_limits_concurrent_storage_transfers(strategy, concurrent):
    gate = OverlapGate(copy_threads=3, strategy=strategy)
    release = anyio.Event()
    inside = 0
    peak = 0

    async def transfer() -> None:
        nonlocal inside, peak
        async with gate.limiter_for("direct"):
            inside += 1
            peak = max(peak, inside)
            await release.wait()
            inside -= 1

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(transfer)
        await anyio.wait_all_tasks_blocked()
        assert inside == concurrent
        release.set()
    assert peak == concurrent


@pytest.mark.parametrize("strategy", ["intra", "cross"])
async def test_each_path_has_slots_of_its_own(strategy):
    """A page-cache transfer never waits for the direct path's slots (nor the other way round):
    dual's two paths add their bandwidth. With one set of slots a step's page-cache reads
    waited behind the direct read before them."""
    gate = OverlapGate(copy_threads=2, strategy=strategy)
    release = anyio.Event()
    inside: dict[str, int] = {"direct": 0, "page-cache": 0}

    async def transfer(path: str) -> None:
        async with gate.limiter_for(path):
            inside[path] += 1
            await release.wait()

    async with anyio.create_task_group() as tg:
        for path in ("direct", "direct", "direct", "page-cache", "page-cache", "page-cache"):
            tg.start_soon(transfer, path)
        await anyio.wait_all_tasks_blocked()
        assert inside == {"direct": 2 if strategy == "intra" else 1, "page-cache": 2}
        release.set()


async def test_probe_sets_the_gate_seen_by_copy_threads(running):
    driver, gate = running
    await driver.step(1)
    await driver.start(2)
    assert gate.limiter_for("direct").total_tokens == 3
    await driver.end(2, 50.0)
    await driver.start(3)
    assert gate.limiter_for("direct").total_tokens == 1
    await driver.end(3, 10.0)
    await driver.state()
    assert gate.limiter_for("direct").total_tokens == 3  # Intra won
