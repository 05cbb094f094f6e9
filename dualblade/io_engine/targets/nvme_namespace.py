"""An NVMe namespace through its generic char device (``/dev/ngXnY``) and io_uring passthrough.

Every transfer is a native NVMe command in a 128-byte SQE (``IORING_OP_URING_CMD`` with
``NVME_URING_CMD_IO``): READ 0x02 / WRITE 0x01 on LBAs, and Dataset Management 0x09 with the
Deallocate attribute as TRIM. The kernel does not split passthrough commands, so the largest
command is ``min(MDTS, max_hw_sectors_kb, max_segments × page size, 65536 blocks)``: a command
from ordinary 4 KiB pages may span at most ``max_segments`` of them.

Buffers need only LBA alignment (NVMe data pointers need a dword; the store's padded rows start
on LBA, not page, boundaries). With LBAs smaller than a page a chunk may start inside a page and
touch one page more than its length says, so the segment cap is one page lower there.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import stat
from pathlib import Path

from dualblade.io_engine import _sysfs, _uapi, nvme, opcodes
from dualblade.io_engine.buffers import PAGE_SIZE, AlignedBuffer
from dualblade.io_engine.errors import IOFailedError, TargetError
from dualblade.io_engine.targets.base import Target

_NG_NAME = re.compile(r"ng(\d+)n(\d+)$")


class NvmeNamespace(Target):
    """A namespace addressed in LBAs with native NVMe commands.

    Args:
        path: ``/dev/ngXnY``.
        max_transfer: cap on one command in bytes (default: what the controller and queue allow).

    Raises:
        TargetError: not an NVMe generic char device, no permission, or identify failed.
    """

    passthrough = True
    threadpool_capable = False

    def __init__(self, path: str, *, max_transfer: int | None = None) -> None:
        self.name = path
        try:
            mode = os.stat(path).st_mode
        except OSError as error:
            raise TargetError(f"cannot use {path}: {error.strerror}") from error
        if not stat.S_ISCHR(mode) or not _NG_NAME.search(path):
            raise TargetError(
                f"{path} is not an NVMe generic char device (/dev/ngXnY); for a block device "
                "use kind 'block'"
            )
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except PermissionError as error:
            raise TargetError(f"cannot open {path}: permission denied (needs root)") from error
        try:
            self.nsid = fcntl.ioctl(self.fd, _uapi.NVME_IOCTL_ID)
            self.controller = nvme.parse_identify_controller(
                self._identify(nvme.IDENTIFY_CNS_CONTROLLER, 0)
            )
            self.namespace = nvme.parse_identify_namespace(
                self._identify(nvme.IDENTIFY_CNS_NAMESPACE, self.nsid)
            )
        except OSError as error:
            os.close(self.fd)
            raise TargetError(f"identify failed on {path}: {error.strerror}") from error
        self.lba_size = self.namespace.lba_size
        self.alignment = self.lba_size
        self.size = self.namespace.nsze * self.lba_size
        self.queue = self._queue_limits(path)
        self.max_transfer = max_transfer or self._default_max_transfer()
        self.max_trim = nvme.MAX_DSM_RANGES * nvme.MAX_DSM_RANGE_BLOCKS * self.lba_size

    def _identify(self, cns: int, nsid: int) -> bytes:
        with AlignedBuffer(4096, huge=False) as data:
            cmd = nvme.identify_command(cns, nsid, data.address)
            fcntl.ioctl(self.fd, _uapi.NVME_IOCTL_ADMIN_CMD, cmd)
            return bytes(data.view)

    @staticmethod
    def _queue_limits(path: str) -> dict[str, int]:
        match = _NG_NAME.search(path)
        assert match is not None
        block = f"/sys/block/nvme{match.group(1)}n{match.group(2)}"
        limits: dict[str, int] = {}
        for name in ("max_hw_sectors_kb", "max_segments"):
            value = _sysfs.read_int(Path(block) / "queue" / name)
            if value is not None:
                limits[name] = value
        return limits

    def _default_max_transfer(self) -> int:
        caps = [nvme.MAX_BLOCKS_PER_COMMAND * self.lba_size]
        mdts = self.controller.max_transfer_bytes()
        if mdts:
            caps.append(mdts)
        if "max_hw_sectors_kb" in self.queue:
            caps.append(self.queue["max_hw_sectors_kb"] * 1024)
        if "max_segments" in self.queue:
            # A chunk that starts inside a page spans one page more than its length.
            pages = self.queue["max_segments"] - (self.alignment < PAGE_SIZE)
            caps.append(max(1, pages) * PAGE_SIZE)
        cap = min(caps)
        return max(self.lba_size, cap // self.lba_size * self.lba_size)

    # -- commands -----------------------------------------------------------------------------
    def io_op(
        self, write: bool, address: int, length: int, offset: int, buf_index: int | None
    ) -> opcodes.Op:
        blocks = length // self.lba_size
        if not 1 <= blocks <= nvme.MAX_BLOCKS_PER_COMMAND or offset < 0:
            raise ValueError(f"an NVMe I/O command moves 1..65536 blocks at LBA >= 0: {blocks}")
        return opcodes.NvmeIo(
            self.fd,
            nvme.NVME_CMD_WRITE if write else nvme.NVME_CMD_READ,
            self.nsid,
            offset // self.lba_size,
            blocks,
            address,
            length,
        )

    def trim_op(self, offset: int, length: int) -> opcodes.Op:
        ranges = nvme.dsm_ranges(nvme.split_dsm(offset // self.lba_size, length // self.lba_size))
        cmd = nvme.dsm_command(self.nsid, ctypes.addressof(ranges), len(ranges))
        return opcodes.UringCmd(self.fd, _uapi.NVME_URING_CMD_IO, bytes(cmd), keepalive=ranges)

    #: Status 0 is the whole chunk (:meth:`transferred`): the native chunk pump counts it.
    native_completion = True

    def transferred(self, op: str, res: int, length: int, offset: int, extra: int) -> int:
        if res < 0:
            detail = "transfer exceeds the controller's limit" if res == -errno.EINVAL else ""
            raise IOFailedError(self.name, op, offset, length, errno=-res, detail=detail)
        if res > 0:
            raise IOFailedError(
                self.name, op, offset, length, nvme_status=res, detail=nvme.describe_status(res)
            )
        return length

    def trim_blocking(self, offset: int, length: int) -> None:
        raise TargetError(f"{self.name}: deallocation goes through the ring (passthrough)")

    def describe(self) -> dict[str, object]:
        out = super().describe()
        out.update(
            nsid=self.nsid,
            model=self.controller.model,
            mdts=self.controller.mdts,
            mdts_bytes=self.controller.max_transfer_bytes(),
            dsm=self.controller.supports_dsm,
            **self.queue,
        )
        return out
