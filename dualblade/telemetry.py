"""Traces and metrics of actor activity, for tracing dashboards and serving apps.

:class:`Tracer` collects Chrome/Perfetto trace events in memory — one track per actor, a slice per
I/O chunk and per DMA, counters for throughput, queue depth and budget — and writes the
``{"traceEvents": [...]}`` JSON that ui.perfetto.dev and chrome://tracing open. A disabled tracer
costs one attribute check per event, so the runtime always calls it.

:class:`Metrics` holds counters and gauges an application can read as a dict or scrape in the
Prometheus text format. Logging stays structlog's: the library logs through
:mod:`dualblade.logs` and binds context; applications configure structlog (unconfigured, only
warnings reach standard error).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

#: Events kept at most; later events are counted as dropped instead of growing without bound.
MAX_EVENTS = 2_000_000


class Tracer:
    """An in-memory Chrome trace-event recorder (thread-safe).

    Args:
        enabled: when False every method returns at once and nothing is kept.
        process_name: shown as the process's name in the viewer.
    """

    def __init__(self, enabled: bool = True, process_name: str = "dualblade") -> None:
        self.enabled = enabled
        self._t0 = time.perf_counter()
        self._events: list[dict[str, Any]] = []
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.dropped = 0
        if enabled:
            self._events.append(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": self._pid,
                    "tid": 0,
                    "args": {"name": process_name},
                }
            )

    def now_us(self) -> float:
        """Microseconds since the tracer started (the trace's time base)."""
        return (time.perf_counter() - self._t0) * 1e6

    def us(self, perf_counter_s: float) -> float:
        """A ``time.perf_counter()`` reading on the trace's time base (microseconds)."""
        return (perf_counter_s - self._t0) * 1e6

    def _append(self, event: dict[str, Any]) -> None:
        with self._lock:
            if len(self._events) >= MAX_EVENTS:
                self.dropped += 1
                return
            self._events.append(event)

    def track(self, name: str) -> int:
        """The thread id of a named track (an actor), created on first use (0 when disabled)."""
        if not self.enabled:
            return 0
        with self._lock:
            tid = self._tracks.get(name)
            if tid is not None:
                return tid
            tid = len(self._tracks) + 1
            self._tracks[name] = tid
            self._events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": self._pid,
                    "tid": tid,
                    "args": {"name": name},
                }
            )
            return tid

    def complete(
        self, track: str, name: str, start_us: float, end_us: float, /, **args: Any
    ) -> None:
        """A slice ``[start_us, end_us)`` on a track (trace phase ``X``)."""
        if not self.enabled:
            return
        self._append(
            {
                "ph": "X",
                "name": name,
                "pid": self._pid,
                "tid": self.track(track),
                "ts": start_us,
                "dur": max(0.0, end_us - start_us),
                "args": args,
            }
        )

    def span(self, track: str, name: str, /, **args: Any) -> AbstractContextManager[dict[str, Any]]:
        """Record the body as a slice; the yielded dict's entries are added to its args.

        Disabled, a plain ``nullcontext``: a generator's context manager costs microseconds,
        and the copy threads open spans for every KPU (docs/pipeline-profile.md)."""
        if not self.enabled:
            return nullcontext(args)
        return self._span(track, name, args)

    @contextmanager
    def _span(self, track: str, name: str, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
        start = self.now_us()
        try:
            yield args
        finally:
            self.complete(track, name, start, self.now_us(), **args)

    def counter(self, name: str, /, **values: float) -> None:
        """A counter sample (trace phase ``C``): one series per keyword."""
        if not self.enabled:
            return
        self._append(
            {
                "ph": "C",
                "name": name,
                "pid": self._pid,
                "tid": 0,
                "ts": self.now_us(),
                "args": values,
            }
        )

    def instant(self, track: str, name: str, /, **args: Any) -> None:
        """A point event on a track (trace phase ``i``)."""
        if not self.enabled:
            return
        self._append(
            {
                "ph": "i",
                "name": name,
                "pid": self._pid,
                "tid": self.track(track),
                "ts": self.now_us(),
                "s": "t",
                "args": args,
            }
        )

    def document(self) -> dict[str, Any]:
        """The trace as a JSON-ready document."""
        with self._lock:
            events = list(self._events)
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            # The time base as a CLOCK_MONOTONIC reading (Linux's perf_counter), so that
            # samples taken outside the process (cgroup files, the disk's counters) can be
            # put on the trace's axis.
            "otherData": {"dropped_events": self.dropped, "monotonic_t0_s": self._t0},
        }

    def tracks(self) -> list[str]:
        """Names of the tracks seen so far."""
        with self._lock:
            return list(self._tracks)

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the trace JSON to ``path`` (parent folders are created)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.document()))


#: A shared disabled tracer for code paths that were given none.
NULL_TRACER = Tracer(enabled=False)


def _sample(value: float) -> str:
    """A sample value, exact: integers in full (``:g`` would print 2097152 as 2.09715e+06),
    other floats as their shortest round-tripping repr."""
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class Metrics:
    """Counters (monotonic) and gauges (last value), thread-safe, with Prometheus export."""

    def __init__(self, prefix: str = "dualblade") -> None:
        self.prefix = prefix
        self._counters: dict[str, float] = {}
        self._gauges: dict[str, float] = {}
        self._help: dict[str, str] = {}
        self._lock = threading.Lock()

    def inc(self, name: str, value: float = 1.0, help: str = "") -> None:
        """Add to a counter."""
        with self._lock:
            self._counters[name] = self._counters.get(name, 0.0) + value
            if help:
                self._help.setdefault(name, help)

    def set(self, name: str, value: float, help: str = "") -> None:
        """Set a gauge."""
        with self._lock:
            self._gauges[name] = value
            if help:
                self._help.setdefault(name, help)

    def get(self, name: str) -> float:
        """A counter's or gauge's current value (0 when never set)."""
        with self._lock:
            return self._counters.get(name, self._gauges.get(name, 0.0))

    def snapshot(self) -> dict[str, float]:
        """All values, counters and gauges together."""
        with self._lock:
            return {**self._counters, **self._gauges}

    def prometheus(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        with self._lock:
            series = [(n, v, "counter") for n, v in sorted(self._counters.items())]
            series += [(n, v, "gauge") for n, v in sorted(self._gauges.items())]
            helps = dict(self._help)
        for name, value, kind in series:
            full = f"{self.prefix}_{name}"
            if kind == "counter" and not full.endswith("_total"):
                full += "_total"
            if name in helps:
                lines.append(f"# HELP {full} {helps[name]}")
            lines.append(f"# TYPE {full} {kind}")
            lines.append(f"{full} {_sample(value)}")
        return "\n".join(lines) + "\n"
