"""The kernel's name for a thread of ours, so that tools outside Python can tell them apart.

Python names its threads for itself alone: the kernel still calls every thread of the process
by the program's name (``python``), and that is the name ``top -H``, ``perf``, ``py-spy`` and
``/proc/<pid>/task/<tid>/comm`` show. Finding where the ring thread's time went in a decode
(docs/bench.md, twenty-fifth session) meant telling it apart by elimination: by its thread id,
and by the io_uring workers the kernel names after their submitter (``iou-wrk-<tid>``). The
store's own threads now carry their names into the kernel as they start.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable

#: ``prctl`` option that names the calling thread (``linux/prctl.h``).
_PR_SET_NAME = 15
#: The kernel keeps this many bytes of a thread's name (16 with the terminating NUL).
KERNEL_NAME_BYTES = 15


def kernel_thread_name(name: str) -> bytes:
    """``name`` as the kernel keeps it: UTF-8, cut to :data:`KERNEL_NAME_BYTES` bytes at a
    character's end (the kernel would cut a character in two)."""
    cut = name.encode("utf-8", "replace")[:KERNEL_NAME_BYTES]
    return cut.decode("utf-8", "ignore").encode("utf-8")


def name_os_thread(name: str) -> bool:
    """Give the calling thread ``name`` in the kernel (cut as :func:`kernel_thread_name` cuts
    it). A name is an aid, never a reason to fail: False, and nothing raised, where the system
    does not take it (not Linux, no ``prctl``)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return False
    return bool(prctl(_PR_SET_NAME, ctypes.c_char_p(kernel_thread_name(name)), 0, 0, 0) == 0)


def named_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A daemon thread called ``name`` in Python and (see :func:`name_os_thread`) in the
    kernel, which runs ``target``."""

    def run() -> None:
        name_os_thread(name)
        target()

    return threading.Thread(target=run, name=name, daemon=True)
