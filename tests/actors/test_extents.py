"""ExtentAllocator: disjoint runs inside the region, merging frees, exhaustion, growth."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from dualblade.actors import ExtentAllocator, ExtentExhaustedError
from dualblade.errors import DualbladeError


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a fixed region, checked against a model."""

    runs = Bundle("runs")

    def __init__(self) -> None:
        super().__init__()
        self.alloc: ExtentAllocator | None = None
        self.held: dict[int, int] = {}

    @rule(first=st.integers(0, 1000), n_blocks=st.integers(0, 200), growable=st.booleans())
    @precondition(lambda self: self.alloc is None)
    def create(self, first: int, n_blocks: int, growable: bool) -> None:
        self.alloc = ExtentAllocator(first, n_blocks, growable=growable)
        self.first = first
        self.size = n_blocks

    @precondition(lambda self: self.alloc is not None)
    @rule(target=runs, n=st.integers(1, 64))
    def allocate(self, n: int) -> tuple[int, int]:
        assert self.alloc is not None
        largest = max((length for _, length in self.alloc.free_runs), default=0)
        end_before = self.alloc.end
        try:
            start = self.alloc.allocate(n)
        except ExtentExhaustedError as error:
            assert not self.alloc.growable
            assert largest < n, f"refused {n} blocks with a free run of {largest}"
            message = str(error)
            assert f"no free run of {n} blocks" in message
            assert f"[{self.first}, {self.first + self.size})" in message
            assert f"largest free run has {largest} blocks" in message
            return (-1, 0)
        if not self.alloc.growable:
            assert largest >= n
        else:
            assert self.alloc.end >= end_before
        self.held[start] = n
        return (start, n)

    @precondition(lambda self: self.alloc is not None)
    @rule(run=consumes(runs))
    def free(self, run: tuple[int, int]) -> None:
        assert self.alloc is not None
        start, n = run
        if start < 0 or self.held.get(start) != n:
            return  # refused, or already freed by free_everything
        assert self.alloc.free(start) == n
        del self.held[start]

    @precondition(lambda self: self.alloc is not None)
    @rule()
    def free_everything(self) -> None:
        assert self.alloc is not None
        for start in list(self.held):
            self.alloc.free(start)
        self.held.clear()
        end = self.alloc.end
        expected = [(self.first, end - self.first)] if end > self.first else []
        assert self.alloc.free_runs == expected, "freeing everything must leave one free run"
        if not self.alloc.growable:
            assert end == self.first + self.size

    @invariant()
    def partition(self) -> None:
        if self.alloc is None:
            return
        used = sorted(self.alloc.used.items())
        assert dict(used) == self.held
        free = self.alloc.free_runs
        assert free == sorted(free)
        # Used and free runs tile [first, end) exactly: disjoint, inside, nothing lost.
        pieces = sorted([*used, *free])
        position = self.first
        for start, length in pieces:
            assert length > 0
            assert start == position, f"gap or overlap at {position}: next run starts at {start}"
            position = start + length
        assert position == self.alloc.end
        if not self.alloc.growable:
            assert self.alloc.end == self.first + self.size
        # Free neighbours are always merged.
        for (a, alen), (b, _) in itertools.pairwise(free):
            assert a + alen < b, f"free runs at {a} and {b} touch but were not merged"


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30), data=st.data())
@settings(max_examples=100, deadline=None)
def test_free_in_any_order_merges_back_to_one_run(sizes, data):
    alloc = ExtentAllocator(100, sum(sizes))
    starts = [alloc.allocate(n) for n in sizes]
    assert alloc.free_runs == []  # exactly full
    runs = sorted(zip(starts, sizes, strict=True))
    for (a, n), (b, _) in itertools.pairwise(runs):
        assert a + n == b  # first fit packs them back to back
    order = data.draw(st.permutations(starts))
    for start in order:
        alloc.free(start)
    assert alloc.free_runs == [(100, sum(sizes))]
    assert alloc.used == {}


def test_exhaustion_message_says_what_to_do():
    alloc = ExtentAllocator(10, 100)
    a = alloc.allocate(40)
    alloc.allocate(40)
    alloc.allocate(20)
    alloc.free(a)
    with pytest.raises(ExtentExhaustedError) as info:
        alloc.allocate(41)
    assert isinstance(info.value, DualbladeError)
    message = str(info.value)
    assert "no free run of 41 blocks in the extent [10, 110)" in message
    assert "largest free run has 40 blocks" in message
    assert "2 contexts" in message
    assert "Enlarge the extent" in message
    assert alloc.allocate(40) == a  # the refused request changed nothing


def test_growable_grows_and_reuses_trailing_free_run():
    alloc = ExtentAllocator(8, 0, growable=True)
    assert alloc.end == 8
    assert alloc.allocate(10) == 8
    assert alloc.allocate(5) == 18
    assert alloc.end == 23
    alloc.free(18)
    # A larger request extends the trailing free run instead of leaving a hole.
    assert alloc.allocate(12) == 18
    assert alloc.end == 30
    assert alloc.free_runs == []
    alloc.free(8)
    assert alloc.allocate(4) == 8  # first fit reuses the hole at the front
    assert alloc.end == 30


def test_bad_arguments():
    with pytest.raises(ValueError, match="bad region"):
        ExtentAllocator(-1, 10)
    alloc = ExtentAllocator(0, 10)
    with pytest.raises(ValueError, match="positive"):
        alloc.allocate(0)
    with pytest.raises(KeyError):
        alloc.free(3)
    empty = ExtentAllocator(0, 0)
    with pytest.raises(ExtentExhaustedError, match="largest free run has 0 blocks"):
        empty.allocate(1)
