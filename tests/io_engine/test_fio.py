"""The fio reference: run with the memory our own reads use, and parsed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualblade.io_engine import fio_path, run_fio
from dualblade.io_engine.fio import HUGE_PAGE_MALLOC, fio_environment


def test_fio_gets_the_huge_page_tunable_beside_the_callers_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert fio_environment()["GLIBC_TUNABLES"] == HUGE_PAGE_MALLOC
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    monkeypatch.setenv("SOMETHING_ELSE", "kept")
    env = fio_environment()
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGE_PAGE_MALLOC}"
    assert env["SOMETHING_ELSE"] == "kept"


@pytest.mark.skipif(fio_path() is None, reason="fio is not installed (apt-get install fio)")
def test_fio_reads_a_file_with_the_references_options(tmp_path: Path) -> None:
    data = tmp_path / "ref.dat"
    data.write_bytes(bytes(8 << 20))
    result = run_fio(str(data), "read", 8 << 20, 1 << 20, 4, io_size=16 << 20)
    assert result.total_ios == 16
    assert result.bytes_per_s > 0
