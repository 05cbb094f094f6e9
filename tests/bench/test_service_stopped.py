"""The serving and pressure presets, stopped part way, keep the runs they finished; and the
pieces every bench stops with (``dualblade.bench.stops``)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dualblade.bench.stops import (
    Terminated,
    run_keeping,
    stop_of,
    terminate_raises,
    write_whole,
)
from dualblade.cli import main


def fake_service_runs(
    monkeypatch: pytest.MonkeyPatch, module: str, stop_at: int, stop: Callable[[], None]
) -> list[str]:
    """Each run of the preset in ``module`` (``serving`` or ``pressure``) made at once as a
    failed record (no cgroup, no worker); the ``stop_at``-th calls ``stop`` instead. Returns
    the names of the runs started."""
    started: list[str] = []
    monkeypatch.setattr("dualblade.bench.serving_command.can_create_memory_cgroups", lambda: None)
    monkeypatch.setattr(f"dualblade.bench.{module}.remove_stale_groups", lambda: [])

    def run_in_cgroup(
        worker: str, spec: dict[str, Any], limit: int, name: str, work_dir: Path
    ) -> dict[str, Any]:
        if len(started) == stop_at:
            stop()
        started.append(name)
        return {"limit_bytes": limit, "error": f"fake {name}", "oom_kills": 0}

    monkeypatch.setattr(f"dualblade.bench.{module}.run_in_cgroup", run_in_cgroup)
    return started


def report_in(out: Path) -> dict[str, Any]:
    assert not list(out.glob(".*.partial"))  # each file was replaced whole
    return dict(json.loads((out / "results.json").read_text()))


def serving_args(tmp_path: Path) -> list[str]:
    return [
        *("bench", "--preset", "serving", "--memory-limits", "640MiB,768MiB"),
        *("--policies", "dual,baseline", "--repeats", "1", "--requests", "2"),
        *("--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")),
    ]


def test_a_serving_run_stopped_by_sigterm_keeps_the_finished_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    started = fake_service_runs(
        monkeypatch, "serving", 3, lambda: os.kill(os.getpid(), signal.SIGTERM)
    )
    assert main(serving_args(tmp_path)) == 143
    assert len(started) == 3
    report = report_in(tmp_path / "out")
    assert report["complete"] is False
    assert report["stopped"] == "terminated (SIGTERM) after 3 of 4 runs"
    assert (report["meta"]["runs_done"], report["meta"]["runs_planned"]) == (3, 4)
    assert [run["error"] for run in report["runs"]] == [f"fake {name}" for name in started]
    assert "**Stopped** (terminated (SIGTERM)" in (tmp_path / "out" / "results.md").read_text()
    assert "holds the finished runs" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
    assert not (tmp_path / "work" / "direct.kv").exists()  # the runner's cleanup ran


def test_a_serving_run_writes_its_report_as_each_run_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[bool, int]] = []

    def look() -> None:  # at the start of the last run: three are on disk already
        report = report_in(tmp_path / "out")
        seen.append((report["complete"], report["meta"]["runs_done"]))

    fake_service_runs(monkeypatch, "serving", 3, look)
    assert main(serving_args(tmp_path)) == 0
    assert seen == [(False, 3)]
    report = report_in(tmp_path / "out")
    assert (report["complete"], report["stopped"], report["meta"]["runs_done"]) == (True, None, 4)
    assert "In progress" not in (tmp_path / "out" / "results.md").read_text()


def test_a_pressure_run_stopped_by_ctrl_c_keeps_the_finished_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt() -> None:
        raise KeyboardInterrupt

    fake_service_runs(monkeypatch, "pressure", 1, interrupt)
    out = tmp_path / "out"
    args = ["bench", "--preset", "pressure", "--work-dir", str(tmp_path / "work")]
    assert main([*args, "--out", str(out)]) == 130
    report = report_in(out)
    assert report["stopped"].startswith("interrupted (SIGINT) after 1 of ")
    assert [r["error"] for r in report["runs"]] == ["fake pressure-00-dual"]
    assert report["claims"]["all_ok"] is False  # judged on the one run there is


def test_run_keeping_writes_after_each_record_and_once_more_when_stopped() -> None:
    writes: list[tuple[int, str | None]] = []

    def run(keep: Callable[[dict[str, Any]], None]) -> None:
        keep({"n": 0})
        keep({"n": 1})
        raise Terminated

    records, stopped, status = run_keeping(
        run, lambda runs, why: writes.append((len(runs), why)), planned=5
    )
    assert records == [{"n": 0}, {"n": 1}]
    assert (stopped, status) == ("terminated (SIGTERM) after 2 of 5 runs", 143)
    assert writes == [(1, None), (2, None), (2, stopped)]


def test_run_keeping_lets_other_errors_through() -> None:
    def run(keep: Callable[[dict[str, Any]], None]) -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        run_keeping(run, lambda runs, why: None, planned=1)


def test_stop_of_names_each_signal_and_refuses_others() -> None:
    assert stop_of(KeyboardInterrupt(), 0, 2) == ("interrupted (SIGINT) after 0 of 2 runs", 130)
    with pytest.raises(TypeError):
        stop_of(ValueError("no"), 0, 2)


def test_terminate_raises_turns_sigterm_into_an_exception_and_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with terminate_raises(), pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs as the call returns
    assert signal.getsignal(signal.SIGTERM) is before


def test_write_whole_replaces_each_file(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("old, longer than the new text")
    write_whole(tmp_path, {"a.json": "new", "b.md": "# b"})
    assert (tmp_path / "a.json").read_text() == "new"
    assert (tmp_path / "b.md").read_text() == "# b"
    assert not list(tmp_path.glob(".*.partial"))
