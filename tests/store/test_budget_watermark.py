"""The low watermark promotions plan against: the lowest reading of the window, the latest
always counting, and when that low will rise."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.store.budget_watermark import LowWatermark


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_low_is_the_lowest_reading_of_the_window() -> None:
    clock = Clock()
    marks = LowWatermark(1.0, clock)
    assert marks.low(default=7) == 7  # no reading yet
    assert marks.rises_in() is None
    marks.observe(50)
    clock.now += 0.25
    marks.observe(80)
    assert marks.low(default=0) == 50
    assert marks.rises_in() == pytest.approx(0.75)  # when the 50 leaves the window
    clock.now += 0.75
    assert marks.low(default=0) == 80
    assert marks.rises_in() is None


def test_the_latest_reading_counts_however_old() -> None:
    clock = Clock()
    marks = LowWatermark(1.0, clock)
    marks.observe(30)
    clock.now += 60
    assert marks.low(default=0) == 30


def test_a_reset_forgets_the_lows_at_once() -> None:
    clock = Clock()
    marks = LowWatermark(1.0, clock)
    marks.observe(10)
    marks.reset(90)  # an operator's cap: holds now
    assert marks.low(default=0) == 90
    assert marks.rises_in() is None
    marks.observe(95)  # readings go on from there
    assert marks.low(default=0) == 95


def test_a_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        LowWatermark(-1.0)


@given(
    readings=st.lists(
        st.tuples(st.floats(0.0, 2.0), st.integers(0, 1 << 40)), min_size=1, max_size=30
    ),
    later=st.floats(0.0, 3.0),
)
def test_low_is_the_min_of_what_still_counts(
    readings: list[tuple[float, int]], later: float
) -> None:
    clock = Clock()
    marks = LowWatermark(1.0, clock)
    seen: list[tuple[float, int]] = []
    for gap, value in readings:
        clock.now += gap
        marks.observe(value)
        seen.append((clock.now, value))
    clock.now += later
    counting = [v for at, v in seen if at > clock.now - 1.0] + [seen[-1][1]]
    assert marks.low(default=-1) == min(counting)
    wait = marks.rises_in()
    if wait is None:
        assert marks.low(default=-1) == seen[-1][1]
    else:
        low = marks.low(default=-1)
        assert 0.0 <= wait <= 1.0
        clock.now += wait + 1e-9
        assert marks.low(default=-1) > low  # it rose when it said it would
