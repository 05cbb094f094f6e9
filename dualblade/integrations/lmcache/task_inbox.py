"""``TaskInbox``: LMCache's threads start the adapter's tasks on its loop without waiting for it.

Why not the blocking portal's ``start_task_soon``: it returns only once the loop has run the
spawn, so each ``submit_*`` call waited for the loop's next turn, and while loads were in flight
that turn was busy with their completions. In ``lmcache bench l2`` (64 submits of 8 keys a
round) the 64 submits of a load round took 100-220 ms, where the fs adapter's took about 1 ms:
2-3 ms a call that LMCache's controller threads, which serve other requests too, spent waiting
on us (the loads' own throughput did not move: the disk was busy meanwhile; docs/lmcache.md).
Here a submit hands the task to the loop's thread-safe scheduler (``call_soon_threadsafe``,
FIFO: tasks start in the order they were submitted) and returns at once.

Each task runs in the inbox's own task group, wrapped so that an error it lets out is logged
rather than cancelling the group (and every other task with it): a task's own code reports its
result to LMCache (:mod:`.completions`), this only keeps the group serving.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import sniffio
from anyio.abc import TaskGroup, TaskStatus

from dualblade.io_engine import LoopCaller, loop_caller
from dualblade.logs import get_logger

_log = get_logger(__name__)


class TaskInbox:
    """Runs submitted functions as tasks on one event loop; :meth:`submit` is callable from any
    thread and never waits. Start :meth:`serve` on that loop first (``portal.start_task``)."""

    def __init__(self) -> None:
        self._call: LoopCaller | None = None
        self._library = ""
        self._group: TaskGroup | None = None
        self._stopped: anyio.Event | None = None

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve submissions until :meth:`stop`, then wait for the tasks still running."""
        self._call = loop_caller()
        self._library = sniffio.current_async_library()
        self._stopped = anyio.Event()
        async with anyio.create_task_group() as group:
            self._group = group
            task_status.started()
            await self._stopped.wait()
        self._group = None

    def submit(self, function: Callable[..., Awaitable[None] | None], *args: Any) -> None:
        """Start ``function(*args)`` (async or plain) as a task on the loop, soon.

        Raises:
            RuntimeError: :meth:`serve` has not started.
        """
        if self._call is None:
            raise RuntimeError("the task inbox is not serving: start serve() on its loop first")
        self._call(self._start, function, args)

    def stop(self) -> None:
        """On the loop: serve no more submissions (those still queued are dropped: stop only
        once nothing can submit any more)."""
        if self._stopped is not None:
            self._stopped.set()

    def _start(
        self, function: Callable[..., Awaitable[None] | None], args: tuple[Any, ...]
    ) -> None:
        if self._group is None:
            _log.warning("a task was submitted after the inbox stopped", task=_name(function))
            return
        # A callback runs in the submitting thread's context, where no async library is set;
        # anyio's own portal sets it the same way before it starts a task from a thread.
        sniffio.current_async_library_cvar.set(self._library)
        self._group.start_soon(_guarded, function, args)


async def _guarded(function: Callable[..., Awaitable[None] | None], args: tuple[Any, ...]) -> None:
    try:
        result = function(*args)
        if inspect.isawaitable(result):
            await result
    except Exception:
        _log.exception("an lmcache adapter task raised", task=_name(function))


def _name(function: Callable[..., Any]) -> str:
    return getattr(function, "__qualname__", repr(function))
