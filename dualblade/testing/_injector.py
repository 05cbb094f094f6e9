"""The per-chunk logic both fault-injecting targets share: decide, record, then misbehave.

Both of the I/O engine's backends pass through a target for every chunk, each at its own hook:
the io_uring ring hands each completion to ``Target.transferred`` (:meth:`Injector.on_completion`
below), the compatibility engine calls ``pread_blocking`` / ``pwrite_blocking`` around the real
``preadv`` / ``pwritev`` (:meth:`Injector.on_call`). One injector serves both hooks, so a fault
means the same thing on either backend.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable

from dualblade.testing.faults import (
    FaultKind,
    FaultLog,
    FaultPolicy,
    InjectedFault,
    InjectedIOError,
)

_ERRNO = {FaultKind.EIO: errno.EIO, FaultKind.ENOSPC: errno.ENOSPC}


class Injector:
    """Injects ``policy``'s faults into the chunks of the target called ``name``, into ``log``.

    ``window``, when set, limits injection to chunks that start in ``[start, end)``.
    """

    def __init__(self, name: str, lba_size: int, policy: FaultPolicy, log: FaultLog) -> None:
        self.name = name
        self.lba_size = lba_size
        self.policy = policy
        self.log = log
        self.window: tuple[int, int] | None = None

    def _inject(
        self, op: str, offset: int, length: int, *, short_ok: bool = True
    ) -> InjectedFault | None:
        window = self.window
        if window is not None and not window[0] <= offset < window[1]:
            return None
        kind = self.policy.decide(op)
        if kind is None:
            return None
        if kind is FaultKind.SHORT and (not short_ok or self._short(length) == 0):
            return None  # a single-LBA chunk cannot come back short in whole LBAs
        return self.log.record(kind, self.name, op, offset, length)

    def _short(self, moved: int) -> int:
        return moved // 2 // self.lba_size * self.lba_size

    def _error(self, fault: InjectedFault) -> InjectedIOError:
        return InjectedIOError(
            self.name,
            fault.op,
            fault.offset,
            fault.length,
            errno=_ERRNO[fault.kind],
            serial=fault.serial,
        )

    def on_completion(self, op: str, moved: int, offset: int, length: int) -> int:
        """The ring's path: what a completion that moved ``moved`` bytes reports.

        Trims pass untouched: a context's release must not be refused by injection.

        Raises:
            InjectedIOError: a hard fault hit the chunk.
        """
        if op == "trim" or moved <= 0:
            return moved
        fault = self._inject(op, offset, length)
        if fault is None:
            return moved
        if fault.kind.hard:
            raise self._error(fault)
        if fault.kind is FaultKind.SLOW:
            time.sleep(self.policy.slow_s)
            return moved
        return self._short(moved) or moved

    def on_sync(self, op: str, offset: int, length: int) -> None:
        """A page-cache file's write-back (``op``), before the real call: a hard fault fails
        it, a slow one delays it, a short one does not apply.

        Raises:
            InjectedIOError: a hard fault hit the write-back.
        """
        fault = self._inject(op, offset, length, short_ok=False)
        if fault is None:
            return
        if fault.kind.hard:
            raise self._error(fault)
        time.sleep(self.policy.slow_s)

    def on_call(
        self, op: str, view: memoryview, offset: int, call: Callable[[memoryview, int], int]
    ) -> int:
        """The compatibility engine's path: ``call`` is the real ``preadv``/``pwritev``.

        Raises:
            InjectedIOError: a hard fault hit the chunk (``call`` was not made).
        """
        fault = self._inject(op, offset, len(view))
        if fault is None:
            return call(view, offset)
        if fault.kind.hard:
            raise self._error(fault)
        if fault.kind is FaultKind.SLOW:
            time.sleep(self.policy.slow_s)
            return call(view, offset)
        with view[: self._short(len(view))] as part:
            return call(part, offset)
