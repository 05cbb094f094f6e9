"""Wake an awaiting task, or a blocked thread, from the ring thread.

The ring thread must never block on an event loop, so completion is delivered with the loop's
own non-blocking thread-safe scheduler: ``loop.call_soon_threadsafe`` under asyncio and
``TrioToken.run_sync_soon`` under trio. An event loop that has already closed (its caller gave
up and the loop ended) is ignored: nobody is left to wake.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import anyio
import sniffio


def async_waker() -> tuple[anyio.Event, Callable[[], None]]:
    """An event for the current task and a thread-safe function that sets it."""
    event = anyio.Event()
    library = sniffio.current_async_library()
    if library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def wake_trio() -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(event.set)

        return event, wake_trio

    import asyncio

    loop = asyncio.get_running_loop()

    def wake_asyncio() -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody left to wake
            loop.call_soon_threadsafe(event.set)

    return event, wake_asyncio


def blocking_waker() -> tuple[threading.Event, Callable[[], None]]:
    """A threading event and the function that sets it."""
    event = threading.Event()
    return event, event.set
