"""What the soak's workers observed, and the rule that accounts each injected fault.

A fault counts against an operation when it landed in that operation's context's own storage
(its run of the direct target, its page-cache files) while the operation ran. A hard fault must
then have surfaced as the operation's error (one of them; the rest were *coalesced* into it), or
the operation was cancelled; a hard fault that vanished (*swallowed*) or an error nobody
injected fails the soak. Short and slow faults are *absorbed*: the engine retries or waits.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from dualblade.errors import DualbladeError
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

    def mismatch(self, what: str) -> None:
        self.mismatches += 1
        if len(self.mismatch_examples) < 10:
            self.mismatch_examples.append(what)

    def unexpected_error(self, what: str) -> None:
        self.unexpected_count += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(what)

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
            self.unexpected_error(f"context {context} {op}: {type(error).__name__}: {error}")
            for fault in hard:
                self.coalesced[fault.kind.value] += 1
        elif cut:
            for fault in hard:
                self.during_cancel[fault.kind.value] += 1
        else:
            for fault in hard:
                self.swallowed[fault.kind.value] += 1
