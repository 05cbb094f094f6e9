"""KV files and the folders made for them are the owner's alone."""

from __future__ import annotations

import stat
from pathlib import Path

from dualblade.io_engine import DirectFile, PageCacheFile


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_new_folders_and_files_are_owner_only(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)  # the user's own folder: left as it is
    with PageCacheFile(tmp_path / "store" / "context-1" / "L0.K", 4096) as file:
        assert mode(tmp_path / "store") == 0o700
        assert mode(tmp_path / "store" / "context-1") == 0o700
        assert mode(Path(file.name)) == 0o600
    with DirectFile(tmp_path / "cache" / "direct.kv", 8192):
        assert mode(tmp_path / "cache") == 0o700
        assert mode(tmp_path / "cache" / "direct.kv") == 0o600
    assert mode(tmp_path) == 0o755
