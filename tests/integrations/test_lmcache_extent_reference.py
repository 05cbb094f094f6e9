"""The reference adapter: before it closes, fio reads the direct extents its objects occupy (the
bytes LMCache's loads read), a failure is recorded without keeping anything held, and its own
param is checked at construction."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from dualblade.integrations.lmcache import (
    AdapterParamsError,
    DualBladeL2Adapter,
    ExtentReferenceAdapter,
    extent_reference,
)

from .conftest import Driver, key, random_obj

OBJECT = 64 << 10


def _params(tmp_path: Path, **own: Any) -> dict[str, Any]:
    return {
        "object_size": "64KiB",
        "capacity": "4MiB",
        "policy": "direct",
        "freeze_gc": False,
        "memory": {"page_cache_budget": "8MiB"},
        "storage": {
            "page_cache_dir": str(tmp_path / "pc"),
            "direct": {"path": str(tmp_path / "direct.kv")},
        },
        **own,
    }


def _store(adapter: DualBladeL2Adapter, count: int) -> list[Any]:
    keys = [key(i) for i in range(count)]
    objects = [random_obj(OBJECT, seed=i) for i in range(count)]
    assert Driver(adapter).store(keys, objects).is_successful()
    return keys


def test_the_direct_ranges_cover_every_direct_object_and_nothing_else(tmp_path: Path) -> None:
    # dual, with room in the page cache for about half of the capacity: both paths in use
    params = _params(tmp_path, policy="dual", memory={"page_cache_budget": "2MiB"})
    adapter = DualBladeL2Adapter(params)
    try:
        keys = _store(adapter, 16)
        placed = [adapter.placement(k) for k in keys]
        assert {p.medium for p in placed} == {"direct", "page-cache"}
        direct = [p.direct_bytes for p in placed if p.direct_bytes is not None]
        ranges = adapter.direct_ranges()
        assert sum(end - start for start, end in ranges) == sum(e - s for s, e in direct)
        for start, end in direct:
            assert any(s <= start and end <= e for s, e in ranges)
        assert ranges == sorted(ranges)
        assert all(a[1] < b[0] for a, b in itertools.pairwise(ranges))  # merged
    finally:
        adapter.close()


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_reads_the_held_extents_before_the_close_trims_them(tmp_path: Path) -> None:
    out = tmp_path / "reference.json"
    adapter = ExtentReferenceAdapter(_params(tmp_path, reference_out=str(out)))
    keys = _store(adapter, 6)
    ranges = adapter.direct_ranges()
    adapter.close()
    report = json.loads(out.read_text())
    assert report["target"] == str(tmp_path / "direct.kv")
    assert report["offset"] == ranges[0][0]
    assert report["offset"] + report["bytes"] == ranges[-1][1]
    assert report["object_bytes"] == sum(e - s for s, e in ranges) >= len(keys) * OBJECT
    assert len(report["passes_mbps"]) == extent_reference.PASSES
    assert all(mbps > 0 for mbps in report["passes_mbps"])
    assert report["mbps"] == report["passes_mbps"][0]
    assert adapter.stats().objects == 0  # and then every object was let go


def test_a_failed_reference_is_recorded_and_the_close_still_releases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    out = tmp_path / "reference.json"
    adapter = ExtentReferenceAdapter(_params(tmp_path, reference_out=str(out)))
    _store(adapter, 2)
    adapter.close()
    assert "fio is not installed" in json.loads(out.read_text())["error"]
    assert adapter.stats().objects == 0  # every object was let go


def test_a_report_that_cannot_be_written_still_lets_every_object_go(tmp_path: Path) -> None:
    adapter = ExtentReferenceAdapter(
        _params(tmp_path, reference_out=str(tmp_path / "no-such-folder" / "reference.json"))
    )
    _store(adapter, 2)
    with pytest.raises(FileNotFoundError):
        adapter.close()
    assert adapter.stats().objects == 0


def test_the_reference_needs_a_path(tmp_path: Path) -> None:
    with pytest.raises(AdapterParamsError, match=r"reference_out must be a path"):
        ExtentReferenceAdapter(_params(tmp_path))
