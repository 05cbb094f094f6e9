"""Finished tasks' results, and the three eventfds that tell LMCache about them.

LMCache's store and prefetch controllers poll the adapter's three eventfds; when one is
readable they drain it and collect the results of that kind (``pop_completed_store_tasks``,
``query_lookup_and_lock_result``, ``query_load_result``). Results are written here on the
adapter's event-loop thread and taken from LMCache's threads, hence the lock. Each kind has its
own eventfd: LMCache routes by descriptor, so the three must differ.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any


class Results:
    """One kind's results by task id (LMCache's result objects), and its eventfd."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.done: dict[int, Any] = {}


class Completions:
    """Task ids, the results of stores, lookups and loads, and the eventfds signalled when
    each lands. ``close`` closes the eventfds; results that arrive
    after it are dropped, since nobody can be told of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self.stores = Results()
        self.lookups = Results()
        self.loads = Results()

    def next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def finish(self, kind: Results, task_id: int, result: Any) -> None:
        """Record ``result`` of ``task_id`` and signal ``kind``'s eventfd."""
        with self._lock:
            if self._closed:
                return
            kind.done[task_id] = result
            os.eventfd_write(kind.fd, 1)

    def pop_all(self, kind: Results) -> dict[int, Any]:
        """Every finished result of ``kind``, taken."""
        with self._lock:
            done, kind.done = kind.done, {}
        return done

    def take(self, kind: Results, task_id: int) -> Any:
        """The result of ``task_id`` once, or None (not finished, or taken already)."""
        with self._lock:
            return kind.done.pop(task_id, None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for kind in (self.stores, self.lookups, self.loads):
                os.close(kind.fd)
                kind.done.clear()
