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


def test_a_busy_thread_counts_and_an_idle_one_does_not() -> None:
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, name="idle")
    idle.start()
    try:
        before = thread_cpu_seconds()
        assert len(before) >= 2  # this one and the idle one at least
        _spin(0.3)
        after = thread_cpu_seconds()
        spent = cpu_seconds_between(before, after)
        assert 0.2 <= spent <= 1.0  # the spin, at the clock's 10 ms ticks, and little else
        idle_keys = [key for key in after if key.endswith(f"#{idle.native_id}")]
        assert len(idle_keys) == 1
        assert after[idle_keys[0]] - before.get(idle_keys[0], 0.0) < 0.05
    finally:
        stop.set()
        idle.join()


def test_a_thread_that_ended_in_between_is_not_counted() -> None:
    before = thread_cpu_seconds()
    worker = threading.Thread(target=_spin, args=(0.2,))
    worker.start()
    worker.join()
    assert cpu_seconds_between(before, thread_cpu_seconds()) < 0.15
