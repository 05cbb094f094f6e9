"""The ring thread is woken once per wake-up, not once per post: a post made while an earlier
wake-up is still pending writes no eventfd, and is drained when that wake-up arrives."""

from __future__ import annotations

import os
import threading
import time

import pytest

from dualblade.io_engine import IOEngine
from dualblade.io_engine.ring import Ring


@pytest.fixture
def ring() -> Ring:
    with IOEngine(queue_depth=8, compat="off") as engine:
        backend = engine._backend
        assert isinstance(backend, Ring)
        yield backend


def test_a_post_while_a_wake_up_is_pending_writes_nothing_and_still_runs(
    ring: Ring, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[int] = []
    real_write = os.eventfd_write

    def counted(fd: int, value: int) -> None:
        writes.append(fd)
        real_write(fd, value)

    monkeypatch.setattr(os, "eventfd_write", counted)
    first, second = threading.Event(), threading.Event()
    ring._wake_pending = True  # as if a post had just written and the ring not yet woken
    try:
        ring._post("call", first.set)
        assert writes == []  # no system call: the pending wake-up will drain it
    finally:
        real_write(ring._eventfd, 1)  # the pending wake-up arrives (and clears the flag)
    assert first.wait(5)
    deadline = time.monotonic() + 5
    while ring._wake_pending and time.monotonic() < deadline:
        time.sleep(0.001)  # the ring thread reaps that wake-up (it may have drained first sooner)
    assert not ring._wake_pending
    ring._post("call", second.set)  # that wake-up was consumed: the next post writes again
    assert second.wait(5)
    assert writes == [ring._eventfd]


def test_many_posts_from_other_threads_all_run(ring: Ring) -> None:
    ran = threading.Semaphore(0)

    def post_many() -> None:
        for _ in range(500):
            ring._post("call", ran.release)

    posters = [threading.Thread(target=post_many) for _ in range(4)]
    for poster in posters:
        poster.start()
    for poster in posters:
        poster.join()
    assert all(ran.acquire(timeout=5) for _ in range(2000))


def test_a_failed_wake_up_write_leaves_the_next_post_to_write(
    ring: Ring, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.eventfd_write
    deadline = time.monotonic() + 5
    while ring._wake_pending and time.monotonic() < deadline:
        time.sleep(0.001)

    def failing(fd: int, value: int) -> None:
        raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(os, "eventfd_write", failing)
    with pytest.raises(OSError, match="Bad file descriptor"):
        ring._post("call", lambda: None)
    assert not ring._wake_pending  # else no post would wake the ring thread again
    monkeypatch.setattr(os, "eventfd_write", real_write)
    ran = threading.Event()
    ring._post("call", ran.set)
    assert ran.wait(5)
