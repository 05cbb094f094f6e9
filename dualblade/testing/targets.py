"""Targets that inject faults: :class:`FaultyTarget` wraps any target (the store's direct
target), :class:`FaultyPageCacheFile` is a page-cache file (Group 1) with the same faults.

Why at the target: both engines consult the target for every chunk — the io_uring ring hands
each completion to ``Target.transferred``, the compatibility engine calls
``Target.pread_blocking`` / ``Target.pwrite_blocking`` — so a target that misbehaves there drives
the real error, retry and cancellation paths of both backends, of the copy threads and of the
store, with no test-only branch in any of them. Both record every fault into a
:class:`~dualblade.testing.FaultLog`, so a test can check that each one surfaced where it should.
"""

from __future__ import annotations

import os

from dualblade.io_engine import Op, PageCacheFile, Target, TargetError
from dualblade.testing._injector import Injector
from dualblade.testing.faults import FaultKind, FaultLog, FaultPolicy, InjectedFault


class FaultyTarget(Target):
    """``inner`` with faults injected by ``policy``; geometry, fd and commands are the inner's.

    Faults are recorded in ``log`` (a new one keeping ``history`` faults when not given).
    Trims pass through untouched. Closing it closes ``inner``.
    """

    def __init__(
        self,
        inner: Target,
        policy: FaultPolicy,
        *,
        history: int = 100_000,
        log: FaultLog | None = None,
    ) -> None:
        self.inner = inner
        self.policy = policy
        self.log = log or FaultLog(history)
        self.name = inner.name
        self.fd = inner.fd
        self.lba_size = inner.lba_size
        self.alignment = inner.alignment
        self.max_transfer = inner.max_transfer
        self.passthrough = inner.passthrough
        self.threadpool_capable = inner.threadpool_capable
        self.max_trim = inner.max_trim
        self.lane = inner.lane
        self._injector = Injector(inner.name, inner.lba_size, policy, self.log)

    def limit_to(self, start: int, end: int) -> None:
        """Inject only into chunks that start in ``[start, end)`` (one context's run, say)."""
        self._injector.window = (start, end)

    @property
    def size(self) -> int:
        """The inner target's size, also after it grew."""
        return self.inner.size

    @size.setter
    def size(self, value: int) -> None:
        self.inner.size = value

    def grow_to(self, size: int) -> None:
        """Grow the inner target (a growable :class:`~dualblade.io_engine.DirectFile`).

        Raises:
            TargetError: the inner target cannot grow.
        """
        grow = getattr(self.inner, "grow_to", None)
        if grow is None:
            raise TargetError(f"{self.name} cannot grow")
        grow(size)

    # -- bookkeeping (the log's) -----------------------------------------------------------------
    @property
    def injected(self) -> list[InjectedFault]:
        """The faults in the log, in order (a copy)."""
        return self.log.injected

    @property
    def serial(self) -> int:
        """The serial number of the log's last fault (0: none yet)."""
        return self.log.serial

    def counts(self) -> dict[FaultKind, int]:
        """How many faults of each kind the log holds in all."""
        return self.log.counts()

    def since(self, serial: int) -> list[InjectedFault]:
        """The log's faults after the one numbered ``serial`` (see :meth:`FaultLog.since`)."""
        return self.log.since(serial)

    # -- the ring's path -------------------------------------------------------------------------
    #: Every completion goes through :meth:`transferred`, where the faults are injected.
    native_completion = False

    def io_op(
        self, write: bool, address: int, length: int, offset: int, buf_index: int | None
    ) -> Op:
        return self.inner.io_op(write, address, length, offset, buf_index)

    def transferred(self, op: str, res: int, length: int, offset: int, extra: int) -> int:
        moved = self.inner.transferred(op, res, length, offset, extra)  # real errors first
        return self._injector.on_completion(op, moved, offset, length)

    # -- the compatibility engine's path ---------------------------------------------------------
    def pread_blocking(self, view: memoryview, offset: int) -> int:
        return self._injector.on_call("read", view, offset, self.inner.pread_blocking)

    def pwrite_blocking(self, view: memoryview, offset: int) -> int:
        return self._injector.on_call("write", view, offset, self.inner.pwrite_blocking)

    # -- passed through ---------------------------------------------------------------------
    def trim_op(self, offset: int, length: int) -> Op | None:
        return self.inner.trim_op(offset, length)

    def trim_blocking(self, offset: int, length: int) -> None:
        self.inner.trim_blocking(offset, length)

    def allocated_ranges(self, offset: int, length: int) -> list[tuple[int, int]] | None:
        return self.inner.allocated_ranges(offset, length)

    def describe(self) -> dict[str, object]:
        return {**self.inner.describe(), "faults": "injected"}

    def close(self) -> None:
        self.fd = -1
        self.inner.close()


class FaultyPageCacheFile(PageCacheFile):
    """A page-cache file (Group 1) whose transfers get faults by ``policy``, into ``log``.

    A subclass rather than a wrapper: the page-cache path also uses the file's own page-cache
    calls (``mincore`` residency, ``fadvise``, the baseline's ``mmap``), which stay real. Its
    write-backs (``flush``, ``write_back``, ``start_write_back``, ``check_write_back``) get
    faults too, op ``write-back``, before the real call: a disk that cannot take the dirty
    pages. The store makes them when given a factory of them as its ``page_cache_file``.
    """

    def __init__(
        self, path: str | os.PathLike[str], size: int, policy: FaultPolicy, log: FaultLog
    ) -> None:
        super().__init__(path, size)
        self._injector = Injector(self.name, self.lba_size, policy, log)

    #: Every completion goes through :meth:`transferred`, where the faults are injected.
    native_completion = False

    def transferred(self, op: str, res: int, length: int, offset: int, extra: int) -> int:
        moved = super().transferred(op, res, length, offset, extra)
        return self._injector.on_completion(op, moved, offset, length)

    def pread_blocking(self, view: memoryview, offset: int) -> int:
        return self._injector.on_call("read", view, offset, super().pread_blocking)

    def pread_cached(self, view: memoryview, offset: int) -> int:
        return self._injector.on_call("read", view, offset, super().pread_cached)

    def pwrite_blocking(self, view: memoryview, offset: int) -> int:
        return self._injector.on_call("write", view, offset, super().pwrite_blocking)

    def flush(self) -> None:
        self._injector.on_sync("write-back", 0, self.size)
        super().flush()

    def write_back(self, offset: int, length: int) -> None:
        self._injector.on_sync("write-back", offset, length)
        super().write_back(offset, length)

    def start_write_back(self, offset: int, length: int) -> None:
        self._injector.on_sync("write-back", offset, length)
        super().start_write_back(offset, length)

    def check_write_back(self) -> None:
        self._injector.on_sync("write-back", 0, self.size)
        super().check_write_back()
