"""``dualblade soak`` for a few seconds: passes when all is well, fails when it is not.

The failing cases break the library on purpose (an engine that swallows chunk errors, a read
that returns a wrong byte, a context that leaks its extent) and the soak must notice each.
"""

from __future__ import annotations

import json
import os
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
        (["--restart-after", "2", "1"], "--restart-after"),
        (["--pressure", "--fault-rate", "0.1"], "--fault-rate 0"),
    ],
)
def test_soak_refuses_bad_arguments(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["soak", *args]) == 2
    assert message in capsys.readouterr().err


def test_kill_restart_soak_reclaims_what_each_killed_store_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _soak(
        tmp_path,
        capsys,
        "--kill-restart",
        "--restart-after",
        "0.5",
        "1.5",
        "--seconds",
        "8",
        "--contexts",
        "4",
    )
    assert code == 0, report
    assert report["mode"] == "kill-restart"
    assert report["restarts"] >= 1
    assert report["mismatches"] == 0
    assert report["bytes_verified"] > 0
    assert report["faults"]["accounted"] is True
    assert report["problems"] == []
    children = report["children_detail"]
    assert [c["exit_code"] for c in children[:-1]] == [-9] * (len(children) - 1)
    assert children[-1]["exit_code"] == 0
    for child in children[1:]:  # each store reclaimed exactly what the killed one left
        left, got = child["left_before"], child["reclaimed"]
        assert (got["store_folders"], got["files"], got["direct_bytes"]) == (
            left["folders"],
            left["files"],
            left["direct_bytes"],
        )
    assert report["reclaim"]["reclaimed_bytes"] > 0
    assert report["reclaim"]["left_after_last_store"] == {
        "folders": 0,
        "files": 0,
        "direct_bytes": 0,
    }
    assert list(tmp_path.iterdir()) == []


def test_a_restart_that_misses_a_leftover_fails_the_soak() -> None:
    from dualblade.bench.soak_options import SoakOptions
    from dualblade.bench.soak_restart import ChildRun, Leftovers, restart_document

    left = Leftovers(folders=1, files=4, direct_bytes=8192)
    reclaimed = {
        "store_folders": 1,
        "files": 4,
        "file_bytes": 0,
        "direct_extents": 1,
        "direct_bytes": 4096,  # half of what was left
        "bytes": 4096,
        "seconds": 0.001,
    }
    runs = [ChildRun(0, Leftovers(0, 0, 0), killed_after_s=1.0), ChildRun(1, left)]
    runs[1].reclaimed = reclaimed
    runs[1].check_reclaim()
    report = restart_document(SoakOptions(seconds=1, contexts=1), runs, Leftovers(0, 0, 0), 1.0)
    assert report["ok"] is False
    assert "reclaimed" in report["problems"][0]


@pytest.mark.root
def test_full_disk_soak_meets_enospc_and_serves_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("--full-disk mounts a tmpfs: needs root")
    code, report = _soak(tmp_path, capsys, "--full-disk", "--seconds", "4")
    assert code == 0, report
    full = report["full_disk"]
    assert full["enabled"] is True
    assert full["ok"] is True
    met = set(full["no_room_errors"])
    assert any(key.endswith(":write") for key in met), met  # a write into a punched run
    assert any(key.startswith("claim:") or key.endswith(":allocate") for key in met), met
    assert report["mismatches"] == 0
    assert report["leaks"]["extents_held"] == 0
    assert report["leaks"]["files_held"] == 0
    assert list(tmp_path.iterdir()) == []  # the tmpfs was unmounted and its folder removed


def test_full_disk_needs_root(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["soak", "--full-disk", "--seconds", "1"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_pressure_soak_moves_layers_and_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The budget shrinks and grows under decoding contexts: layers are demoted and promoted,
    every byte read is checked, nothing is left held, and the ledger fits after each squeeze."""
    code = main(
        [
            "soak",
            "--seconds",
            "5",
            "--contexts",
            "6",
            "--pressure",
            "--seed",
            "4",
            "--dir",
            str(tmp_path),
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    why = {key: report.get(key) for key in ("errors_by_type", "faults", "leaks", "pressure")}
    assert code == 0, json.dumps(why)  # a string: pytest shortens a dict's repr to its head
    assert report["mismatches"] == 0
    assert report["fault_rate"] == 0
    pressure = report["pressure"]
    assert pressure["ok"] is True
    assert pressure["budget_changes"] >= 2
    assert pressure["demotions"] + pressure["promotions"] > 0
    assert report["leaks"]["ledger_placed_bytes"] == 0
