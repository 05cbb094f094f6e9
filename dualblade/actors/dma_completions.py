"""One thread that waits for the GPU-DMA stream's copies and answers them on the event loop.

Copies queued on one CUDA stream finish in the order they were queued, so a single thread can
wait for them in turn. Before it, the GPU-DMA actor waited for each copy itself, through a
worker-thread round trip, and queued the next copy only once the last was answered: the copy
engine idled while threads woke each other, and the copy threads' buffers stayed locked as long.
On the H200 machine that held the pipeline to 0.5-0.6 of the raw engine's rate on a tmpfs
target (docs/pipeline-profile.md).

Now the actor queues copies back to back and hands each one's event here. This thread waits
for the oldest event, takes every later one that has finished too, and answers the whole batch
with one call onto the loop: one wake-up per batch instead of two thread hops per copy.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dualblade.io_engine import LoopCaller, named_thread

#: Told, on the event loop, how a copy ended: ``None`` when it finished, else the error that
#: waiting for it raised.
OnDone = Callable[[BaseException | None], None]


class CompletionEvent(Protocol):
    """What is waited for: a ``torch.cuda.Event`` recorded after the copy (or a test's fake)."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


@dataclass(frozen=True)
class _Watched:
    event: CompletionEvent
    on_done: OnDone


class DmaCompletions:
    """Waits for copies in the order they were queued; answers them in batches on the loop.

    Args:
        call_on_loop: runs a function on the actor's event loop (see
            :func:`dualblade.io_engine.loop_caller`).
        name: the thread's name.
    """

    def __init__(self, call_on_loop: LoopCaller, *, name: str = "gpu-dma-completions") -> None:
        self._call_on_loop = call_on_loop
        self._pending: deque[_Watched] = deque()
        self._changed = threading.Condition()
        self._closing = False
        self._thread = named_thread(self._run, name)
        self.batches = 0  # calls onto the loop
        self.answered = 0  # copies answered

    def start(self) -> None:
        self._thread.start()

    def watch(self, event: CompletionEvent, on_done: OnDone) -> None:
        """Answer ``on_done`` on the loop once ``event`` has completed (or failed)."""
        with self._changed:
            if self._closing:
                raise RuntimeError("DMA completions are closed")
            self._pending.append(_Watched(event, on_done))
            self._changed.notify()

    @property
    def pending(self) -> int:
        """Copies queued and not yet answered."""
        with self._changed:
            return len(self._pending)

    def close(self) -> None:
        """Take no more copies; the thread ends once every queued one has been answered."""
        with self._changed:
            self._closing = True
            self._changed.notify()

    def join(self) -> None:
        """Block until the thread has ended (call :meth:`close` first)."""
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._closing:
                    self._changed.wait()
                if not self._pending:
                    return
                oldest = self._pending[0]
            error: BaseException | None = None
            try:
                oldest.event.synchronize()  # releases the GIL while it waits
            except BaseException as caught:  # a CUDA error: the copy's requester gets it
                error = caught
            batch = [(oldest.on_done, error)]
            with self._changed:
                self._pending.popleft()
                while self._pending and error is None and self._finished(self._pending[0]):
                    batch.append((self._pending.popleft().on_done, None))
            self.batches += 1
            self.answered += len(batch)
            self._call_on_loop(_answer, batch)

    @staticmethod
    def _finished(watched: _Watched) -> bool:
        try:
            return watched.event.query()
        except BaseException:  # let synchronize() report it, for this copy alone
            return False


def _answer(batch: list[tuple[OnDone, BaseException | None]]) -> None:
    for on_done, error in batch:
        on_done(error)
