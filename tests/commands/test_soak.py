"""``dualblade soak`` for a few seconds: passes when all is well, fails when it is not.

The failing cases break the library on purpose (an engine that swallows chunk errors, a read
that returns a wrong byte, a context that leaks its extent) and the soak must notice each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dualblade.cli import main
from dualblade.io_engine._request import IORequest


def _soak(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, Any]:
    code = main(
        [
            "soak",
            "--seconds",
            "2",
            "--contexts",
            "6",
            "--fault-rate",
            "0.1",
            "--dir",
            str(tmp_path),
            "--json",
            *extra,
        ]
    )
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("compat", ["off", "on"])
def test_short_soak_passes_on_both_engines(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    compat: str,
) -> None:
    monkeypatch.setenv("DUALBLADE_COMPAT", compat)
    code, report = _soak(tmp_path, capsys, "--seed", "3")
    assert code == 0, report
    assert report["ok"] is True
    assert report["mismatches"] == 0
    assert report["bytes_verified"] > 0
    faults = report["faults"]
    assert faults["accounted"] is True
    assert faults["injected_hard"] > 0
    # Every hard fault reached an operation: as its error, folded into it, or cancelled with it.
    surfaced = sum(faults["surfaced"].values())
    assert surfaced == report["errors_by_type"].get("InjectedIOError", 0)
    assert (
        surfaced
        + sum(faults["coalesced_into_one_error"].values())
        + sum(faults["during_cancellation"].values())
        == faults["injected_hard"]
    )
    assert not faults["swallowed"]
    for kind, row in faults["by_type"].items():
        if kind in ("eio", "enospc"):
            assert (
                row["injected"] == row["surfaced"] + row["coalesced"] + row["during_cancellation"]
            )
        else:
            assert row["injected"] == row["absorbed"]  # short and slow never surface
    assert set(report["errors_by_type"]) <= {"InjectedIOError"}
    assert report["cancellations"] > 0
    assert set(faults["attributed_by_path"]) == {"direct", "page-cache"}  # dual: both paths
    assert report["leaks"]["fds"] == []
    assert report["leaks"]["threads"] == []
    assert report["leaks"]["extents_held"] == 0
    assert len(report["memory"]["windows"]) == 2
    assert list(tmp_path.iterdir()) == []  # the scratch folder is gone


def test_soak_fails_when_the_engine_swallows_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def swallow(self: IORequest, error: BaseException) -> None:
        self._end_chunk()
        self._maybe_finish()

    monkeypatch.setattr(IORequest, "chunk_failed", swallow)
    code, report = _soak(tmp_path, capsys, "--cancel-rate", "0")
    assert code == 1
    assert report["ok"] is False
    assert report["faults"]["accounted"] is False
    assert report["faults"]["swallowed"]


def test_soak_fails_on_a_wrong_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dualblade.store import KVContext

    read = KVContext.read

    async def corrupt(
        self: KVContext, layer: int, rows: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = await read(self, layer, rows)
        if self.id % 3 == 0:
            k.view(torch.int16)[0, 0, 0] ^= 1
        return k, v

    monkeypatch.setattr(KVContext, "read", corrupt)
    code, report = _soak(tmp_path, capsys, "--fault-rate", "0")
    assert code == 1
    assert report["mismatches"] > 0
    assert report["mismatch_examples"]


def test_soak_fails_on_a_leaked_extent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dualblade.store import KVContext

    async def forget(self: KVContext) -> None:
        self._closed = True  # never tells the binder

    monkeypatch.setattr(KVContext, "close", forget)
    code, report = _soak(tmp_path, capsys, "--fault-rate", "0")
    assert code == 1
    assert report["leaks"]["extents_held"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--contexts", "0"], "--contexts"),
        (["--fault-rate", "2"], "--fault-rate"),
        (["--seconds", "0"], "positive duration"),
        (["--max-rss-growth", "0"], "--max-rss-growth"),
    ],
)
def test_soak_refuses_bad_arguments(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["soak", *args]) == 2
    assert message in capsys.readouterr().err
