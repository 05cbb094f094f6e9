"""The adapter on a raw block device (a loop device, as root): objects on consecutive blocks,
read back whole, and trimmed (discarded) when deleted."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Driver, MakeAdapter, digest, empty_obj, key, random_obj

OBJ = 64 << 10


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[str]:
    """A 32 MiB loop device over a sparse file (512-byte blocks), detached afterwards."""
    if os.geteuid() != 0:
        pytest.skip("loop devices need root")
    if shutil.which("losetup") is None:
        pytest.skip("losetup (util-linux) is not installed")
    backing = tmp_path / "loop.img"
    with open(backing, "wb") as f:
        f.truncate(32 << 20)
    try:
        device = subprocess.run(
            ["losetup", "--find", "--show", str(backing)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except subprocess.CalledProcessError as error:
        pytest.skip(f"cannot attach a loop device here: {error.stderr.strip()}")
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


@pytest.mark.root
def test_objects_on_a_loop_device(make_adapter: MakeAdapter, loop_device: str) -> None:
    adapter = make_adapter(
        "direct",
        object_size=OBJ,
        capacity="16MiB",
        storage={
            "direct": {
                "kind": "block",
                "path": loop_device,
                "lba_size": 512,
                "extent_size": "16MiB",
                "first_lba": 8192,  # the first 4 MiB are not ours
            }
        },
    )
    drive = Driver(adapter)
    keys = [key(i) for i in range(8)]
    objects = [random_obj(OBJ - 1000 * i, seed=i) for i in range(8)]
    assert drive.store(keys, objects).is_successful()
    spans = []
    for k in keys:
        where = adapter.placement(k)
        assert where is not None
        assert where.direct_bytes is not None
        spans.append(where.direct_bytes)
    assert all(start >= 4 << 20 for start, _ in spans)  # nothing below first_lba
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # disjoint

    targets = [empty_obj(o.get_size()) for o in objects]
    assert drive.load(keys, targets) == [True] * 8
    assert [digest(t) for t in targets] == [digest(o) for o in objects]

    start, end = spans[0]
    with open(loop_device, "rb") as device:
        device.seek(start)
        assert any(device.read(end - start))  # our bytes are on the device
    adapter.delete(keys)
    assert adapter.stats().store["trimmed_blocks"] >= 8 * OBJ // 512 - 8  # discarded
    with open(loop_device, "rb") as device:
        device.seek(start)
        assert not any(device.read(end - start))  # a loop device reads discarded blocks as 0
