"""NVMe command encoding, identify parsing and status decoding, without a device."""

from __future__ import annotations

import ctypes
import itertools
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.io_engine import _uapi, nvme, opcodes
from dualblade.io_engine.errors import IOFailedError
from dualblade.io_engine.targets.nvme_namespace import NvmeNamespace


@given(slba=st.integers(0, (1 << 64) - 1), nlb=st.integers(1, 1 << 16))
def test_io_command_splits_slba_and_counts_zero_based(slba: int, nlb: int) -> None:
    cmd = nvme.io_command(nvme.NVME_CMD_WRITE, 3, slba, nlb, 0x1000, nlb * 512)
    assert cmd.opcode == 0x01
    assert cmd.nsid == 3
    assert cmd.cdw10 | (cmd.cdw11 << 32) == slba
    assert cmd.cdw12 == nlb - 1
    assert cmd.data_len == nlb * 512


@pytest.mark.parametrize("nlb", [0, (1 << 16) + 1])
def test_io_command_refuses_impossible_block_counts(nlb: int) -> None:
    with pytest.raises(ValueError, match=r"1\.\.65536"):
        nvme.io_command(nvme.NVME_CMD_READ, 1, 0, nlb, 0, 0)


def test_dsm_command_and_ranges_layout() -> None:
    ranges = nvme.dsm_ranges([(100, 8), (1 << 40, 1)])
    raw = bytes(ranges)
    assert raw == struct.pack("<IIQIIQ", 0, 8, 100, 0, 1, 1 << 40)
    cmd = nvme.dsm_command(1, ctypes.addressof(ranges), 2)
    assert (cmd.opcode, cmd.cdw10, cmd.cdw11, cmd.data_len) == (0x09, 1, 1 << 2, 32)


@given(slba=st.integers(0, 1 << 50), nlb=st.integers(1, 1 << 34))
def test_split_dsm_covers_the_range_exactly(slba: int, nlb: int) -> None:
    parts = nvme.split_dsm(slba, nlb)
    assert parts[0][0] == slba
    assert sum(n for _, n in parts) == nlb
    for (s1, n1), (s2, _) in itertools.pairwise(parts):
        assert s1 + n1 == s2
    assert all(1 <= n <= nvme.MAX_DSM_RANGE_BLOCKS for _, n in parts)


def _identify_namespace(nsze: int, lbads_by_index: list[int], flbas: int) -> bytes:
    data = bytearray(4096)
    struct.pack_into("<Q", data, 0, nsze)
    data[25] = len(lbads_by_index) - 1
    data[26] = flbas
    for i, lbads in enumerate(lbads_by_index):
        struct.pack_into("<HBB", data, 128 + 4 * i, 0, lbads, 0)
    return bytes(data)


def test_identify_namespace_uses_the_formatted_lba_format() -> None:
    info = nvme.parse_identify_namespace(_identify_namespace(1 << 21, [9, 12], flbas=1))
    assert (info.nsze, info.lba_size) == (1 << 21, 4096)
    info = nvme.parse_identify_namespace(_identify_namespace(1 << 21, [9, 12], flbas=0))
    assert info.lba_size == 512


def test_identify_namespace_high_format_index_bits() -> None:
    formats = [9] * 20
    formats[17] = 12
    flbas = (17 & 0x0F) | ((17 >> 4) << 5)
    assert nvme.parse_identify_namespace(_identify_namespace(8, formats, flbas)).lba_size == 4096


def test_identify_controller_fields() -> None:
    data = bytearray(4096)
    data[24:64] = b"QEMU NVMe Ctrl".ljust(40)
    data[77] = 7
    struct.pack_into("<H", data, 520, 0x15D)
    info = nvme.parse_identify_controller(bytes(data))
    assert info.model == "QEMU NVMe Ctrl"
    assert info.max_transfer_bytes() == 512 * 1024
    assert info.supports_dsm
    assert nvme.ControllerInfo("x", 0, 0).max_transfer_bytes() is None


def test_status_description() -> None:
    text = nvme.describe_status(0x4080)
    assert "LBA out of range" in text
    assert "do not retry" in text


def _fake_namespace(lba_size: int = 512) -> NvmeNamespace:
    """A namespace object without a device, to exercise its command building."""
    ns = object.__new__(NvmeNamespace)
    ns.name, ns.fd, ns.nsid, ns.lba_size = "/dev/ng9n1", 5, 1, lba_size
    ns.size, ns.max_transfer, ns.alignment = 1 << 30, 128 << 10, 4096
    return ns


def test_namespace_builds_lba_addressed_commands() -> None:
    ns = _fake_namespace(512)
    op = ns.io_op(True, 0x7000, 8192, 1 << 20, None)
    cmd = _uapi.NvmeUringCmd.from_buffer_copy(op.payload)  # type: ignore[attr-defined]
    assert (cmd.opcode, cmd.cdw10, cmd.cdw12, cmd.addr, cmd.data_len) == (
        0x01,
        (1 << 20) // 512,
        8192 // 512 - 1,
        0x7000,
        8192,
    )
    trim = ns.trim_op(4096, 1 << 20)
    dsm = _uapi.NvmeUringCmd.from_buffer_copy(trim.payload)  # type: ignore[attr-defined]
    assert dsm.opcode == 0x09
    ranges = trim.keepalive  # type: ignore[attr-defined]
    assert (ranges[0].slba, ranges[0].nlb) == (8, 2048)
    assert dsm.addr == ctypes.addressof(ranges)


def test_namespace_maps_completions_to_our_errors() -> None:
    ns = _fake_namespace()
    assert ns.transferred("read", 0, 4096, 0, 0) == 4096
    with pytest.raises(IOFailedError, match="NVMe status 0x4080: LBA out of range") as info:
        ns.transferred("read", 0x4080, 4096, 1 << 30, 0)
    assert info.value.nvme_status == 0x4080
    assert info.value.offset == 1 << 30
    with pytest.raises(IOFailedError, match="EINVAL") as info2:
        ns.transferred("write", -22, 1 << 20, 0, 0)
    assert info2.value.errno == 22


@given(
    slba=st.integers(0, (1 << 48) - 1),
    nlb=st.integers(1, 1 << 16),
    write=st.booleans(),
    user_data=st.integers(0, (1 << 64) - 1),
)
def test_packed_io_command_fills_the_same_sqe_as_the_ctypes_one(
    slba: int, nlb: int, write: bool, user_data: int
) -> None:
    """The ring's fast NVMe command and the ctypes reference write identical 128-byte SQEs."""
    opcode = nvme.NVME_CMD_WRITE if write else nvme.NVME_CMD_READ
    addr, data_len = 0x7F12_3456_7000, nlb * 512
    reference = opcodes.UringCmd(
        5, _uapi.NVME_URING_CMD_IO, bytes(nvme.io_command(opcode, 3, slba, nlb, addr, data_len))
    )
    packed = opcodes.NvmeIo(5, opcode, 3, slba, nlb, addr, data_len)
    want, got = (ctypes.c_char * 128)(), (ctypes.c_char * 128)()
    ctypes.memset(got, 0xAB, 128)  # the fast path must not leave stale bytes behind
    reference.build(None, ctypes.addressof(want), user_data)  # type: ignore[arg-type]
    packed.build(None, ctypes.addressof(got), user_data)  # type: ignore[arg-type]
    assert bytes(got) == bytes(want)
    assert packed.payload == reference.payload


def test_namespace_refuses_commands_it_cannot_encode() -> None:
    ns = _fake_namespace(512)
    with pytest.raises(ValueError, match=r"1\.\.65536"):
        ns.io_op(False, 0x7000, (1 << 16) * 512 + 512, 0, None)
