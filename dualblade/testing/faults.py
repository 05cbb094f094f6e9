"""What a fault is, who decides that a chunk gets one, and the log of those injected.

A fault is chosen per chunk by a seeded :class:`FaultPolicy`; each one injected is recorded, with
a serial number, in a :class:`FaultLog` that any number of targets share, so that a test or a soak
can later check that every fault surfaced where it should. The targets that inject them are in
:mod:`dualblade.testing.targets`.

The kinds:

- ``eio`` / ``enospc``: the chunk fails with :class:`InjectedIOError` (an
  :class:`~dualblade.io_engine.IOFailedError`, errno ``EIO`` / ``ENOSPC``; ``enospc`` on writes
  and write-backs only). A page-cache file's write-back (``fdatasync`` / ``sync_file_range``)
  fails the same way, before the real call. On the ring the kernel did move the bytes and
  the failure is reported on completion; in the compatibility engine the syscall is skipped.
  Callers cannot tell, and must not rely on either.
- ``short``: the chunk reports half of what it moved (whole LBAs, at least one), so the engine
  must resubmit the rest.
- ``slow``: the completion is held back for ``slow_s`` seconds (on the ring this stalls the ring
  thread, like a slow device would stall its queue).
"""

from __future__ import annotations

import enum
import random
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from dualblade.io_engine import IOFailedError


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


class InjectedIOError(IOFailedError):
    """An :class:`IOFailedError` made by a fault-injecting target; ``serial`` names the fault in
    its :class:`FaultLog`, so a caller can tell which injected fault reached it."""

    def __init__(
        self, target: str, op: str, offset: int, length: int, *, errno: int, serial: int
    ) -> None:
        super().__init__(
            target, op, offset, length, errno=errno, detail=f"injected fault #{serial}"
        )
        self.serial = serial


class FaultPolicy:
    """Decides, per chunk, whether and how it fails: ``rate`` of chunks get a fault.

    Set ``enabled`` to False to pause injection (to check that a target recovers, say).

    Args:
        rate: probability that a chunk gets a fault, in ``[0, 1]``.
        seed: seeds the generator (the sequence of decisions, not their timing, is repeatable).
        kinds: the faults to pick from, uniformly (``enospc`` is skipped on reads).
        slow_s: how long a ``slow`` completion is held back.
        ops: the operations that may get faults (``read``, ``write``, ``write-back``: a
            page-cache file's ``fdatasync`` / ``sync_file_range``); None: all of them.

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
        ops: tuple[str, ...] | None = None,
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
        self.ops = ops
        self.enabled = True
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def decide(self, op: str) -> FaultKind | None:
        """The fault for the next chunk of ``op`` (``read``/``write``/``write-back``), or None."""
        if not self.enabled or not self.rate or (self.ops is not None and op not in self.ops):
            return None
        with self._lock:
            if self._random.random() >= self.rate:
                return None
            writes = op in ("write", "write-back")
            choices = [k for k in self.kinds if writes or k is not FaultKind.ENOSPC]
            return self._random.choice(choices) if choices else None


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
        """Number and keep one fault a target is injecting now."""
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
