"""Per-thread CPU seconds from /proc/self/task: a thread's busy time is counted, and an idle one's
is not (pipebench's page-cache side uses it to show what the store did while the limit ran)."""

from __future__ import annotations

import threading
import time

from dualblade.bench.process_stats import cpu_seconds_between, thread_cpu_seconds


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _key(after: dict[str, float], thread_id: int) -> str:
    keys = [key for key in after if key.endswith(f"#{thread_id}")]
    assert len(keys) == 1, keys
    return keys[0]


def test_a_busy_thread_counts_and_an_idle_one_does_not() -> None:
    """Only this thread's and the idle thread's own figures are compared: threads an earlier
    test left behind may run meanwhile."""
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, name="idle")
    idle.start()
    try:
        before = thread_cpu_seconds()
        _spin(0.3)
        after = thread_cpu_seconds()
        mine, idle_key = _key(after, threading.get_native_id()), _key(after, idle.native_id)
        assert after[mine] - before[mine] >= 0.25  # the spin, at the clock's 10 ms ticks
        assert after[idle_key] - before[idle_key] < 0.05
        assert cpu_seconds_between(before, after) >= after[mine] - before[mine]
    finally:
        stop.set()
        idle.join()


def test_threads_new_since_count_whole_and_ended_ones_not_at_all() -> None:
    before = {"python#1": 1.0, "iou-wrk-7#2": 2.0}  # the second one ends in between
    after = {"python#1": 1.5, "iou-wrk-7#3": 0.25}  # a worker started in between
    assert cpu_seconds_between(before, after) == 0.75
