"""Wake an awaiting task, or a blocked thread, from a native or helper thread.

Such a thread must never block on an event loop, so it reaches the loop through the loop's own
non-blocking thread-safe scheduler: ``loop.call_soon_threadsafe`` under asyncio and
``TrioToken.run_sync_soon`` under trio. An event loop that has already closed (its caller gave
up and the loop ended) is ignored: nobody is left to wake.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import anyio
import sniffio

#: Runs ``function(*args)`` on the event loop it was made on; callable from any thread, never
#: blocks, and does nothing once that loop has ended.
LoopCaller = Callable[..., None]


def loop_caller() -> LoopCaller:
    """A thread-safe way to run a plain function on the current event loop, soon."""
    library = sniffio.current_async_library()
    if library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def call_trio(function: Callable[..., Any], *args: Any) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(function, *args)

        return call_trio

    import asyncio

    loop = asyncio.get_running_loop()

    def call_asyncio(function: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody left to wake
            loop.call_soon_threadsafe(function, *args)

    return call_asyncio


def async_waker() -> tuple[anyio.Event, Callable[[], None]]:
    """An event for the current task and a thread-safe function that sets it."""
    event = anyio.Event()
    call = loop_caller()

    def wake() -> None:
        call(event.set)

    return event, wake


def blocking_waker() -> tuple[threading.Event, Callable[[], None]]:
    """A threading event and the function that sets it."""
    event = threading.Event()
    return event, event.set
