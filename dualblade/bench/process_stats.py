"""What this process holds and does, read from ``/proc/self``: memory, pinned memory, fds,
threads, storage reads.

The soak samples these over time to show that a long run reaches a steady state, and compares
them before and after a store's life to show nothing leaked. No psutil: the soak must run on the
bare machines too.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

#: Threads that outlive a store by design: anyio's and trio's idle worker caches, pytest's.
CACHED_THREAD_PREFIXES = ("AnyIO worker thread", "Trio thread", "asyncio_")


@dataclass(frozen=True)
class MemorySample:
    """One reading: resident, locked and pinned bytes (``VmRSS``, ``VmLck``, ``VmPin``)."""

    rss_bytes: int
    locked_bytes: int
    pinned_bytes: int


def memory_sample() -> MemorySample:
    """Read ``/proc/self/status`` (zeros where a field is missing)."""
    fields = {"VmRSS": 0, "VmLck": 0, "VmPin": 0}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in fields:
                fields[key] = int(value.split()[0]) * 1024  # reported in kB
    return MemorySample(fields["VmRSS"], fields["VmLck"], fields["VmPin"])


def storage_read_bytes() -> int:
    """Bytes this process (all its threads, io_uring's workers included) made the kernel fetch
    from storage: ``read_bytes`` of ``/proc/self/io``. Page-cache hits add nothing to it."""
    with open("/proc/self/io") as io:
        for line in io:
            key, _, value = line.partition(":")
            if key == "read_bytes":
                return int(value)
    return 0


def open_fds() -> set[int]:
    """The process's open file descriptors."""
    return {int(name) for name in os.listdir("/proc/self/fd")}


def describe_fds(fds: set[int]) -> list[str]:
    """``fd -> target`` for each of ``fds`` still open (for a leak report)."""
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue  # closed meanwhile
    return out


def live_threads() -> set[str]:
    """Names and idents of live threads, except worker caches that outlive any store."""
    return {
        f"{thread.name}#{thread.ident}"
        for thread in threading.enumerate()
        if not thread.name.startswith(CACHED_THREAD_PREFIXES)
    }


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, keyed ``comm#tid``: the
    kernel's threads too (``/proc/self/task``), among them io_uring's workers (``iou-wrk-*``),
    which ``threading`` does not list."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                text = stat.read()
        except OSError:
            continue  # ended meanwhile
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        out[f"{name}#{tid}"] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def cpu_seconds_between(before: dict[str, float], after: dict[str, float]) -> float:
    """CPU seconds the threads alive in ``after`` spent since ``before`` (a thread new since
    then counts whole); threads that ended in between are not counted."""
    return sum(seconds - before.get(key, 0.0) for key, seconds in after.items())
