"""NVMe command encoding and identify parsing (pure functions, no I/O).

I/O commands follow the NVM Command Set: READ (0x02) and WRITE (0x01) carry the starting LBA in
CDW10/11 and the zero-based block count in CDW12 bits 15:0; Dataset Management (0x09) carries the
zero-based range count in CDW10, the Deallocate attribute (bit 2) in CDW11 and a data buffer of
16-byte ranges. A passthrough completion's ``res`` is ``-errno`` for kernel errors and the NVMe
status field (SCT/SC/DNR) when positive.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Final

from dualblade.io_engine import _uapi

NVME_CMD_WRITE: Final = 0x01
NVME_CMD_READ: Final = 0x02
NVME_CMD_DSM: Final = 0x09
NVME_ADMIN_IDENTIFY: Final = 0x06
IDENTIFY_CNS_NAMESPACE: Final = 0x00
IDENTIFY_CNS_CONTROLLER: Final = 0x01
DSM_ATTRIBUTE_DEALLOCATE: Final = 1 << 2
#: NLB is a 16-bit zero-based field: one command moves at most 65536 blocks.
MAX_BLOCKS_PER_COMMAND: Final = 1 << 16
#: A DSM command carries at most 256 ranges, each at most 2^32 - 1 blocks long.
MAX_DSM_RANGES: Final = 256
MAX_DSM_RANGE_BLOCKS: Final = (1 << 32) - 1


def io_command(
    opcode: int, nsid: int, slba: int, nlb: int, addr: int, data_len: int
) -> _uapi.NvmeUringCmd:
    """A READ or WRITE of ``nlb`` blocks at ``slba`` to or from ``addr``.

    Raises:
        ValueError: ``nlb`` outside 1..65536 or a negative LBA.
    """
    if not 1 <= nlb <= MAX_BLOCKS_PER_COMMAND:
        raise ValueError(f"an NVMe I/O command moves 1..65536 blocks, got {nlb}")
    if slba < 0:
        raise ValueError(f"negative starting LBA {slba}")
    cmd = _uapi.NvmeUringCmd()
    cmd.opcode = opcode
    cmd.nsid = nsid
    cmd.addr = addr
    cmd.data_len = data_len
    cmd.cdw10 = slba & 0xFFFFFFFF
    cmd.cdw11 = slba >> 32
    cmd.cdw12 = nlb - 1
    return cmd


def dsm_ranges(ranges: list[tuple[int, int]]) -> ctypes.Array[_uapi.NvmeDsmRange]:
    """The DSM data buffer for ``(slba, nlb)`` ranges.

    Raises:
        ValueError: no ranges, more than 256, or a range over 2^32 - 1 blocks.
    """
    if not 1 <= len(ranges) <= MAX_DSM_RANGES:
        raise ValueError(f"a DSM command carries 1..256 ranges, got {len(ranges)}")
    array = (_uapi.NvmeDsmRange * len(ranges))()
    for entry, (slba, nlb) in zip(array, ranges, strict=True):
        if not 1 <= nlb <= MAX_DSM_RANGE_BLOCKS:
            raise ValueError(f"a DSM range holds 1..2^32-1 blocks, got {nlb}")
        entry.cattr = 0
        entry.nlb = nlb
        entry.slba = slba
    return array


def split_dsm(slba: int, nlb: int) -> list[tuple[int, int]]:
    """Split a deallocation into ranges no longer than a DSM range allows."""
    out: list[tuple[int, int]] = []
    while nlb > 0:
        take = min(nlb, MAX_DSM_RANGE_BLOCKS)
        out.append((slba, take))
        slba += take
        nlb -= take
    return out


def dsm_command(nsid: int, ranges_addr: int, n_ranges: int) -> _uapi.NvmeUringCmd:
    """A Dataset Management / Deallocate of the ranges stored at ``ranges_addr``."""
    cmd = _uapi.NvmeUringCmd()
    cmd.opcode = NVME_CMD_DSM
    cmd.nsid = nsid
    cmd.addr = ranges_addr
    cmd.data_len = n_ranges * ctypes.sizeof(_uapi.NvmeDsmRange)
    cmd.cdw10 = n_ranges - 1
    cmd.cdw11 = DSM_ATTRIBUTE_DEALLOCATE
    return cmd


def identify_command(cns: int, nsid: int, addr: int) -> _uapi.NvmePassthruCmd:
    """An Identify admin command returning 4096 bytes at ``addr``."""
    cmd = _uapi.NvmePassthruCmd()
    cmd.opcode = NVME_ADMIN_IDENTIFY
    cmd.nsid = nsid
    cmd.addr = addr
    cmd.data_len = 4096
    cmd.cdw10 = cns
    return cmd


@dataclass(frozen=True)
class ControllerInfo:
    """What Identify Controller says that the I/O path needs."""

    model: str
    mdts: int  # 0: no limit; else max transfer = 2^mdts * minimum memory page size
    oncs: int  # optional NVM commands; bit 2: Dataset Management

    @property
    def supports_dsm(self) -> bool:
        return bool(self.oncs & (1 << 2))

    def max_transfer_bytes(self, page_size: int = 4096) -> int | None:
        """MDTS in bytes, or None when the controller sets no limit."""
        return None if self.mdts == 0 else (1 << self.mdts) * page_size


@dataclass(frozen=True)
class NamespaceInfo:
    """What Identify Namespace says: size and the LBA format in use."""

    nsze: int  # size in logical blocks
    lba_size: int
    metadata_size: int


def parse_identify_controller(data: bytes) -> ControllerInfo:
    """Parse the 4096-byte Identify Controller structure."""
    model = data[24:64].decode("ascii", "replace").strip()
    mdts = data[77]
    (oncs,) = struct.unpack_from("<H", data, 520)
    return ControllerInfo(model=model, mdts=mdts, oncs=oncs)


def parse_identify_namespace(data: bytes) -> NamespaceInfo:
    """Parse the 4096-byte Identify Namespace structure (FLBAS selects one LBA format)."""
    (nsze,) = struct.unpack_from("<Q", data, 0)
    nlbaf = data[25] + 1
    flbas = data[26]
    index = (flbas & 0x0F) | (((flbas >> 5) & 0x03) << 4 if nlbaf > 16 else 0)
    ms, lbads, _rp = struct.unpack_from("<HBB", data, 128 + 4 * index)
    return NamespaceInfo(nsze=nsze, lba_size=1 << lbads, metadata_size=ms)


_GENERIC_STATUS: Final[dict[int, str]] = {
    0x01: "invalid command opcode",
    0x02: "invalid field in command",
    0x04: "data transfer error",
    0x06: "internal error",
    0x0B: "invalid namespace or format",
    0x80: "LBA out of range",
    0x81: "capacity exceeded",
    0x82: "namespace not ready",
}


def describe_status(status: int) -> str:
    """A readable NVMe status: type, code, and the do-not-retry bit."""
    sc = status & 0xFF
    sct = (status >> 8) & 0x7
    text = (
        _GENERIC_STATUS.get(sc, f"status code 0x{sc:02x}")
        if sct == 0
        else (f"status code type {sct}, code 0x{sc:02x}")
    )
    if status & (1 << 14):
        text += ", do not retry"
    return text
