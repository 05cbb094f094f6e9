"""A sweep stopped part way (Ctrl-C, a timeout's SIGTERM) keeps the runs it finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dualblade.bench import Sweep
from dualblade.bench.cgroups import CGROUP_ROOT, can_create_memory_cgroups
from dualblade.cli import main

from .test_bench_command import TINY

LIMITS = "400MiB,440MiB,480MiB"


def fake_runs(monkeypatch: pytest.MonkeyPatch, stop_at: int, stop: Callable[[], None]) -> list[int]:
    """Replace each run with a record made at once (no cgroup, no worker); the ``stop_at``-th
    run calls ``stop`` instead. Returns the indices of the runs started."""
    started: list[int] = []
    monkeypatch.setattr("dualblade.bench.can_create_memory_cgroups", lambda: None)

    def one(self: Sweep, index: int, repeat: int, limit: int, policy: str) -> dict[str, Any]:
        started.append(index)
        if index == stop_at:
            stop()
        return {"policy": policy, "limit_bytes": limit, "repeat": repeat, "error": f"fake {index}"}

    monkeypatch.setattr(Sweep, "_one", one)
    return started


def stopped_report(out: Path) -> dict[str, Any]:
    report = json.loads((out / "results.json").read_text())
    assert not list(out.glob(".*.partial"))  # each file was replaced whole
    return dict(report)


def args(tmp_path: Path) -> list[str]:
    return [
        *("bench", "--memory-limits", LIMITS, "--policies", "dual", "--repeats", "1"),
        *("--out", str(tmp_path)),
    ]


def test_ctrl_c_leaves_the_finished_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupt() -> None:
        raise KeyboardInterrupt

    started = fake_runs(monkeypatch, 2, interrupt)
    assert main([*args(tmp_path), "--work-dir", str(tmp_path / "work")]) == 130
    assert started == [0, 1, 2]
    report = stopped_report(tmp_path)
    assert report["complete"] is False
    assert report["stopped"] == "interrupted (SIGINT) after 2 of 3 runs"
    assert [run["error"] for run in report["runs"]] == ["fake 0", "fake 1"]
    assert (report["meta"]["runs_done"], report["meta"]["runs_planned"]) == (2, 3)
    assert {r["limit_bytes"] for r in report["results"]} == {400 << 20, 440 << 20}
    assert (
        "**Stopped** (interrupted (SIGINT) after 2 of 3 runs)"
        in (tmp_path / "results.md").read_text()
    )
    assert "holds the finished runs" in capsys.readouterr().err


def test_sigterm_leaves_the_finished_runs_and_restores_the_handler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    fake_runs(monkeypatch, 1, lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert main([*args(tmp_path), "--work-dir", str(tmp_path / "work")]) == 143
    report = stopped_report(tmp_path)
    assert report["stopped"] == "terminated (SIGTERM) after 1 of 3 runs"
    assert [run["error"] for run in report["runs"]] == ["fake 0"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_each_run_is_written_as_it_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bool, int]] = []

    def look() -> None:  # called at the start of the last run: two are on disk already
        report = stopped_report(tmp_path)
        seen.append((report["complete"], report["meta"]["runs_done"]))

    fake_runs(monkeypatch, 2, look)
    assert main([*args(tmp_path), "--work-dir", str(tmp_path / "work")]) == 0
    assert seen == [(False, 2)]
    report = stopped_report(tmp_path)
    assert (report["complete"], report["stopped"], report["meta"]["runs_done"]) == (True, None, 3)
    assert "In progress" not in (tmp_path / "results.md").read_text()


@pytest.mark.root
def test_a_real_sweep_killed_by_sigterm_cleans_up(tmp_path: Path) -> None:
    """What ``timeout 600 dualblade bench ...`` does: SIGTERM while a run's worker is running.
    The worker is killed, its cgroup and the sweep's files removed, and the runs that finished
    are in results.json."""
    reason = can_create_memory_cgroups()
    if reason is not None:
        pytest.skip(reason)
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(dir=tmp_path / "store"))
    out, work = tmp_path / "out", tmp_path / "work"
    command = [sys.executable, "-m", "dualblade", "bench", str(config), "--memory-limits"]
    command += [LIMITS, "--policies", "dual", "--work-dir", str(work), "--out", str(out)]
    sweep = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "results.json").exists():  # the first run has ended
            assert sweep.poll() is None, sweep.stderr.read() if sweep.stderr else ""
            assert time.monotonic() < deadline, "the first run did not end in 240 s"
            time.sleep(0.05)
        sweep.send_signal(signal.SIGTERM)
        _, err = sweep.communicate(timeout=60)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 143, err
    report = stopped_report(out)
    assert report["complete"] is False
    assert 1 <= report["meta"]["runs_done"] < 3
    for run in report["runs"]:
        assert "error" not in run, run["error"]
        assert run["decode_s"] > 0
    # nothing of the stopped run is left: its group, its worker (which was in the group), the
    # sweep's files
    groups = [p.name for p in CGROUP_ROOT.rglob(f"dualblade-run-{sweep.pid}-*")]
    assert groups == []
    assert not (work / "direct.kv").exists()
    assert not (work / "page-cache").exists()
