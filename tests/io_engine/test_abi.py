"""The ctypes layouts and ioctl numbers match the kernel UAPI, and liburing prototypes agree."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from dualblade.io_engine import _liburing, _uapi, nvme, opcodes


@pytest.mark.parametrize(
    ("struct", "size"),
    [
        (_uapi.IoUringSqe, 64),
        (_uapi.IoUringSqe128, 128),
        (_uapi.IoUringCqe, 16),
        (_uapi.IoUringCqe32, 32),
        (_uapi.IoUringParams, 120),
        (_uapi.NvmeUringCmd, 72),
        (_uapi.NvmePassthruCmd, 72),
        (_uapi.NvmeDsmRange, 16),
        (_uapi.Iovec, 16),
        (_uapi.CachestatRange, 16),
        (_uapi.Cachestat, 40),
    ],
)
def test_struct_sizes(struct: type[ctypes.Structure], size: int) -> None:
    assert ctypes.sizeof(struct) == size


@pytest.mark.parametrize(
    ("field", "offset"),
    [
        ("opcode", 0),
        ("flags", 1),
        ("fd", 4),
        ("off", 8),
        ("addr", 16),
        ("len", 24),
        ("rw_flags", 28),
        ("user_data", 32),
        ("buf_index", 40),
        ("file_index", 44),
        ("addr3", 48),
    ],
)
def test_sqe_offsets(field: str, offset: int) -> None:
    assert getattr(_uapi.IoUringSqe, field).offset == offset


@pytest.mark.parametrize(
    ("field", "offset"),
    [
        ("nsid", 4),
        ("metadata", 16),
        ("addr", 24),
        ("data_len", 36),
        ("cdw10", 40),
        ("cdw12", 48),
        ("cdw15", 60),
        ("timeout_ms", 64),
    ],
)
def test_nvme_uring_cmd_offsets(field: str, offset: int) -> None:
    assert getattr(_uapi.NvmeUringCmd, field).offset == offset


def test_cqe_and_params_offsets() -> None:
    assert _uapi.IoUringCqe.res.offset == 8
    assert _uapi.IoUringCqe32.big_cqe.offset == 16
    assert _uapi.IoUringParams.flags.offset == 8
    assert _uapi.IoUringParams.sq_off.offset == 40
    assert _uapi.IoUringParams.cq_off.offset == 80


def test_ioctl_numbers() -> None:
    assert _uapi.NVME_URING_CMD_IO == 0xC0484E80
    assert _uapi.NVME_URING_CMD_ADMIN == 0xC0484E82
    assert _uapi.NVME_IOCTL_ADMIN_CMD == 0xC0484E41
    assert _uapi.NVME_IOCTL_ID == 0x4E40
    assert _uapi.BLKDISCARD == 0x1277
    assert _uapi.BLKSSZGET == 0x1268
    assert _uapi.BLKGETSIZE64 == 0x80081272


def _built(op: opcodes.Op, user_data: int, size: int = 64) -> _uapi.IoUringSqe:
    lib = _liburing.load()
    raw = ctypes.create_string_buffer(b"\xff" * size, size)
    op.build(lib, ctypes.addressof(raw), user_data)
    return _uapi.IoUringSqe.from_buffer_copy(raw)


def test_liburing_prep_read_fills_the_fields_we_expect() -> None:
    sqe = _built(opcodes.Read(fd=7, addr=0x1000, length=8192, offset=1 << 33), user_data=99)
    assert (sqe.opcode, sqe.fd, sqe.addr, sqe.len, sqe.off, sqe.user_data) == (
        _uapi.IORING_OP_READ,
        7,
        0x1000,
        8192,
        1 << 33,
        99,
    )


def test_liburing_prep_write_fixed_sets_the_buffer_index() -> None:
    sqe = _built(opcodes.WriteFixed(fd=3, addr=0x2000, length=4096, offset=4096, buf_index=5), 7)
    assert (sqe.opcode, sqe.buf_index, sqe.len, sqe.off) == (
        _uapi.IORING_OP_WRITE_FIXED,
        5,
        4096,
        4096,
    )


def test_liburing_prep_fallocate_and_cancel() -> None:
    sqe = _built(opcodes.Fallocate(fd=4, mode=3, offset=8192, length=65536), 11)
    # io_uring_prep_fallocate puts the length in addr and the mode in len.
    assert (sqe.opcode, sqe.fd, sqe.off, sqe.addr, sqe.len) == (
        _uapi.IORING_OP_FALLOCATE,
        4,
        8192,
        65536,
        3,
    )
    cancel = _built(opcodes.AsyncCancel(target_user_data=1234), 0)
    assert (cancel.opcode, cancel.addr, cancel.user_data) == (_uapi.IORING_OP_ASYNC_CANCEL, 1234, 0)


def test_uring_cmd_places_cmd_op_and_payload() -> None:
    cmd = nvme.io_command(
        nvme.NVME_CMD_READ, nsid=1, slba=0x1_0000_0002, nlb=8, addr=0xABC000, data_len=4096
    )
    lib = _liburing.load()
    raw = ctypes.create_string_buffer(b"\xff" * 128, 128)
    opcodes.UringCmd(fd=9, cmd_op=_uapi.NVME_URING_CMD_IO, payload=bytes(cmd)).build(
        lib, ctypes.addressof(raw), 42
    )
    sqe = _uapi.IoUringSqe.from_buffer_copy(raw)
    assert sqe.opcode == _uapi.IORING_OP_URING_CMD
    assert sqe.fd == 9
    assert sqe.off & 0xFFFFFFFF == _uapi.NVME_URING_CMD_IO
    assert sqe.user_data == 42
    placed = _uapi.NvmeUringCmd.from_buffer_copy(raw.raw[48 : 48 + 72])
    assert (placed.opcode, placed.nsid, placed.cdw10, placed.cdw11, placed.cdw12) == (
        0x02,
        1,
        2,
        1,
        7,
    )
    assert raw.raw[48 + 72 :] == b"\0" * 8  # the rest of the command area is cleared


def test_library_reports_a_version() -> None:
    lib = _liburing.load()
    major, minor = (int(x) for x in lib.version.split("."))
    assert (major, minor) >= (2, 4)


def _built_fresh(op: opcodes.Op) -> _uapi.IoUringSqe:
    """Built into a zeroed SQE, as ``io_uring_get_sqe`` hands them out (liburing >= 2.5 clears
    flags there, not in the prep helpers)."""
    lib = _liburing.load()
    raw = ctypes.create_string_buffer(64)
    op.build(lib, ctypes.addressof(raw), 1)
    return _uapi.IoUringSqe.from_buffer_copy(raw)


def test_sqe_flags_are_set_only_when_asked(tmp_path: Path) -> None:
    plain = _built_fresh(opcodes.Read(fd=7, addr=0x1000, length=4096, offset=0))
    assert plain.flags == 0
    punted = _built_fresh(opcodes.Write(7, 0x1000, 4096, 0, flags=_uapi.IOSQE_ASYNC))
    assert punted.flags == _uapi.IOSQE_ASYNC
    fixed = _built_fresh(opcodes.ReadFixed(7, 0x1000, 4096, 0, 2, flags=_uapi.IOSQE_ASYNC))
    assert (fixed.flags, fixed.buf_index) == (_uapi.IOSQE_ASYNC, 2)
    # The page-cache path's copies run on io_uring's workers, not inline on the ring thread.
    from dualblade.io_engine import PageCacheFile

    file = PageCacheFile(tmp_path / "f", 4096)
    try:
        op = file.io_op(False, 0x1000, 4096, 0, None)
        assert _built_fresh(op).flags == _uapi.IOSQE_ASYNC
    finally:
        file.close()
