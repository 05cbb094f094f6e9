"""kill -9 of a store mid-decode, then a fresh store on the same target and folder: it reclaims
everything the dead one left before it serves, and a new context reads back only what it wrote.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from dualblade.store import open_store

from ._crash_child import PATTERN
from .conftest import MakeConfig, random_kv

CHILD = Path(__file__).with_name("_crash_child.py")


def _has_pattern_run(tensor: torch.Tensor, run: int = 64) -> bool:
    """Whether the tensor's whole storage (not just its view) holds ``run`` consecutive 16-bit
    words of the dead store's pattern."""
    storage = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    words = storage[: storage.numel() // 2 * 2].view(torch.int16)
    hits = (words == PATTERN).to(torch.int8)
    return hits.numel() >= run and bool(hits.unfold(0, run, 1).all(dim=1).any())


def _data_ranges(path: Path) -> list[tuple[int, int]]:
    """``(start, end)`` of the parts of a file that hold data (SEEK_DATA / SEEK_HOLE)."""
    out = []
    with open(path, "rb") as file:
        fd, position, size = file.fileno(), 0, os.fstat(file.fileno()).st_size
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError:
                break
            position = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, position))
    return out


def _kill_mid_decode(config_json: Path, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(config_json), str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if child.poll() is not None:
                pytest.fail(f"the child store died first: {child.communicate()[1].decode()}")
            if time.monotonic() > deadline:
                pytest.fail("the child store did not start decoding in 120 s")
            time.sleep(0.05)
        time.sleep(0.2)  # well into decode
        assert child.poll() is None, "the child stopped decoding by itself"
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    assert child.returncode == -signal.SIGKILL


@pytest.mark.anyio
async def test_a_store_killed_mid_decode_is_reclaimed_by_the_next(
    tmp_path: Path, make_config: MakeConfig
) -> None:
    config = make_config("dual", "aligned", prompt_len=16, max_new_tokens=48)
    config_json = tmp_path / "config.json"
    config_json.write_text(config.model_dump_json())
    _kill_mid_decode(config_json, tmp_path)

    pc, direct = tmp_path / "pc", tmp_path / "direct.kv"
    [dead] = [p for p in pc.iterdir() if p.name.startswith("store-")]
    left_files = [p for p in dead.rglob("*") if p.is_file() and p.name != "owner.lock"]
    assert left_files, "the dead store left no page-cache files: nothing to test"
    left_direct = sum(end - start for start, end in _data_ranges(direct))
    assert left_direct > 0, "the dead store left no direct bytes: nothing to test"

    with capture_logs() as logs:
        async with open_store(config, device="cpu") as store:
            reclaimed = store.runtime.reclaimed
            # Everything it left, gone before the first context: files, folder, direct bytes.
            assert not dead.exists()
            assert reclaimed.store_folders == 1
            assert reclaimed.files == len(left_files)
            assert reclaimed.direct_bytes == left_direct
            assert reclaimed.direct_exact
            assert _data_ranges(direct) == []
            async with store.context() as ctx:
                rows = 5  # fewer than the dead store wrote
                mine = {layer: random_kv(config, rows, seed=layer) for layer in range(4)}
                for layer, (k, v) in mine.items():
                    await ctx.write(layer, k, v)
                buffers = ctx.read_buffers()
                for layer, (k, v) in mine.items():
                    for out in (None, buffers):
                        got_k, got_v = await ctx.read(layer, out=out)
                        assert torch.equal(got_k, k)
                        assert torch.equal(got_v, v)
                        assert not _has_pattern_run(got_k)
                        assert not _has_pattern_run(got_v)
                    got_k, _ = await ctx.read(layer, (2, 4))
                    assert torch.equal(got_k, k[2:4])
                    assert not _has_pattern_run(got_k)
                del got_k, got_v  # views of the buffers
                buffers.close()
    [event] = [e for e in logs if e["event"] == "reclaimed what dead stores left"]
    assert event["files"] == len(left_files)
    assert event["direct_bytes"] == left_direct
    assert event["owner_pids"] != [os.getpid()]
    assert list(pc.iterdir()) == []
