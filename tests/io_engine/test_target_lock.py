"""A direct target can be claimed by one store at a time."""

from __future__ import annotations

import os

import pytest

from dualblade.io_engine import DirectFile, TargetError


def test_second_claim_is_refused_until_the_first_closes(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "direct.kv")
    first = DirectFile(path, 1 << 20)
    first.lock_exclusive()
    second = DirectFile(path, 1 << 20)
    with pytest.raises(TargetError, match="in use by another dualblade store"):
        second.lock_exclusive()
    first.close()
    second.lock_exclusive()  # released with the first's file descriptor
    second.close()
