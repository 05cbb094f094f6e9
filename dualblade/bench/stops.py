"""A bench stopped part way keeps the runs it finished.

A sweep or a service preset runs for minutes to hours, one worker process at a time, and is
often stopped from outside: Ctrl-C, or a ``timeout`` (the GPU machine's calls have a hard limit)
that sends SIGTERM. Python's default for SIGTERM ends the process on the spot: no ``finally``
runs, the running worker is left in its memory cgroup, and a report written only at the end is
never written (a 4 GiB GPU sweep lost three finished runs so, docs/bench.md). So:

- :func:`terminate_raises` turns the first SIGTERM into :class:`Terminated`, raised in the main
  thread as Ctrl-C raises ``KeyboardInterrupt``: the runner's ``finally`` blocks kill the
  worker and remove its cgroup and the run's files on the way out;
- :func:`write_whole` replaces the results files through a rename as each run ends, so a file
  is never left half written, whenever the process stops;
- :func:`stop_of` names what stopped a bench for its report, with the exit status the shell
  would have given (128 + the signal's number);
- :func:`run_keeping` runs a bench's runs, writing its report after each one and once more,
  marked stopped, when a signal ends them; :func:`progress_fields` and :func:`progress_lines`
  mark such a report (its JSON, its markdown) as not whole.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any


class Terminated(BaseException):
    """SIGTERM during a bench, raised in the main thread like Ctrl-C's ``KeyboardInterrupt``
    (a ``BaseException`` for the same reason: ``except Exception`` must not swallow it)."""


#: What stopped a bench: its name in the report and the command's exit status.
_STOPS: dict[type[BaseException], tuple[str, int]] = {
    KeyboardInterrupt: ("interrupted (SIGINT)", 128 + signal.SIGINT),
    Terminated: ("terminated (SIGTERM)", 128 + signal.SIGTERM),
}

#: The exceptions a bench catches to write its finished runs and stop.
STOP_SIGNALS: tuple[type[BaseException], ...] = tuple(_STOPS)


def stop_of(stop: BaseException, done: int, planned: int) -> tuple[str, int]:
    """``("terminated (SIGTERM) after 1 of 3 runs", 143)`` for a stop of :data:`STOP_SIGNALS`.

    Raises:
        TypeError: ``stop`` is not one of them.
    """
    for kind, (name, status) in _STOPS.items():
        if isinstance(stop, kind):
            return f"{name} after {done} of {planned} runs", status
    raise TypeError(f"{stop!r} is not a stop of {[k.__name__ for k in _STOPS]}")


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """The first SIGTERM raises :class:`Terminated` inside the block; later ones are ignored
    until the block ends, so that they cannot cut the cleanup short. Only the main thread can
    take a signal's handler: called elsewhere (an embedding app's worker thread), the block
    runs with the handler the process has."""

    def on_term(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def write_whole(out: Path, files: Mapping[str, str]) -> None:
    """Each ``name: text`` of ``files`` into ``out``, replacing the file whole (written beside
    it, then renamed over it)."""
    for name, text in files.items():
        partial = out / f".{name}.partial"
        partial.write_text(text)
        partial.replace(out / name)


Record = dict[str, Any]


def run_keeping(
    run: Callable[[Callable[[Record], None]], object],
    write: Callable[[list[Record], str | None], None],
    planned: int,
) -> tuple[list[Record], str | None, int]:
    """Call ``run(keep)`` under :func:`terminate_raises`; ``run`` hands each finished run's
    record to ``keep``, and after each one ``write(records so far, None)`` runs. Returns the
    records, what stopped them (None when ``run`` ended) and the exit status for it (0, or 130 /
    143 as :func:`stop_of` gives). On Ctrl-C or SIGTERM, ``run`` cleans up on the way out (its
    ``finally`` blocks) and the records it finished are written with the stop's description."""
    records: list[Record] = []

    def keep(record: Record) -> None:
        records.append(record)
        write(records, None)

    try:
        with terminate_raises():
            run(keep)
    except STOP_SIGNALS as stop:
        stopped, status = stop_of(stop, len(records), planned)
        write(records, stopped)
        return records, stopped, status
    return records, None, 0


def progress_fields(done: int, planned: int, stopped: str | None) -> dict[str, Any]:
    """``complete`` (False while runs remain, or where a signal stopped them: the claims then
    judge only the runs that finished) and ``stopped``, for a report's top level."""
    return {"complete": done == planned, "stopped": stopped}


def progress_lines(report: Mapping[str, Any]) -> list[str]:
    """A markdown line saying the report is not whole (still running, or stopped), or none.
    Reads ``complete`` and ``stopped`` (:func:`progress_fields`) and ``meta``'s ``runs_done``
    and ``runs_planned``."""
    if report["complete"]:
        return []
    meta = report["meta"]
    done = f"{meta['runs_done']} of {meta['runs_planned']} runs"
    if report["stopped"] is not None:
        return [f"**Stopped** ({report['stopped']}): the claims judge only these {done}.", ""]
    return [f"**In progress**: {done} so far; the claims judge only those.", ""]


def say_stopped(why: str, out: Path) -> None:
    """Tell the user on stderr what stopped the bench and where its finished runs are."""
    after_bar = "\n" if sys.stderr.isatty() else ""  # a progress bar's line is open
    print(
        f"{after_bar}stopped ({why}); {out}/results.json holds the finished runs", file=sys.stderr
    )
