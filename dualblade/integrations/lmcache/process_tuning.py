"""The interpreter settings the adapter changes while it is open, and gives back at close.

LMCache runs the adapter inside a process of its own making (the multiprocess server, ``lmcache
bench``), and two things the ring thread needs are set for the whole process:

- **The cyclic collector's thresholds.** A full pass holds the GIL for its whole length, on
  whichever thread allocates; the ring thread cannot reap or submit meanwhile, and the disk
  idles (``params.DEFAULT_GC_THRESHOLD`` says what it cost).
- **The GIL's switch interval.** The ring thread sleeps in ``io_uring_submit_and_wait`` with the
  GIL let go; when the disk completes it must take the GIL back to reap and submit the next
  chunks. While the event loop runs Python (a round's loads being posted, completions handed
  on), a thread asking for the GIL gets it only when the interval runs out: Python's 5 ms, on
  a disk that completes a queue of 1 MiB reads every 14 ms (``params.DEFAULT_SWITCH_INTERVAL``).

The values in force when the adapter opened come back when it closes. Two adapters open in one
process share the settings: the last to close restores what the first found only if they close
in the reverse order of opening.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessTuning:
    """What to set while the adapter is open; None leaves a setting as the host process has it."""

    gc_threshold: tuple[int, ...] | None
    switch_interval: float | None

    def apply(self) -> ProcessTuning:
        """Set these and return the host's values before them (``apply`` it to give them back)."""
        host = ProcessTuning(
            gc.get_threshold() if self.gc_threshold is not None else None,
            sys.getswitchinterval() if self.switch_interval is not None else None,
        )
        if self.gc_threshold is not None:
            gc.set_threshold(*self.gc_threshold)
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
        return host
