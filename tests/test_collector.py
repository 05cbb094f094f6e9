"""The collector's freeze at the end of setup: what is alive then leaves the collector's passes,
what is made after stays in them."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from dualblade.collector import freeze_setup


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
