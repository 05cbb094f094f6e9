"""What the soak's workers observed, and the rule that accounts each injected fault.

A fault counts against an operation when it landed in that operation's context's own storage
(its run of the direct target, its page-cache files) while the operation ran. A hard fault must
then have surfaced as the operation's error (one of them; the rest were *coalesced* into it), or
the operation was cancelled; a hard fault that vanished (*swallowed*) or an error nobody
injected fails the soak. Short and slow faults are *absorbed*: the engine retries or waits.
On a full disk (``--full-disk``) an ENOSPC nobody injected is expected, and counted by where it
was met (``full_disk``: the context's operation and the I/O that found no room).
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from dualblade.errors import DualbladeError
from dualblade.io_engine import IOFailedError
from dualblade.testing import InjectedFault, InjectedIOError


@dataclass(frozen=True)
class ContextStorage:
    """Where one context's bytes live, to tell its faults from everybody else's."""

    context_id: int
    direct_target: str  # the direct target's name (page-cache files have their own)
    region: tuple[int, int] | None  # byte range of its direct run (None: no direct layers)

    def owns(self, fault: InjectedFault) -> bool:
        """The fault hit this context's storage: its direct run, or one of its page-cache files."""
        if fault.target == self.direct_target:
            region = self.region
            return region is not None and region[0] <= fault.offset < region[1]
        return f"{os.sep}context-{self.context_id}{os.sep}" in fault.target


@dataclass
class Ledger:
    """Everything the workers observed."""

    ops: Counter[str] = field(default_factory=Counter)
    contexts: int = 0
    bytes_written: int = 0
    bytes_verified: int = 0
    mismatches: int = 0
    mismatch_examples: list[str] = field(default_factory=list)
    cancellations: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lost_refusals: int = 0
    surfaced: Counter[str] = field(default_factory=Counter)
    coalesced: Counter[str] = field(default_factory=Counter)
    during_cancel: Counter[str] = field(default_factory=Counter)
    absorbed: Counter[str] = field(default_factory=Counter)  # short/slow: retried, invisible
    swallowed: Counter[str] = field(default_factory=Counter)
    by_path: Counter[str] = field(default_factory=Counter)  # "direct" or "page-cache"
    unexpected: list[str] = field(default_factory=list)  # the first few
    unexpected_count: int = 0
    #: a real full disk is expected (``--full-disk``): ENOSPC errors nobody injected, by op
    disk_full_expected: bool = False
    full_disk: Counter[str] = field(default_factory=Counter)
    #: called at once on a mismatch, an unexpected error or a swallowed fault (a child process
    #: reports them before it can be killed)
    on_problem: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def mismatch(self, what: str) -> None:
        self.mismatches += 1
        if len(self.mismatch_examples) < 10:
            self.mismatch_examples.append(what)
        self._problem()

    def unexpected_error(self, what: str) -> None:
        self.unexpected_count += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(what)
        self._problem()

    def _problem(self) -> None:
        if self.on_problem is not None:
            self.on_problem()

    def to_json(self) -> dict[str, Any]:
        """What it observed, JSON-ready (counters as dicts)."""
        return {
            name: dict(value) if isinstance(value, Counter) else value
            for name, value in vars(self).items()
            if name not in ("on_problem", "disk_full_expected")
        }

    def add(self, other: dict[str, Any]) -> None:
        """Add another ledger's :meth:`to_json` to this one (a child process's)."""
        for name, value in other.items():
            mine = getattr(self, name)
            if isinstance(mine, Counter):
                mine.update(value)
            elif isinstance(mine, list):
                mine.extend(value[: max(0, 20 - len(mine))])
            else:
                setattr(self, name, mine + value)

    def attributed(self) -> Counter[str]:
        """Faults accounted to some operation, by kind."""
        total: Counter[str] = Counter()
        for part in (self.surfaced, self.coalesced, self.during_cancel, self.absorbed):
            total.update(part)
        total.update(self.swallowed)
        return total

    def account(
        self,
        storage: ContextStorage,
        op: str,
        faults: list[InjectedFault],
        error: DualbladeError | None,
        cut: bool,
    ) -> None:
        """Match the faults injected during ``op`` into ``storage`` with the op's outcome:
        ``error`` (None: it succeeded or was ``cut`` by its deadline)."""
        mine = [f for f in faults if storage.owns(f)]
        for fault in mine:
            self.by_path["direct" if fault.target == storage.direct_target else "page-cache"] += 1
        hard = [f for f in mine if f.kind.hard]
        for fault in mine:
            if not fault.kind.hard:
                self.absorbed[fault.kind.value] += 1
        context = storage.context_id
        if isinstance(error, InjectedIOError):
            match = [f for f in hard if f.serial == error.serial]
            if not match:
                self.unexpected_error(
                    f"context {context} {op}: fault #{error.serial} is not one of its own"
                )
            for fault in hard:
                bucket = self.surfaced if fault in match else self.coalesced
                bucket[fault.kind.value] += 1
        elif error is not None:
            if self.disk_full_expected and _no_room(error):
                self.full_disk[f"{op}:{error.op}"] += 1
            else:
                self.unexpected_error(f"context {context} {op}: {type(error).__name__}: {error}")
            for fault in hard:
                self.coalesced[fault.kind.value] += 1
        elif cut:
            for fault in hard:
                self.during_cancel[fault.kind.value] += 1
        else:
            for fault in hard:
                self.swallowed[fault.kind.value] += 1
            if hard:
                self._problem()


def _no_room(error: DualbladeError) -> TypeGuard[IOFailedError]:
    """A real full disk: ENOSPC at a claim, a file, a write or a write-back."""
    return isinstance(error, IOFailedError) and error.errno == errno.ENOSPC
