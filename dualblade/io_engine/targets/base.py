"""What every storage target offers the engine: an fd, geometry, and how to build its commands.

A target knows its own I/O rules (alignment, maximum transfer, which command carries a chunk,
what a completion's ``res`` means) and nothing about rings or threads. The engine asks it for one
:class:`~dualblade.io_engine.opcodes.Op` per chunk and hands the completion back to
:meth:`Target.transferred`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

from dualblade.io_engine import opcodes
from dualblade.io_engine.errors import IOFailedError, TargetError


class Target(ABC):
    """A place bytes live: a file, a block device or an NVMe namespace.

    Attributes:
        name: shown in errors and logs (usually the path).
        fd: the open file descriptor the engine submits against.
        lba_size: the I/O unit; offsets and lengths must be multiples of it.
        alignment: required alignment of buffer addresses for DMA.
        max_transfer: the largest single command, in bytes (a multiple of ``lba_size``).
        size: addressable bytes.
        passthrough: needs a ring with 128-byte SQEs and 32-byte CQEs (NVMe commands).
        threadpool_capable: can be served by the pread/pwrite compatibility engine.
        max_trim: the largest range one trim command covers.
        lane: the engine's queue it waits in; each lane has ``queue_depth`` chunks in flight
            of its own (``"device"``, or ``"page-cache"`` for buffered files: see
            :mod:`dualblade.io_engine._lanes`).
    """

    name: str
    fd: int
    lba_size: int
    alignment: int
    max_transfer: int
    size: int
    passthrough: bool = False
    threadpool_capable: bool = True
    #: The largest range one trim command may cover (the engine splits longer trims).
    max_trim: int = 1 << 62
    #: ``IOSQE_*`` flags set on every read and write command to this target.
    sqe_flags: int = 0
    lane: str = "device"
    #: A completion that moved a chunk's whole length (a file command) or returned status 0 (an
    #: NVMe command) is one :meth:`transferred` takes as the whole chunk, so the ring's native
    #: chunk pump counts it in C without calling it. A subclass whose ``transferred`` does more
    #: (fault injection) sets this False, and every completion of its goes through Python; one
    #: that overrides ``transferred`` and does not say gets False (:meth:`__init_subclass__`).
    native_completion: bool = True

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A subclass that overrides :meth:`transferred` without setting ``native_completion``
        itself keeps every completion in Python: the pump must not skip what it adds."""
        super().__init_subclass__(**kwargs)
        if "transferred" in cls.__dict__ and "native_completion" not in cls.__dict__:
            cls.native_completion = False

    # -- validation ---------------------------------------------------------------------------
    def check_io(self, op: str, offset: int, length: int, address: int | None) -> None:
        """Refuse misaligned or out-of-range I/O before anything is submitted.

        Raises:
            TargetError: the range leaves the target, or offset/length/buffer are not aligned.
        """
        if offset < 0 or length < 0:
            raise TargetError(f"{op} on {self.name}: negative offset {offset} or length {length}")
        if offset + length > self.size:
            raise TargetError(
                f"{op} of {length} bytes at offset {offset} on {self.name} ends past the "
                f"target's {self.size} bytes"
            )
        if offset % self.lba_size or length % self.lba_size:
            raise TargetError(
                f"{op} on {self.name}: offset {offset} and length {length} must be multiples "
                f"of the target's LBA size {self.lba_size}"
            )
        if address is not None and address % self.alignment:
            raise TargetError(
                f"{op} on {self.name}: buffer address 0x{address:x} is not aligned to "
                f"{self.alignment} bytes (use dualblade.io_engine.AlignedBuffer)"
            )

    # -- commands -----------------------------------------------------------------------------
    def command_bytes(self, size: int, max_chunk: int | None) -> int:
        """The size of the commands a ``size``-byte read or write is cut into: the target's
        ``max_transfer``, capped by the engine's ``max_chunk`` (Algorithm 2's chunking), in
        whole LBAs."""
        if max_chunk is None:
            return self.max_transfer
        return max(
            self.lba_size, min(self.max_transfer, max_chunk // self.lba_size * self.lba_size)
        )

    def io_op(
        self, write: bool, address: int, length: int, offset: int, buf_index: int | None
    ) -> opcodes.Op:
        """The command that moves ``length`` bytes between ``address`` and ``offset``."""
        if buf_index is None:
            cls_plain = opcodes.Write if write else opcodes.Read
            return cls_plain(self.fd, address, length, offset, self.sqe_flags)
        cls_fixed = opcodes.WriteFixed if write else opcodes.ReadFixed
        return cls_fixed(self.fd, address, length, offset, buf_index, self.sqe_flags)

    def transferred(self, op: str, res: int, length: int, offset: int, extra: int) -> int:
        """Bytes a completion moved; ``res`` is the CQE result, ``extra`` the big-CQE word.

        Raises:
            IOFailedError: the kernel reported an error.
        """
        if res < 0:
            raise IOFailedError(self.name, op, offset, length, errno=-res)
        return length if op == "trim" else res

    def trim_op(self, offset: int, length: int) -> opcodes.Op | None:
        """A ring command that deallocates the range, or None to use :meth:`trim_blocking`."""
        return None

    @abstractmethod
    def trim_blocking(self, offset: int, length: int) -> None:
        """Deallocate the range synchronously (run on a worker thread by the engine)."""

    def allocated_ranges(self, offset: int, length: int) -> list[tuple[int, int]] | None:
        """``(offset, length)`` of each part of the range that holds data, or None when the
        target cannot tell (a device keeps no record of which blocks were written).

        A store that starts after a crashed predecessor discards only these parts of its
        extent (and can say how much it reclaimed); where the answer is None it discards the
        whole extent.
        """
        return None

    # -- blocking fallbacks used by the thread-pool engine -------------------------------------
    def pread_blocking(self, view: memoryview, offset: int) -> int:
        """``preadv`` into ``view``; returns bytes read."""
        return os.preadv(self.fd, [view], offset)

    def pwrite_blocking(self, view: memoryview, offset: int) -> int:
        """``pwritev`` from ``view``; returns bytes written."""
        return os.pwritev(self.fd, [view], offset)

    def lock_exclusive(self, wait_s: float = 0.0) -> None:
        """Claim the target for this process (``flock``), so a second store cannot share it.

        ``wait_s``: how long to keep trying while another holds the lock. A process killed
        with I/O in flight keeps its lock a little longer than it lives: the kernel drops the
        lock with the last reference to the file, which the dead process's io_uring holds until
        its exit work has reaped the I/O. A store restarted at once after a crash waits that out.

        Raises:
            TargetError: another open file description holds the lock (another store).
        """
        import errno
        import fcntl
        import time

        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as error:
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise TargetError(f"cannot lock {self.name}: {error.strerror}") from error
            if time.monotonic() >= deadline:
                raise TargetError(
                    f"{self.name} is in use by another dualblade store; give each store its "
                    "own target (or extent file)"
                )
            time.sleep(0.01)

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the file descriptor (idempotent)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> dict[str, object]:
        """Geometry for logs, ``doctor`` and benchmark reports."""
        return {
            "kind": type(self).__name__,
            "name": self.name,
            "size": self.size,
            "lba_size": self.lba_size,
            "max_transfer": self.max_transfer,
        }
