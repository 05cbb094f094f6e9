"""io_uring operations as small frozen values, each able to fill one SQE.

Each opcode carries its required fields first and kernel defaults after, a ``CODE`` constant that
the probe checks, and one ``build(lib, sqe, user_data)`` method. These ``build`` methods are the
only code that writes into the kernel-shared submission ring.

Safety contract: ``addr`` points into memory that stays alive and untouched by anyone but the
kernel until the CQE carrying ``user_data`` is reaped. The ring thread's in-flight table holds
the owning request (and through it the buffer) for exactly that long.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from dualblade.io_engine import _uapi
from dualblade.io_engine._liburing import LibUring


class Op(Protocol):
    """Anything that can fill one SQE."""

    CODE: ClassVar[int]

    def build(self, lib: LibUring, sqe: int, user_data: int) -> None:
        """Fill the SQE at address ``sqe``; ``user_data`` comes back in its CQE."""


@dataclass(frozen=True, slots=True)
class Read:
    """``pread`` into plain memory."""

    CODE: ClassVar[int] = _uapi.IORING_OP_READ
    fd: int
    addr: int
    length: int
    offset: int
    flags: int = 0  # IOSQE_* (e.g. IOSQE_ASYNC)

    def build(self, lib: LibUring, sqe: int, user_data: int) -> None:
        lib.io_uring_prep_read(sqe, self.fd, self.addr, self.length, self.offset)
        lib.io_uring_sqe_set_data64(sqe, user_data)
        if self.flags:
            lib.io_uring_sqe_set_flags(sqe, self.flags)


@dataclass(frozen=True, slots=True)
class Write:
    """``pwrite`` from plain memory."""

    CODE: ClassVar[int] = _uapi.IORING_OP_WRITE
    fd: int
    addr: int
    length: int
    offset: int
    flags: int = 0  # IOSQE_* (e.g. IOSQE_ASYNC)

    def build(self, lib: LibUring, sqe: int, user_data: int) -> None:
        lib.io_uring_prep_write(sqe, self.fd, self.addr, self.length, self.offset)
        lib.io_uring_sqe_set_data64(sqe, user_data)
        if self.flags:
            lib.io_uring_sqe_set_flags(sqe, self.flags)


@dataclass(frozen=True, slots=True)
class ReadFixed:
    """``pread`` into a registered buffer (no per-I/O page pinning)."""

    CODE: ClassVar[int] = _uapi.IORING_OP_READ_FIXED
    fd: int
    addr: int
    length: int
    offset: int
    buf_index: int
    flags: int = 0  # IOSQE_* (e.g. IOSQE_ASYNC)

    def build(self, lib: LibUring, sqe: int, user_data: int) -> None:
        lib.io_uring_prep_read_fixed(
            sqe, self.fd, self.addr, self.length, self.offset, self.buf_index
        )
        lib.io_uring_sqe_set_data64(sqe, user_data)
        if self.flags:
            lib.io_uring_sqe_set_flags(sqe, self.flags)


@dataclass(frozen=True, slots=True)
class WriteFixed:
    """``pwrite`` from a registered buffer."""

    CODE: ClassVar[int] = _uapi.IORING_OP_WRITE_FIXED
    fd: int
    addr: int
    length: int
    offset: int
    buf_index: int
    flags: int = 0  # IOSQE_* (e.g. IOSQE_ASYNC)

    def build(self, lib: LibUring, sqe: int, user_data: int) -> None:
        lib.io_uring_prep_write_fixed(
            sqe, self.fd, self.addr, self.length, self.offset, self.buf_index
        )
        lib.io_uring_sqe_set_data64(sqe, user_data)
        if self.flags:
            lib.io_uring_sqe_set_flags(sqe, self.flags)


#: A whole 128-byte SQE carrying an NVMe I/O command: the SQE's first 48 bytes (opcode, flags,
#: ioprio, fd, cmd_op and its pad, addr, len, rw_flags, user_data, buf_index, personality,
#: splice_fd_in), then ``struct nvme_uring_cmd`` (72 bytes) in the command area, then 8 zero bytes.
_NVME_IO_SQE = struct.Struct("<BBHiIIQIIQHHiBBHIIIQQIIIIIIIIII8x")
_NVME_URING_CMD = struct.Struct("<BBHIIIQQIIIIIIIIII")


@dataclass(frozen=True, slots=True)
class NvmeIo:
    """An NVMe READ or WRITE through ``IORING_OP_URING_CMD`` (a 128-byte SQE).

    The same SQE as :class:`UringCmd` with an ``nvme_uring_cmd`` payload, written with one
    ``struct`` pack and one copy: a passthrough chunk is the ring thread's most frequent
    command, and filling ctypes fields one by one cost it 2.3 us a chunk here (0.9 us this way),
    many times that in the QEMU guest where passthrough is measured.
    """

    CODE: ClassVar[int] = _uapi.IORING_OP_URING_CMD
    fd: int
    opcode: int  # NVME_CMD_READ or NVME_CMD_WRITE
    nsid: int
    slba: int
    nlb: int  # blocks, 1..65536 (the command carries nlb - 1)
    addr: int
    data_len: int

    @property
    def payload(self) -> bytes:
        """The ``struct nvme_uring_cmd`` this command carries (for checks and traces)."""
        return _NVME_URING_CMD.pack(*self._command_fields())

    def _command_fields(self) -> tuple[int, ...]:
        slba = self.slba
        return (
            self.opcode, 0, 0, self.nsid, 0, 0, 0, self.addr, 0, self.data_len,
            slba & 0xFFFFFFFF, slba >> 32, self.nlb - 1, 0, 0, 0, 0, 0,
        )  # fmt: skip

    def build(self, lib: LibUring, sqe: int, user_data: int) -> None:
        header = (self.CODE, 0, 0, self.fd, _uapi.NVME_URING_CMD_IO, 0, 0, 0, 0, user_data, 0, 0, 0)
        ctypes.memmove(sqe, _NVME_IO_SQE.pack(*header, *self._command_fields()), 128)


@dataclass(frozen=True, slots=True)
class Fallocate:
    """``fallocate(fd, mode, offset, length)``; with PUNCH_HOLE it is a file's TRIM."""

    CODE: ClassVar[int] = _uapi.IORING_OP_FALLOCATE
    fd: int
    mode: int
    offset: int
    length: int

    def build(self, lib: LibUring, sqe: int, user_data: int) -> None:
        lib.io_uring_prep_fallocate(sqe, self.fd, self.mode, self.offset, self.length)
        lib.io_uring_sqe_set_data64(sqe, user_data)


@dataclass(frozen=True, slots=True)
class AsyncCancel:
    """Ask the kernel to cancel the in-flight operation tagged ``target_user_data``."""

    CODE: ClassVar[int] = _uapi.IORING_OP_ASYNC_CANCEL
    target_user_data: int
    flags: int = 0

    def build(self, lib: LibUring, sqe: int, user_data: int) -> None:
        lib.io_uring_prep_cancel64(sqe, self.target_user_data, self.flags)
        lib.io_uring_sqe_set_data64(sqe, user_data)


@dataclass(frozen=True, slots=True)
class UringCmd:
    """``IORING_OP_URING_CMD``: a driver command (e.g. an NVMe command) in a 128-byte SQE.

    ``payload`` is copied into the SQE's command area. Any buffer it points to (an NVMe data
    pointer) falls under the module's safety contract.
    """

    CODE: ClassVar[int] = _uapi.IORING_OP_URING_CMD
    fd: int
    cmd_op: int
    payload: bytes
    #: Memory the command points at (e.g. DSM ranges): held until the CQE is reaped.
    keepalive: object = field(default=None, compare=False, repr=False)

    def build(self, lib: LibUring, sqe: int, user_data: int) -> None:
        if len(self.payload) > _uapi.SQE128_CMD_BYTES:
            raise ValueError(f"uring_cmd payload of {len(self.payload)} bytes exceeds 80")
        ctypes.memset(sqe, 0, ctypes.sizeof(_uapi.IoUringSqe128))
        raw = _uapi.IoUringSqe.from_address(sqe)
        raw.opcode = self.CODE
        raw.fd = self.fd
        raw.off = self.cmd_op  # the cmd_op member shares the low 32 bits of ``off``
        raw.user_data = user_data
        ctypes.memmove(sqe + _uapi.SQE_CMD_OFFSET, self.payload, len(self.payload))
