"""Fixtures for io_engine tests: engines on both backends, data files in tmp dirs."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import pytest

from dualblade.io_engine import AlignedBuffer, DirectFile, IOEngine


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(params=["io_uring", "threadpool"])
def engine(request: pytest.FixtureRequest) -> Iterator[IOEngine]:
    """An engine on each backend (QD 8, 64 KiB chunks, so requests split)."""
    compat = "off" if request.param == "io_uring" else "on"
    with IOEngine(queue_depth=8, compat=compat, max_chunk=64 << 10) as eng:
        assert eng.kind == request.param
        yield eng


@pytest.fixture
def direct_file(tmp_path: os.PathLike[str]) -> Iterator[DirectFile]:
    """A 16 MiB preallocated O_DIRECT file."""
    with DirectFile(os.path.join(tmp_path, "direct.dat"), 16 << 20) as target:
        yield target


@pytest.fixture
def buffer() -> Iterator[AlignedBuffer]:
    with AlignedBuffer(4 << 20) as buf:
        yield buf
