"""Errors raised by the io_engine, each carrying the facts a user needs to act on."""

from __future__ import annotations

import errno as errno_module
import os

from dualblade.errors import DualbladeError


class IOEngineError(DualbladeError):
    """Base class of the io_engine's errors."""


class IoUringUnavailableError(IOEngineError):
    """io_uring cannot be used here (disabled sysctl, seccomp, old kernel, no FFI liburing)."""


class TargetError(IOEngineError):
    """A storage target cannot be opened or used as asked (mounted, too small, no permission)."""


class BufferBusyError(IOEngineError):
    """A buffer was released or reused while the kernel may still DMA into it."""


class IOFailedError(IOEngineError):
    """One transfer failed; names the target, operation, byte range and errno or NVMe status.

    Attributes:
        target: the target's display name (usually its path).
        op: ``"read"``, ``"write"``, ``"trim"``, ``"allocate"`` (a page-cache file made) or
            ``"write-back"`` (the kernel could not write a page-cache file's dirty pages).
        offset: byte offset of the failed chunk on the target.
        length: byte length of the failed chunk.
        errno: the kernel's errno, or ``None`` for an NVMe status or an unexpected end of target.
        nvme_status: the NVMe completion status (SCT/SC/DNR bits), or ``None``.
    """

    def __init__(
        self,
        target: str,
        op: str,
        offset: int,
        length: int,
        *,
        errno: int | None = None,
        nvme_status: int | None = None,
        detail: str = "",
    ) -> None:
        self.target = target
        self.op = op
        self.offset = offset
        self.length = length
        self.errno = errno
        self.nvme_status = nvme_status
        if errno is not None:
            name = errno_module.errorcode.get(errno, str(errno))
            cause = f"errno {errno} ({name}: {os.strerror(errno)})"
        elif nvme_status is not None:
            cause = f"NVMe status 0x{nvme_status:04x}"
        else:
            cause = "failed"
        if detail:
            cause = f"{cause}: {detail}"
        super().__init__(f"{op} of {length} bytes at offset {offset} on {target}: {cause}")
