"""The ring's table of fixed buffers: memory the kernel pins once, so that a chunk read into it
or written from it skips pinning and unpinning its pages.

A 1 MiB chunk on memory that is not registered costs the kernel a pin and an unpin of 256
pages. On tmpfs, where the copy is the whole cost of a read, fio read 11 % faster with fixed
buffers than without (5.8 against 5.2 GB/s, 1 MiB blocks at depth 16, four alternating pairs;
docs/pipeline-profile.md). The store registers its copy threads' pinned buffers when it starts,
and a context's read buffers when they are made, so the table must take buffers after the first
ones: it is created sparse (``IORING_RSRC_REGISTER_SPARSE``, Linux 5.19) and filled slot by
slot. Where the kernel cannot make a sparse table, the first buffers are registered the old way
and later ones go unregistered (their I/O still works, pinned per chunk).

Everything here runs on the ring thread, except :attr:`index_by_id` lookups (a dict read) and
the weak-reference callback, which only posts a removal to the ring thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import resource
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from dualblade.io_engine import _uapi
from dualblade.io_engine.buffers import AlignedBuffer
from dualblade.io_engine.errors import IOEngineError

#: Slots a table has beyond its first buffers: one per read buffer a store's contexts hold at
#: once (a context's read ahead holds two or three, a serving request one per copy thread).
SPARE_SLOTS = 256

_MEMLOCK_HINT = " (registering pins memory: raise RLIMIT_MEMLOCK, `ulimit -l`, or run as root)"

#: ``CAP_IPC_LOCK``'s bit in ``/proc/self/status``'s ``CapEff``.
_CAP_IPC_LOCK = 14


def ipc_lock_in(status: str) -> bool:
    """Whether ``/proc/self/status`` text grants ``CAP_IPC_LOCK`` (effective)."""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    return False


@functools.cache
def memlock_note() -> str | None:
    """Why buffers after the first stay unregistered in this process, or None.

    io_uring charges pinned pages to the user's ``RLIMIT_MEMLOCK`` unless the process holds
    ``CAP_IPC_LOCK``. Under a finite limit, read buffers pinned by one store would take the room
    the copy threads' buffers of the next store need to start (every store of the user counts),
    so only the first buffers are registered there.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as status:
            if ipc_lock_in(status.read()):
                return None
    except OSError:
        pass
    return (
        f"pinned memory counts against RLIMIT_MEMLOCK ({soft} bytes) here: kept for the copy "
        "threads' buffers"
    )


class FixedBufferTable:
    """Which buffers the ring's table holds, at which index.

    Args:
        lib: the bound liburing (:mod:`._liburing`).
        ring: the address of the ring's ``struct io_uring``.
        post: queues a call for the ring thread (``Ring._post("call", ...)``); used when a
            registered buffer is garbage-collected without being removed.
    """

    def __init__(self, lib: Any, ring: int, post: Callable[[Callable[[], None]], None]) -> None:
        self._lib = lib
        self._ring = ring
        self._post = post
        #: ``id(buffer)`` -> its index: read by the ring thread for every chunk it builds.
        self.index_by_id: dict[int, int] = {}
        #: index -> the buffer's id and a weak reference to it (the table must not keep a
        #: buffer its owner dropped; the reference's callback frees the slot instead)
        self._refs: dict[int, tuple[int, weakref.ref[AlignedBuffer]]] = {}
        self._free: list[int] = []
        self._growable = False
        self._made = False  # a table exists in the kernel
        self._first_done = False  # ``register_first`` ran

    def register_first(self, buffers: Sequence[AlignedBuffer]) -> None:
        """Register the ring's first buffers (once), in a table with room for more.

        Raises:
            IOEngineError: first buffers were registered already, or the kernel refused (e.g.
                over ``RLIMIT_MEMLOCK`` as non-root).
        """
        if self._first_done:
            raise IOEngineError("fixed buffers are already registered with this ring")
        self._first_done = True
        if not self._made and not self._make_sparse(len(buffers) + SPARE_SLOTS):
            self._register_all(buffers)  # no sparse tables here: a table of exactly these
            return
        for buffer in buffers:
            if (reason := self.add(buffer)) is not None:
                raise IOEngineError(
                    f"registering a fixed buffer of {buffer.size} bytes failed: {reason}"
                )

    def _make_sparse(self, size: int) -> bool:
        """Make an empty table of ``size`` slots; False where the kernel cannot."""
        if self._lib.io_uring_register_buffers_sparse(self._ring, size) < 0:
            return False
        self._made = self._growable = True
        self._free = list(range(size - 1, -1, -1))
        return True

    def _register_all(self, buffers: Sequence[AlignedBuffer]) -> None:
        iovecs = (_uapi.Iovec * len(buffers))(
            *(_uapi.Iovec(buffer.address, buffer.size) for buffer in buffers)
        )
        rc = self._lib.io_uring_register_buffers(self._ring, iovecs, len(buffers))
        if rc < 0:
            hint = _MEMLOCK_HINT if -rc in (errno.ENOMEM, errno.EPERM) else ""
            raise IOEngineError(
                f"registering {len(buffers)} fixed buffer(s) of "
                f"{sum(b.size for b in buffers)} bytes failed: {os.strerror(-rc)}{hint}"
            )
        self._made = True
        for index, buffer in enumerate(buffers):
            self._remember(index, buffer)

    def add(self, buffer: AlignedBuffer) -> str | None:
        """Put ``buffer`` in a free slot; None when it is fixed now, else why it is not."""
        if id(buffer) in self.index_by_id:
            return None
        if not self._made:
            self._make_sparse(SPARE_SLOTS)  # the first buffers come later, or never
        if not self._growable:
            return "this kernel cannot add buffers to a ring's fixed-buffer table"
        if not self._free:
            return f"all {len(self._refs)} slots of the ring's fixed-buffer table are taken"
        index = self._free.pop()
        rc = self._update(index, buffer.address, buffer.size)
        if rc < 0:
            self._free.append(index)
            hint = _MEMLOCK_HINT if -rc in (errno.ENOMEM, errno.EPERM) else ""
            return f"{os.strerror(-rc)}{hint}"
        self._remember(index, buffer)
        return None

    def remove(self, buffer: AlignedBuffer) -> None:
        """Give ``buffer``'s slot back (nothing if it has none). Chunks already in the kernel
        keep the pages they imported; chunks built after this one read it unregistered."""
        index = self.index_by_id.get(id(buffer))
        if index is not None:
            self._release(index)

    def forget(self) -> None:
        """Drop the bookkeeping: the ring is gone, and the kernel freed its table with it."""
        self.index_by_id.clear()
        self._refs.clear()
        self._free.clear()
        self._growable = False

    def _remember(self, index: int, buffer: AlignedBuffer) -> None:
        key = id(buffer)

        def collected(_ref: object) -> None:
            # On whichever thread freed the buffer: the slot is cleared on the ring thread, in
            # inbox order, so a new buffer that reuses the id is registered after the clear.
            with contextlib.suppress(IOEngineError):  # a closed ring took its table with it
                self._post(lambda: self._release_collected(index, key))

        self._refs[index] = (key, weakref.ref(buffer, collected))
        self.index_by_id[key] = index

    def _release_collected(self, index: int, key: int) -> None:
        if self.index_by_id.get(key) == index:
            self._release(index)

    def _release(self, index: int) -> None:
        key, _ref = self._refs.pop(index)
        del self.index_by_id[key]
        if self._growable:
            self._update(index, 0, 0)  # an empty iovec clears the slot and unpins its pages
            self._free.append(index)

    def _update(self, index: int, address: int, size: int) -> int:
        iovec = _uapi.Iovec(address, size)
        rc: int = self._lib.io_uring_register_buffers_update_tag(
            self._ring, index, ctypes.byref(iovec), None, 1
        )
        return rc if rc < 0 else 0
