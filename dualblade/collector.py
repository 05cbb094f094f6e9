"""Python's cyclic collector in dualblade's own processes: what the setup made is left out.

A full pass of the collector walks every tracked object the process holds, on whichever thread
happens to allocate, with the GIL held throughout. A process that has built a model holds
hundreds of thousands of them (modules, parameters, torch's and transformers' own state), and
the decode's transfers allocate enough that a full pass comes due during it. On the H100
machine, OPT-6.7B at an 11 GiB limit (every layer in the page cache, 0.28-0.31 s a step), one
full pass of 71-72 ms landed in the second decode step of both runs of ``dualblade bench`` and
made it the slowest: the ring thread cannot reap or submit, and the copy threads' completions
wait on the event loop (docs/bench.md). The LMCache adapter met the same passes (300 ms over
LMCache's objects) and freezes its setup for the same reason.

:func:`freeze_setup` is called by the commands and the bench's workers once the model and the
store are set up, before the timed work: what is alive then lives as long as the process, and
the collector's later passes walk only what was made after. An application that embeds a store
decides this for its own process (the LMCache adapter's ``freeze_gc`` is that choice made for
LMCache's): the call belongs where its own setup ends.

:class:`CollectorPauses` times the passes that still come, while it is installed: each one's
generation and duration, on the trace (a ``python gc`` track) and summed per phase in the bench's
records. Why: the setup is frozen, but the decode's own allocations still bring passes due, and
each holds the GIL. What it showed on an H100 at 11 GiB (docs/bench.md, thirty-second session):
a seven-step decode runs 53 young and 5 middle passes, 27-31 ms in all, none over 2.3 ms, and
decodes with the collector off (arms alternated) were no faster; the thirty-first session's gap
between its arms, one after the other, was the machine's drift.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

from dualblade.telemetry import NULL_TRACER, Tracer

#: The track the passes are drawn on.
TRACK = "python gc"


def freeze_setup() -> int:
    """Collect the setup's garbage, then move every object still alive into the collector's
    permanent generation (:func:`gc.freeze`); returns how many objects are frozen.

    The cost: a reference cycle among those objects that becomes garbage later is never
    collected, which for a model and a store kept until the process ends costs nothing.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass(frozen=True)
class Pause:
    """One pass of the cyclic collector: its generation, when it began (``time.perf_counter``)
    and how long it held the interpreter."""

    generation: int
    start_s: float
    seconds: float


class CollectorPauses:
    """Times every pass of the cyclic collector while installed (``with``; see the module).

    A pass runs on whichever thread allocated, with the GIL held, one at a time, so its start
    and end arrive in order. Args: ``tracer``: where the passes are drawn when it is removed
    (disabled: nowhere). Not from the callback itself: a pass can begin inside the tracer's own
    lock (an allocation there), and a callback that took the lock again would never return.
    """

    def __init__(self, tracer: Tracer = NULL_TRACER) -> None:
        self.tracer = tracer
        self.pauses: list[Pause] = []
        self._started: float | None = None

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._on_pass)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._on_pass)
        for pause in self.pauses:
            start = self.tracer.us(pause.start_s)
            end = self.tracer.us(pause.start_s + pause.seconds)
            self.tracer.complete(TRACK, f"gc gen{pause.generation}", start, end)

    def _on_pass(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        start, self._started = self._started, None
        if start is not None:  # else it was installed while a pass ran
            self.pauses.append(Pause(info["generation"], start, now - start))

    def between(self, start_s: float, end_s: float) -> dict[str, Any]:
        """The passes that began in ``[start_s, end_s)`` (``time.perf_counter`` readings):
        how many of each generation, their total and their longest seconds."""
        chosen = [p for p in self.pauses if start_s <= p.start_s < end_s]
        return {
            "passes": [sum(1 for p in chosen if p.generation == g) for g in range(3)],
            "seconds": round(sum(p.seconds for p in chosen), 6),
            "longest_s": round(max((p.seconds for p in chosen), default=0.0), 6),
        }
