"""Fault-injecting targets: a testing and soak aid, never used by default.

:class:`FaultyTarget` wraps any target (the store's direct target); :class:`FaultyPageCacheFile`
is a page-cache file (Group 1) with the same faults. Both record into a :class:`FaultLog`.

Why at the target: both engines consult the target for every chunk — the io_uring ring hands
each completion to :meth:`Target.transferred`, the compatibility engine calls
:meth:`Target.pread_blocking` / :meth:`Target.pwrite_blocking` — so a wrapper there drives the
real error, retry and cancellation paths of both backends, of the copy threads and of the store,
with no test-only branch in any of them.

Faults, chosen per chunk by a seeded :class:`FaultPolicy`:

- ``eio`` / ``enospc``: the chunk fails with :class:`InjectedIOError` (an
  :class:`~dualblade.io_engine.errors.IOFailedError`, errno ``EIO`` / ``ENOSPC``; ``enospc``
  on writes only). On the ring the kernel did move the bytes and the failure is reported on
  completion; in the compatibility engine the syscall is skipped. Callers cannot tell, and must
  not rely on either.
- ``short``: the chunk reports half of what it moved (whole LBAs, at least one), so the engine
  must resubmit the rest.
- ``slow``: the completion is held back for ``slow_s`` seconds (on the ring this stalls the ring
  thread, like a slow device would stall its queue).

Trims are passed through untouched: a context's release must not be refused by injection.
Every injected fault is recorded with its target, offset and serial number, so a soak can check
that each one surfaced where it should.
"""

from __future__ import annotations

import enum
import errno as errno_module
import os
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from dualblade.io_engine import opcodes
from dualblade.io_engine.errors import IOFailedError, TargetError
from dualblade.io_engine.targets.base import Target
from dualblade.io_engine.targets.page_cache_file import PageCacheFile


class FaultKind(enum.Enum):
    """What an injected fault does to one chunk."""

    EIO = "eio"
    ENOSPC = "enospc"
    SHORT = "short"
    SLOW = "slow"

    @property
    def hard(self) -> bool:
        """The chunk fails (the caller must see an error), rather than merely misbehaving."""
        return self in (FaultKind.EIO, FaultKind.ENOSPC)


_ERRNO = {FaultKind.EIO: errno_module.EIO, FaultKind.ENOSPC: errno_module.ENOSPC}


class InjectedIOError(IOFailedError):
    """An :class:`IOFailedError` made by a :class:`FaultyTarget`; ``serial`` names the fault."""

    def __init__(
        self, target: str, op: str, offset: int, length: int, *, errno: int, serial: int
    ) -> None:
        super().__init__(
            target, op, offset, length, errno=errno, detail=f"injected fault #{serial}"
        )
        self.serial = serial


@dataclass(frozen=True)
class InjectedFault:
    """One fault as injected: where, what, and when (``time.monotonic`` seconds)."""

    serial: int
    kind: FaultKind
    target: str
    op: str
    offset: int
    length: int
    at: float


class FaultPolicy:
    """Decides, per chunk, whether and how it fails: ``rate`` of chunks get a fault.

    Args:
        rate: probability that a chunk gets a fault, in ``[0, 1]``.
        seed: seeds the generator (the sequence of decisions, not their timing, is repeatable).
        kinds: the faults to pick from, uniformly (``enospc`` is skipped on reads).
        slow_s: how long a ``slow`` completion is held back.

    Raises:
        ValueError: a rate outside ``[0, 1]``, no kinds, or a negative delay.
    """

    def __init__(
        self,
        rate: float,
        *,
        seed: int = 0,
        kinds: tuple[FaultKind, ...] = tuple(FaultKind),
        slow_s: float = 0.002,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {rate}")
        if not kinds:
            raise ValueError("a fault policy needs at least one fault kind")
        if slow_s < 0:
            raise ValueError(f"slow_s must not be negative, got {slow_s}")
        self.rate = rate
        self.kinds = kinds
        self.slow_s = slow_s
        self.enabled = True
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def decide(self, op: str) -> FaultKind | None:
        """The fault for the next chunk of ``op`` (``read``/``write``), or None."""
        if not self.enabled or not self.rate:
            return None
        with self._lock:
            if self._random.random() >= self.rate:
                return None
            choices = [k for k in self.kinds if op == "write" or k is not FaultKind.ENOSPC]
            return self._random.choice(choices) if choices else None


class FaultLog:
    """The faults injected by any number of targets that share it, numbered in order.

    The most recent ``history`` are kept (a long soak must not grow without bound), and a count
    per kind of all of them. Thread-safe: the ring thread and pool workers record into it.
    """

    def __init__(self, history: int = 100_000) -> None:
        self._log: deque[InjectedFault] = deque(maxlen=history)
        self._counts: Counter[FaultKind] = Counter()
        self._lock = threading.Lock()
        self._serial = 0

    def record(
        self, kind: FaultKind, target: str, op: str, offset: int, length: int
    ) -> InjectedFault:
        with self._lock:
            self._serial += 1
            fault = InjectedFault(self._serial, kind, target, op, offset, length, time.monotonic())
            self._log.append(fault)
            self._counts[kind] += 1
        return fault

    @property
    def injected(self) -> list[InjectedFault]:
        """The faults injected so far (the most recent ``history``), in order (a copy)."""
        with self._lock:
            return list(self._log)

    @property
    def serial(self) -> int:
        """The serial number of the last fault injected (0: none yet)."""
        return self._serial

    def counts(self) -> dict[FaultKind, int]:
        """How many faults of each kind were injected in all."""
        with self._lock:
            return dict(self._counts)

    def since(self, serial: int) -> list[InjectedFault]:
        """The faults injected after the one numbered ``serial``, in order.

        Raises:
            LookupError: some of them already fell out of the history.
        """
        with self._lock:
            out: list[InjectedFault] = []
            for fault in reversed(self._log):
                if fault.serial <= serial:
                    break
                out.append(fault)
            if self._serial - serial != len(out):
                raise LookupError(f"faults after #{serial} are no longer in the history")
        out.reverse()
        return out


class _Injector:
    """The per-chunk logic both fault-injecting targets share."""

    def __init__(self, name: str, lba_size: int, policy: FaultPolicy, log: FaultLog) -> None:
        self.name = name
        self.lba_size = lba_size
        self.policy = policy
        self.log = log
        self.window: tuple[int, int] | None = None

    def _inject(self, op: str, offset: int, length: int) -> InjectedFault | None:
        window = self.window
        if window is not None and not window[0] <= offset < window[1]:
            return None
        kind = self.policy.decide(op)
        if kind is None:
            return None
        if kind is FaultKind.SHORT and self._short(length) == 0:
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
        """The ring's path: what a completion that moved ``moved`` bytes reports."""
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

    def on_call(
        self, op: str, view: memoryview, offset: int, call: Callable[[memoryview, int], int]
    ) -> int:
        """The compatibility engine's path: ``call`` is the real ``preadv``/``pwritev``."""
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


class FaultyTarget(Target):
    """``inner`` with faults injected by ``policy``; geometry, fd and commands are the inner's.

    Faults are recorded in ``log`` (a new one keeping ``history`` faults when not given).
    Closing it closes ``inner``.
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
        self._injector = _Injector(inner.name, inner.lba_size, policy, self.log)

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
        """Grow the inner target (a growable :class:`DirectFile`).

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
    def io_op(
        self, write: bool, address: int, length: int, offset: int, buf_index: int | None
    ) -> opcodes.Op:
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
    def trim_op(self, offset: int, length: int) -> opcodes.Op | None:
        return self.inner.trim_op(offset, length)

    def trim_blocking(self, offset: int, length: int) -> None:
        self.inner.trim_blocking(offset, length)

    def describe(self) -> dict[str, object]:
        return {**self.inner.describe(), "faults": "injected"}

    def close(self) -> None:
        self.fd = -1
        self.inner.close()


class FaultyPageCacheFile(PageCacheFile):
    """A page-cache file (Group 1) whose transfers get faults by ``policy``, into ``log``.

    A subclass rather than a wrapper: the page-cache path also uses the file's own page-cache
    calls (``mincore`` residency, ``fadvise``, ``fdatasync``, the baseline's ``mmap``), which
    stay real. Created by the binder when the store is given it as its page-cache file factory.
    """

    def __init__(
        self, path: str | os.PathLike[str], size: int, policy: FaultPolicy, log: FaultLog
    ) -> None:
        super().__init__(path, size)
        self._injector = _Injector(self.name, self.lba_size, policy, log)

    def transferred(self, op: str, res: int, length: int, offset: int, extra: int) -> int:
        moved = super().transferred(op, res, length, offset, extra)
        return self._injector.on_completion(op, moved, offset, length)

    def pread_blocking(self, view: memoryview, offset: int) -> int:
        return self._injector.on_call("read", view, offset, super().pread_blocking)

    def pwrite_blocking(self, view: memoryview, offset: int) -> int:
        return self._injector.on_call("write", view, offset, super().pwrite_blocking)
