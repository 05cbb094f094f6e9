"""The collector's freeze at the end of setup: what is alive then leaves the collector's passes,
what is made after stays in them."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from dualblade.collector import CollectorPauses, freeze_setup
from dualblade.telemetry import Tracer


class _Node:
    """A container the collector tracks."""

    def __init__(self) -> None:
        self.peer: _Node | None = None


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # give the test session its collector back


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


@pytest.mark.usefixtures("unfrozen_after")
def test_setup_objects_leave_the_collectors_passes_and_later_ones_do_not() -> None:
    made_in_setup = _Node()
    assert _tracked(made_in_setup)

    frozen = freeze_setup()

    # Not equal to a later count: a frozen object that another thread (a worker left by an earlier
    # test) frees leaves the permanent generation, which CI met (690,514 frozen, 690,512 after).
    assert frozen > 0
    assert 0 < gc.get_freeze_count() <= frozen
    assert not _tracked(made_in_setup)
    made_later = _Node()
    assert _tracked(made_later)


@pytest.mark.usefixtures("unfrozen_after")
def test_the_setups_garbage_is_collected_before_the_freeze() -> None:
    cycle = _Node()
    cycle.peer = _Node()
    cycle.peer.peer = cycle
    members = {id(cycle), id(cycle.peer)}
    del cycle

    freeze_setup()

    # Frozen garbage would stay for the process's life: unfrozen, it would be tracked again.
    gc.unfreeze()
    assert not any(type(o) is _Node and id(o) in members for o in gc.get_objects())


def _garbage_cycles(count: int) -> None:
    for _ in range(count):
        node = _Node()
        node.peer = _Node()
        node.peer.peer = node


def test_each_pass_is_timed_with_its_generation_and_drawn_on_the_trace() -> None:
    tracer = Tracer()
    before = time.perf_counter()
    with CollectorPauses(tracer) as pauses:
        _garbage_cycles(100)
        gc.collect()  # a full pass
        gc.collect(0)
    after = time.perf_counter()
    full = [p for p in pauses.pauses if p.generation == 2]
    assert full
    assert all(before <= p.start_s <= after and p.seconds >= 0 for p in full)
    assert any(p.generation == 0 for p in pauses.pauses)
    slices = [e for e in tracer.document()["traceEvents"] if e.get("name") == "gc gen2"]
    assert [e["dur"] for e in slices] == pytest.approx([p.seconds * 1e6 for p in full])
    assert "python gc" in tracer.tracks()


class _OneHolderLock:
    """A stand-in for the tracer's lock that notes a second entry by its holder (the real lock
    would wait for ever there)."""

    def __init__(self) -> None:
        self.held = False
        self.reentered = False

    def __enter__(self) -> None:
        self.reentered |= self.held
        self.held = True

    def __exit__(self, *exc: object) -> None:
        self.held = False


def test_a_pass_inside_the_tracers_lock_does_not_wait_for_it() -> None:
    """A pass that begins while the tracer holds its lock (the tracer allocates there) must
    not need the lock: the passes reach the trace when the timer is removed."""
    tracer = Tracer()
    lock = _OneHolderLock()
    tracer._lock = lock  # type: ignore[assignment]
    with CollectorPauses(tracer) as pauses, lock:
        gc.collect()  # as if an allocation under the lock had brought a pass due
    assert pauses.pauses
    assert not lock.reentered
    assert any(e.get("name", "").startswith("gc gen") for e in tracer.document()["traceEvents"])


def test_passes_are_summed_by_the_window_they_began_in_and_none_after_removal() -> None:
    with CollectorPauses() as pauses:
        gc.collect()
        middle = time.perf_counter()
        gc.collect(1)
        gc.collect(1)
    counted = len(pauses.pauses)
    gc.collect()  # uninstalled: not counted
    assert len(pauses.pauses) == counted
    # another thread's allocations may bring a young pass of their own: count what ours were
    early = pauses.between(0.0, middle)
    late = pauses.between(middle, time.perf_counter())
    assert early["passes"][2] == 1
    assert late["passes"][2] == 0
    assert late["passes"][1] >= 2
    assert late["seconds"] >= late["longest_s"] >= 0
    assert sum(early["passes"]) + sum(late["passes"]) == counted
    assert pauses.between(middle, middle) == {"passes": [0, 0, 0], "seconds": 0, "longest_s": 0}
