"""``dualblade bench`` end to end: a tiny sweep in real memory cgroups (root only)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from dualblade.bench.cgroups import can_create_memory_cgroups
from dualblade.cli import main

TINY = """
policy = "dual"
copy_threads = 2
queue_depth = 8
[model]
preset = "opt-125m"
[workload]
batch = 2
prompt_len = 200
max_new_tokens = 2
[memory]
limit = "auto"
safety_margin = "32MiB"
knob_x = "4MiB"  # 3 layers through the page cache, 9 direct: both paths carry traffic
[storage]
page_cache_dir = "{dir}/pc"
[storage.direct]
kind = "file"
path = "{dir}/direct.kv"
"""


def test_the_quick_preset_repeats_three_times_and_a_config_file_once(tmp_path: Path) -> None:
    from dualblade.cli import build_parser
    from dualblade.commands.bench import _plan

    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(dir=tmp_path / "store"))

    def repeats(*argv: str) -> int:
        plan, _ = _plan(build_parser().parse_args(["bench", *argv]))
        return int(plan.repeats)

    assert repeats("--preset", "quick") == 3
    assert repeats("--preset", "quick", "--repeats", "1") == 1
    assert repeats(str(config), "--memory-limits", "1GiB") == 1
    assert repeats(str(config), "--memory-limits", "1GiB", "--repeats", "2") == 2


def test_bad_arguments_are_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--preset", "nope"]) == 2
    assert "unknown bench preset" in capsys.readouterr().err
    assert main(["bench", "--policies", "dual,fast", "--memory-limits", "1GiB"]) == 2
    assert "unknown policies" in capsys.readouterr().err
    assert main(["bench", "--steps", "99"]) == 2
    assert "exceeds workload.max_new_tokens" in capsys.readouterr().err
    assert main(["bench", "--steps", "0"]) == 2  # not the preset's steps, silently
    assert "at least one decode step" in capsys.readouterr().err
    assert main(["bench", "--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_flexgen_may_come_first_in_the_policies(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # flexgen is no pipeline policy: the sweep's shape must not be read from a config with it.
    monkeypatch.setattr("dualblade.bench.can_create_memory_cgroups", lambda: "stop here (test)")
    assert main(["bench", "--policies", "flexgen,dual", "--memory-limits", "1GiB"]) != 0
    err = capsys.readouterr().err
    assert "stop here (test)" in err
    assert "not a valid pipeline config" not in err


@pytest.mark.root
def test_tiny_sweep_writes_results_plots_and_checked_reads(tmp_path: Path) -> None:
    reason = can_create_memory_cgroups()
    if reason is not None:
        pytest.skip(reason)
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(dir=tmp_path / "store"))
    out = tmp_path / "out"
    status = main(
        [
            "bench",
            str(config),
            "--memory-limits",
            "400MiB,480MiB",
            "--policies",
            "dual,baseline",
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(out),
            "--verify",
            "full",
        ]
    )
    assert status == 0
    report = json.loads((out / "results.json").read_text())
    assert report["kv_working_set_bytes"] == 12 * 2 * 202 * 2 * 768 * 2
    records = report["results"]
    assert {(r["policy"], r["limit_bytes"]) for r in records} == {
        (p, m << 20) for p in ("dual", "baseline") for m in (400, 480)
    }
    for record in records:
        assert "error" not in record, record.get("error")
        assert record["prefill_s"] > 0
        assert record["decode_s"] > 0
        assert 0.0 <= record["hit_rate"] <= 1.0
        assert record["verified_bytes"] > 0
        # every policy measured its own floor, on its own storage, after its decode
        assert record["floor_s"] > 0
        assert record["floor_ratio"] == pytest.approx(record["decode_s"] / record["floor_s"])
        assert record["floor_serial_s"] >= record["floor_s"]
        passes = record["floor"]["passes"]
        if record["policy"] == "dual":
            assert record["requests"]["decode"]["latency"]["read"]["count"] > 0
            assert passes["direct"]["bytes"] > 0  # 9 layers direct, 3 through the page cache
        else:  # the baseline has no direct extents: its files alone are read
            assert passes["direct"] is None
            assert (passes["resident"] or passes["file_disk"])["bytes"] > 0
    for run in report["runs"]:
        # every run's record holds the ledger as the run left it: no move failed, the baseline
        # (not budgeted) moved nothing, and dual's ledger held the config's knob X (4 MiB)
        # under the run's own budget
        ledger = run["ledger"]
        assert ledger["failed_moves"] == 0
        if run["policy"] == "baseline":
            assert ledger["demotions"] == ledger["promotions"] == 0
        else:
            assert ledger["budget_bytes"] == min(4 << 20, run["page_cache_budget_bytes"]) > 0
        # and the collector's passes of each phase (dualblade.collector.CollectorPauses)
        for phase in ("prefill", "decode"):
            passes = run["python_gc"][phase]
            assert len(passes["passes"]) == 3
            assert passes["seconds"] >= passes["longest_s"] >= 0
    for name in ("decode.png", "prefill.png", "hit_rate.png", "throughput.png", "results.md"):
        assert (out / name).stat().st_size > 0
    assert "floors" in report["claims"]


def compute_run(tmp_path: Path, *, steps: int, extra: Sequence[str] = ()) -> dict[str, Any]:
    """One dual run of opt-125m at 600 MiB (``steps`` decode steps); its record. Root only."""
    reason = can_create_memory_cgroups()
    if reason is not None:
        pytest.skip(reason)
    config = tmp_path / "tiny.toml"
    tokens = f"max_new_tokens = {steps + 2}"
    config.write_text(TINY.format(dir=tmp_path / "store").replace("max_new_tokens = 2", tokens))
    out = tmp_path / "out"
    args = ["bench", str(config), "--memory-limits", "600MiB", "--policies", "dual"]
    args += ["--compute", "opt-125m", "--steps", str(steps), *extra]
    assert main([*args, "--work-dir", str(tmp_path / "work"), "--out", str(out)]) in (0, 1)
    (record,) = json.loads((out / "results.json").read_text())["results"]
    assert "error" not in record, record.get("error")
    return dict(record)


@pytest.mark.root
def test_a_compute_run_reports_each_phase_alone(tmp_path: Path) -> None:
    """With a real model the disk statistics of prefill and decode cover their own phase."""
    record = compute_run(tmp_path, steps=4)
    assert record["floor_s"] > 0  # measured at the last token, the engine's context still open
    if "disk" not in record:
        pytest.skip("the work dir's block device has no statistics here")
    prefill, decode = record["disk"]["prefill"], record["disk"]["decode"]
    assert prefill["seconds"] == pytest.approx(record["prefill_s"], abs=0.05)
    assert decode["seconds"] == pytest.approx(record["decode_s"], abs=0.05)
    assert prefill["written_bytes"] > decode["written_bytes"]  # prefill writes every row


@pytest.mark.root
def test_a_traced_compute_run_writes_the_engine_and_the_store_into_one_trace(
    tmp_path: Path,
) -> None:
    traces = tmp_path / "traces"
    record = compute_run(tmp_path, steps=3, extra=["--trace", str(traces)])
    trace = Path(record["trace"])
    assert trace.parent == traces
    assert trace.name == "000-dual-600MiB-r0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"engine", "binder", "copy-thread-0", "io_uring"} <= set(tracks.values()), tracks
    steps = [
        e["name"]
        for e in events
        if e.get("ph") == "X"
        and tracks[e["tid"]] == "engine"
        and e["name"].startswith("decode step")
    ]
    assert steps == ["decode step 1", "decode step 2", "decode step 3"]


def test_trace_is_refused_where_it_cannot_mean_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    assert main(["bench", "--memory-limits", "1GiB", "--trace", str(a_file)]) == 2
    assert "is a file: name a folder" in capsys.readouterr().err
    assert main(["bench", "--preset", "serving", "--trace", str(tmp_path)]) == 2
    assert "does not take it" in capsys.readouterr().err
