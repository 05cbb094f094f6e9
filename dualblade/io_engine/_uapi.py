"""Kernel UAPI layouts and constants for io_uring, NVMe passthrough, block ioctls and
``cachestat`` (ABI only).

Field names and offsets follow ``include/uapi/linux/io_uring.h``,
``include/uapi/linux/nvme_ioctl.h`` and ``include/uapi/linux/mman.h``;
``tests/io_engine/test_abi.py`` pins every size and offset the rest of the package relies on.
Nothing here does I/O.
"""

from __future__ import annotations

import ctypes
from typing import Final

# --- io_uring_setup flags (IORING_SETUP_*) -----------------------------------------------------
IORING_SETUP_SQE128: Final = 1 << 10
IORING_SETUP_CQE32: Final = 1 << 11
IORING_SETUP_SINGLE_ISSUER: Final = 1 << 12
IORING_SETUP_COOP_TASKRUN: Final = 1 << 8
IORING_SETUP_DEFER_TASKRUN: Final = 1 << 13

# --- opcodes (enum io_uring_op) ----------------------------------------------------------------
IORING_OP_NOP: Final = 0
IORING_OP_READV: Final = 1
IORING_OP_WRITEV: Final = 2
IORING_OP_READ_FIXED: Final = 4
IORING_OP_WRITE_FIXED: Final = 5
IORING_OP_FALLOCATE: Final = 17
IORING_OP_ASYNC_CANCEL: Final = 14
IORING_OP_READ: Final = 22
IORING_OP_WRITE: Final = 23
IORING_OP_URING_CMD: Final = 46

#: Names for the probe report; only opcodes dualblade uses or reports are listed.
OPCODE_NAMES: Final[dict[int, str]] = {
    IORING_OP_NOP: "NOP",
    IORING_OP_READV: "READV",
    IORING_OP_WRITEV: "WRITEV",
    IORING_OP_READ_FIXED: "READ_FIXED",
    IORING_OP_WRITE_FIXED: "WRITE_FIXED",
    IORING_OP_ASYNC_CANCEL: "ASYNC_CANCEL",
    IORING_OP_FALLOCATE: "FALLOCATE",
    IORING_OP_READ: "READ",
    IORING_OP_WRITE: "WRITE",
    IORING_OP_URING_CMD: "URING_CMD",
}

# --- SQE flags and cancel flags ----------------------------------------------------------------
IOSQE_ASYNC: Final = 1 << 4
IORING_ASYNC_CANCEL_ALL: Final = 1 << 0

# --- fallocate modes (linux/falloc.h) ----------------------------------------------------------
FALLOC_FL_KEEP_SIZE: Final = 0x01
FALLOC_FL_PUNCH_HOLE: Final = 0x02


# --- ioctl number encoding (asm-generic/ioctl.h) -----------------------------------------------
_IOC_NONE: Final = 0
_IOC_WRITE: Final = 1
_IOC_READ: Final = 2


def _ioc(direction: int, kind: int, number: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | number


def io(kind: int, number: int) -> int:
    """``_IO(kind, number)``."""
    return _ioc(_IOC_NONE, kind, number, 0)


def ior(kind: int, number: int, size: int) -> int:
    """``_IOR(kind, number, size)``."""
    return _ioc(_IOC_READ, kind, number, size)


def iowr(kind: int, number: int, size: int) -> int:
    """``_IOWR(kind, number, size)``."""
    return _ioc(_IOC_READ | _IOC_WRITE, kind, number, size)


class IoUringSqe(ctypes.Structure):
    """``struct io_uring_sqe``, 64 bytes; the unions are flattened to the members we use."""

    _fields_ = (
        ("opcode", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("ioprio", ctypes.c_uint16),
        ("fd", ctypes.c_int32),
        ("off", ctypes.c_uint64),  # also addr2, and cmd_op (low 32 bits) for URING_CMD
        ("addr", ctypes.c_uint64),
        ("len", ctypes.c_uint32),
        ("rw_flags", ctypes.c_uint32),  # also fsync_flags, cancel_flags, uring_cmd_flags ...
        ("user_data", ctypes.c_uint64),
        ("buf_index", ctypes.c_uint16),
        ("personality", ctypes.c_uint16),
        ("file_index", ctypes.c_uint32),
        ("addr3", ctypes.c_uint64),
        ("pad2", ctypes.c_uint64),
    )


#: Offset of the command area (``sqe->cmd``) used by ``IORING_OP_URING_CMD``.
SQE_CMD_OFFSET: Final = 48
#: Bytes available in the command area of a 128-byte SQE.
SQE128_CMD_BYTES: Final = 80


class IoUringSqe128(ctypes.Structure):
    """A 128-byte SQE (``IORING_SETUP_SQE128``): the normal SQE with 64 more command bytes."""

    _fields_ = (
        ("sqe", IoUringSqe),
        ("extra", ctypes.c_uint8 * 64),
    )


class IoUringCqe(ctypes.Structure):
    """``struct io_uring_cqe``, 16 bytes."""

    _fields_ = (
        ("user_data", ctypes.c_uint64),
        ("res", ctypes.c_int32),
        ("flags", ctypes.c_uint32),
    )


class IoUringCqe32(ctypes.Structure):
    """A 32-byte CQE (``IORING_SETUP_CQE32``): passthrough returns the NVMe result in big_cqe."""

    _fields_ = (
        ("cqe", IoUringCqe),
        ("big_cqe", ctypes.c_uint64 * 2),
    )


class IoSqringOffsets(ctypes.Structure):
    _fields_ = (
        ("head", ctypes.c_uint32),
        ("tail", ctypes.c_uint32),
        ("ring_mask", ctypes.c_uint32),
        ("ring_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("dropped", ctypes.c_uint32),
        ("array", ctypes.c_uint32),
        ("resv1", ctypes.c_uint32),
        ("user_addr", ctypes.c_uint64),
    )


class IoCqringOffsets(ctypes.Structure):
    _fields_ = (
        ("head", ctypes.c_uint32),
        ("tail", ctypes.c_uint32),
        ("ring_mask", ctypes.c_uint32),
        ("ring_entries", ctypes.c_uint32),
        ("overflow", ctypes.c_uint32),
        ("cqes", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("resv1", ctypes.c_uint32),
        ("user_addr", ctypes.c_uint64),
    )


class IoUringParams(ctypes.Structure):
    """``struct io_uring_params``, 120 bytes: setup flags in, ring geometry and features out."""

    _fields_ = (
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", IoSqringOffsets),
        ("cq_off", IoCqringOffsets),
    )


class Iovec(ctypes.Structure):
    """``struct iovec``, used to register fixed buffers."""

    _fields_ = (("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t))


#: The fields ``struct nvme_uring_cmd`` and ``struct nvme_passthru_cmd`` share: an NVMe
#: submission entry as the kernel takes it (64 bytes before the last word).
_NVME_COMMAND_FIELDS: tuple[tuple[str, type], ...] = (
    ("opcode", ctypes.c_uint8),
    ("flags", ctypes.c_uint8),
    ("rsvd1", ctypes.c_uint16),
    ("nsid", ctypes.c_uint32),
    ("cdw2", ctypes.c_uint32),
    ("cdw3", ctypes.c_uint32),
    ("metadata", ctypes.c_uint64),
    ("addr", ctypes.c_uint64),
    ("metadata_len", ctypes.c_uint32),
    ("data_len", ctypes.c_uint32),
    ("cdw10", ctypes.c_uint32),
    ("cdw11", ctypes.c_uint32),
    ("cdw12", ctypes.c_uint32),
    ("cdw13", ctypes.c_uint32),
    ("cdw14", ctypes.c_uint32),
    ("cdw15", ctypes.c_uint32),
    ("timeout_ms", ctypes.c_uint32),
)


class NvmeUringCmd(ctypes.Structure):
    """``struct nvme_uring_cmd``, 72 bytes, placed in the command area of a 128-byte SQE."""

    _fields_ = (*_NVME_COMMAND_FIELDS, ("rsvd2", ctypes.c_uint32))


class NvmePassthruCmd(ctypes.Structure):
    """``struct nvme_passthru_cmd`` (``nvme_admin_cmd``), 72 bytes, for the admin ioctl."""

    _fields_ = (*_NVME_COMMAND_FIELDS, ("result", ctypes.c_uint32))


class NvmeDsmRange(ctypes.Structure):
    """One Dataset Management range: context attributes, length in LBAs, starting LBA."""

    _fields_ = (
        ("cattr", ctypes.c_uint32),
        ("nlb", ctypes.c_uint32),
        ("slba", ctypes.c_uint64),
    )


# --- NVMe ioctl numbers (linux/nvme_ioctl.h) ---------------------------------------------------
_NVME: Final = ord("N")
NVME_IOCTL_ID: Final = io(_NVME, 0x40)
NVME_IOCTL_ADMIN_CMD: Final = iowr(_NVME, 0x41, ctypes.sizeof(NvmePassthruCmd))
NVME_URING_CMD_IO: Final = iowr(_NVME, 0x80, ctypes.sizeof(NvmeUringCmd))
NVME_URING_CMD_ADMIN: Final = iowr(_NVME, 0x82, ctypes.sizeof(NvmeUringCmd))

# --- block device ioctls (linux/fs.h) ----------------------------------------------------------
BLKSSZGET: Final = io(0x12, 104)
BLKDISCARD: Final = io(0x12, 119)
BLKGETSIZE64: Final = ior(0x12, 114, ctypes.sizeof(ctypes.c_size_t))

# --- cachestat(2) (linux/mman.h) ---------------------------------------------------------------
#: ``__NR_cachestat``: the same number on every architecture Linux added it to (6.5)
NR_CACHESTAT: Final = 451


class CachestatRange(ctypes.Structure):
    """``struct cachestat_range``: the bytes asked about (rounded out to whole pages)."""

    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class Cachestat(ctypes.Structure):
    """``struct cachestat``: the range's pages in the page cache, and their states."""

    _fields_ = (
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    )
