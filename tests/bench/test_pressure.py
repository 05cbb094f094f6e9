"""The pressure preset: phases and recovery on synthetic steps, its claim, and one tiny run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dualblade.bench.pressure import pressure_plan
from dualblade.bench.pressure_report import (
    evaluate_pressure_claims,
    pressure_table,
    recovery,
    summarize_pressure_run,
)
from dualblade.bench.pressure_worker import main as pressure_worker
from dualblade.errors import ConfigError


def _steps(times: list[float]) -> list[dict[str, Any]]:
    out, clock = [], 0.0
    for t in times:
        out.append(
            {
                "start_s": clock,
                "step_s": t,
                "page_cache_layers": 3,
                "ledger_budget_bytes": 0,
                "ledger_placed_bytes": 0,
            }
        )
        clock += t
    return out


def _record(variant: str, times: list[float], squeeze_at: float, floor: float) -> dict[str, Any]:
    return {
        "variant": variant,
        "limit_bytes": 1 << 30,
        "oom_kills": 0,
        "steps": _steps(times),
        "squeeze_at_s": squeeze_at,
        "squeeze_done_s": squeeze_at + 0.1,
        "floor": {"floor_s": floor},
        "ledger": {"demotions": 3, "promotions": 0},
    }


def test_recovery_is_the_first_step_at_the_floor_that_stays_there() -> None:
    # steps of 0.5 s; the squeeze at 2.0 s; two slow steps, a fast one, a slow one, then fast
    steps = _steps([0.5] * 4 + [1.0, 1.0, 0.5, 1.0, 0.5, 0.5, 0.5])
    # the 0.5 s step at 4.0 s reaches the floor, but the 1.0 s one after it does not stay:
    # the median of what follows is still 0.5, so it counts: it ends at 4.5 s, 2.5 s after
    assert recovery(steps, 2.0, 0.5) == pytest.approx(2.5)
    assert recovery(steps, 2.0, 0.1) is None
    assert recovery(steps, 2.0, None) is None


def test_the_claim_holds_when_dual_recovers_within_two_seconds() -> None:
    times = [0.3] * 10 + [0.8, 0.5, 0.3, 0.3, 0.3, 0.3]
    results = [
        summarize_pressure_run(_record("dual", times, 3.0, 0.3)),
        summarize_pressure_run(_record("dual-static", [0.3] * 10 + [0.9] * 6, 3.0, 0.3)),
        summarize_pressure_run(_record("baseline", [0.6] * 10 + [1.2] * 6, 6.0, 0.4)),
    ]
    claims = evaluate_pressure_claims(results)
    assert claims["all_ok"], claims["failed"]
    assert claims["dual_recovery"]["recovered_after_s"] == pytest.approx(1.6)
    table = pressure_table(results)
    assert "| dual-static |" in table
    assert "never" in table


@pytest.mark.parametrize(
    ("times", "floor", "kills", "named"),
    [
        ([0.3] * 10 + [0.8] * 4 + [0.3] * 4, 0.3, 0, "3.50 s after the squeeze"),
        ([0.3] * 10 + [0.8] * 6, 0.3, 0, "never returned"),
        ([0.3] * 10 + [0.3] * 6, None, 0, "floor was not measured"),
        ([0.3] * 16, 0.3, 1, "OOM kills"),
        ([0.3] * 30, 0.4, 0, "measured something else"),
    ],
)
def test_a_broken_rule_fails_the_claim_and_is_named(
    times: list[float], floor: float | None, kills: int, named: str
) -> None:
    record = _record("dual", times, 3.0, floor)  # type: ignore[arg-type]
    record["oom_kills"] = kills
    claims = evaluate_pressure_claims([summarize_pressure_run(record)])
    assert not claims["all_ok"]
    assert any(named in why for why in claims["failed"]), claims["failed"]


def test_the_plan_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one limit"):
        pressure_plan(work_dir=tmp_path, limits=[1 << 30, 2 << 30])
    with pytest.raises(ConfigError, match="variants"):
        pressure_plan(work_dir=tmp_path, variants=["direct"])
    plan = pressure_plan(work_dir=tmp_path, steps=10)
    assert plan.squeeze_step == 5
    assert plan.squeeze["bytes"] == (1 << 30) // 4


def test_a_tiny_run_squeezes_midway_and_measures_its_floor(tmp_path: Path) -> None:
    """The worker end to end in this process's memory (no cgroup): the hog allocates, an
    explicit budget keeps two of four layers on the page cache, the floor is measured."""
    config = {
        "policy": "dual",
        "model": {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "dtype": "float16"},
        "workload": {"batch": 4, "prompt_len": 60, "max_new_tokens": 6},
        "copy_threads": 2,
        "queue_depth": 8,
        "max_chunk": "1MiB",
        "memory": {"page_cache_budget": "256KiB", "knob_x": "256KiB"},
        "storage": {
            "page_cache_dir": str(tmp_path / "pc"),
            "direct": {"kind": "file", "path": str(tmp_path / "direct.kv")},
        },
    }
    out = tmp_path / "out.json"
    spec = {
        "config": config,
        "decode_steps": 6,
        "squeeze_step": 3,
        "squeeze": {"kind": "hog", "bytes": 1 << 20},
        "replan": True,
        "device": "cpu",
        "out": str(out),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert pressure_worker([str(tmp_path / "spec.json")]) == 0
    record = json.loads(out.read_text())
    assert "error" not in record, record
    assert len(record["steps"]) == 6
    assert record["steps"][3]["start_s"] <= record["squeeze_at_s"] + 1.0
    assert record["floor"]["floor_s"] > 0
    summary = summarize_pressure_run({**record, "variant": "dual", "limit_bytes": 1 << 30})
    assert summary["before"]["steps"] == 3
