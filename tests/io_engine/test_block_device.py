"""BlockDevice on real loop devices (as root): round trips, discard, and device safety."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dualblade.io_engine import AlignedBuffer, BlockDevice, IOEngine, TargetError

needs_losetup = pytest.mark.skipif(
    shutil.which("losetup") is None, reason="losetup (util-linux) is not installed"
)


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[str]:
    """A 64 MiB loop device over a sparse file, detached afterwards."""
    if os.geteuid() != 0:
        pytest.skip("loop devices need root")
    if shutil.which("losetup") is None:
        pytest.skip("losetup (util-linux) is not installed")
    backing = tmp_path / "loop.img"
    with open(backing, "wb") as f:
        f.truncate(64 << 20)
    try:
        device = _run("losetup", "--find", "--show", "--partscan", str(backing))
    except subprocess.CalledProcessError as error:
        pytest.skip(f"cannot attach a loop device here: {error.stderr.strip()}")
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


@pytest.mark.root
@needs_losetup
@pytest.mark.parametrize("compat", ["off", "on"])
def test_round_trip_and_discard(loop_device: str, compat: str) -> None:
    payload = os.urandom(3 << 20)
    with (
        BlockDevice(loop_device) as device,
        IOEngine(queue_depth=8, compat=compat) as engine,
        AlignedBuffer(4 << 20) as buf,
    ):
        assert device.size == 64 << 20
        assert device.lba_size in (512, 4096)
        buf.view[: len(payload)] = payload
        engine.write(device, buf, len(payload), 8 << 20)
        buf.view[:] = bytes(buf.size)
        engine.read(device, buf, len(payload), 8 << 20)
        assert bytes(buf.view[: len(payload)]) == payload
        engine.trim_blocking(device, 8 << 20, 1 << 20)
        engine.read(device, buf, 2 << 20, 8 << 20)
        assert bytes(buf.view[: 1 << 20]) == bytes(1 << 20)
        assert bytes(buf.view[1 << 20 : 2 << 20]) == payload[1 << 20 : 2 << 20]
        with pytest.raises(TargetError, match="ends past"):
            engine.read(device, buf, 1 << 20, 64 << 20)


@pytest.mark.root
@needs_losetup
def test_second_open_is_refused_while_we_hold_it(loop_device: str) -> None:
    with BlockDevice(loop_device), pytest.raises(TargetError, match="busy"):
        BlockDevice(loop_device)


@pytest.mark.root
@needs_losetup
def test_refuses_a_mounted_file_system(loop_device: str, tmp_path: Path) -> None:
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 (e2fsprogs) is not installed")
    _run("mkfs.ext4", "-q", "-F", loop_device)
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    _run("mount", loop_device, str(mount_point))
    try:
        with pytest.raises(TargetError, match=f"mounted at {mount_point}"):
            BlockDevice(loop_device)
    finally:
        _run("umount", str(mount_point))
    BlockDevice(loop_device).close()  # unmounted: usable again


@pytest.mark.root
@needs_losetup
def test_refuses_a_disk_whose_partition_is_mounted(loop_device: str, tmp_path: Path) -> None:
    if shutil.which("sfdisk") is None or shutil.which("mkfs.ext4") is None:
        pytest.skip("sfdisk (fdisk) and mkfs.ext4 (e2fsprogs) are needed")
    subprocess.run(
        ["sfdisk", "-q", loop_device],
        input="2048,40960\n",
        text=True,
        check=True,
        capture_output=True,
    )
    partition = loop_device + "p1"
    if not os.path.exists(partition) and shutil.which("partx"):
        subprocess.run(["partx", "-a", loop_device], check=False, capture_output=True)
    if not os.path.exists(partition):
        pytest.skip("the kernel did not expose the loop device's partition")
    _run("mkfs.ext4", "-q", "-F", partition)
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    _run("mount", partition, str(mount_point))
    try:
        with pytest.raises(TargetError, match=r"partition loop\d+p1 .* mounted at"):
            BlockDevice(loop_device)
    finally:
        _run("umount", str(mount_point))


def test_refuses_what_is_not_a_block_device(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_bytes(b"")
    with pytest.raises(TargetError, match="not a block device"):
        BlockDevice(str(regular))
    with pytest.raises(TargetError, match="No such file"):
        BlockDevice(str(tmp_path / "missing"))


def _read_merges(device: str) -> int:
    """Reads the block layer merged into others on ``device`` (field 2 of its ``stat``)."""
    return int(Path(f"/sys/block/{Path(device).name}/stat").read_text().split()[1])


@pytest.mark.root
@needs_losetup
def test_adjacent_chunks_reach_the_device_unmerged(loop_device: str) -> None:
    # Submitted together, the block layer's plug merged adjacent chunks into larger requests,
    # which a virtio disk read more slowly than fio's requests of one chunk (ring.py's _fill).
    payload = os.urandom(16 << 20)
    with (
        BlockDevice(loop_device) as device,
        IOEngine(queue_depth=32, compat="off", max_chunk=256 << 10) as engine,
        AlignedBuffer(16 << 20) as buf,
    ):
        buf.view[:] = payload
        engine.write(device, buf, len(payload), 0)
        buf.view[:] = bytes(buf.size)
        before = _read_merges(loop_device)
        for _ in range(4):
            engine.read(device, buf, len(payload), 0)
        assert _read_merges(loop_device) == before
        assert bytes(buf.view) == payload
