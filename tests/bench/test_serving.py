"""The serving preset: its requests, its claims on synthetic results, and one tiny run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dualblade.bench.serving import run_order
from dualblade.bench.serving_report import (
    combine_repeats,
    evaluate_serving_claims,
    percentile,
    serving_table,
    summarize_run,
)
from dualblade.bench.serving_requests import draw_requests
from dualblade.bench.serving_worker import main as serving_worker
from dualblade.errors import ConfigError

MiB = 1 << 20
KNOBS: dict[str, Any] = {
    "rate": 4.0,
    "batches": (2, 3, 4),
    "prompt_min": 40,
    "prompt_max": 60,
    "new_tokens": 3,
}


def test_arrivals_are_seeded_poisson_and_reproducible() -> None:
    first = draw_requests(50, seed=7, **KNOBS)
    assert first == draw_requests(50, seed=7, **KNOBS)
    assert first != draw_requests(50, seed=8, **KNOBS)
    arrivals = [r.arrival_s for r in first]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    # exponential gaps of mean 1/rate: the mean of 49 gaps is near 0.25 s
    assert 0.12 < arrivals[-1] / 49 < 0.5
    assert {r.batch for r in first} <= {2, 3, 4}
    assert all(40 <= r.prompt_len <= 60 and r.max_len == r.prompt_len + 3 for r in first)


def test_a_request_without_a_decode_step_is_refused() -> None:
    with pytest.raises(ConfigError, match="new tokens"):
        draw_requests(2, seed=0, **{**KNOBS, "new_tokens": 1})


def test_policies_rotate_from_limit_to_limit() -> None:
    order = run_order(["a", "b", "c"], [2, 1])
    assert order == [(1, "a", 0), (1, "b", 0), (1, "c", 0), (2, "b", 0), (2, "c", 0), (2, "a", 0)]


def test_repeated_rounds_rotate_so_no_policy_always_goes_first() -> None:
    order = run_order(["a", "b", "c"], [1, 2], repeats=3)
    at_one = [(policy, repeat) for limit, policy, repeat in order if limit == 1]
    assert at_one == [
        ("a", 0), ("b", 0), ("c", 0),
        ("b", 1), ("c", 1), ("a", 1),
        ("c", 2), ("a", 2), ("b", 2),
    ]  # fmt: skip
    assert [limit for limit, _, _ in order] == [1] * 9 + [2] * 9
    firsts = {order[i][1] for i in range(9, 18, 3)}
    assert firsts == {"a", "b", "c"}


def _summary(policy: str, rate: float, steps: list[float], **extra: Any) -> dict[str, Any]:
    run = {
        "policy": policy,
        "limit_bytes": 640 * MiB,
        "oom_kills": 0,
        "tokens_per_s": rate,
        "ttft_s": [0.5, 0.7],
        "step_s": steps,
        "hit_rate": 0.2,
        "residency": {
            "samples": 5,
            "max_resident_bytes": 100,
            "max_over_budget_bytes": -10,
            "max_ratio": 0.9,
            "samples_over": 0,
            "first_over_s": None,
            "ok": True,
        },
        "demotions": 2,
        "promotions": 3,
        "failed_moves": 0,
    }
    run.update(extra)
    return run


def test_repeats_combine_into_medians_and_every_run_must_hold() -> None:
    over = {
        "samples": 4,
        "max_resident_bytes": 130,
        "max_over_budget_bytes": 20,
        "max_ratio": 1.2,
        "samples_over": 1,
        "first_over_s": 0.4,
        "ok": False,
    }
    runs = [
        _summary("dual", 30.0, [0.1, 0.2]),
        _summary("dual", 40.0, [0.3], residency=over, oom_kills=1),
        _summary("dual", 20.0, [0.4, 0.5]),
        _summary("direct", 25.0, [0.2]),
    ]
    rows = {row["policy"]: row for row in combine_repeats(runs)}
    dual = rows["dual"]
    assert dual["runs"] == 3
    assert dual["tokens_per_s"] == 30.0  # the median, not the mean (30.0 too) or the best
    assert dual["tokens_per_s_runs"] == [30.0, 40.0, 20.0]
    assert dual["step_count"] == 5
    assert dual["step_p50_s"] == pytest.approx(0.3)  # over every run's steps
    assert len(dual["ttft_s"]) == 6
    assert dual["residency"]["ok"] is False  # one run above its budget fails the limit
    assert dual["residency"]["max_ratio"] == 1.2
    assert dual["residency"]["samples"] == 14
    assert dual["oom_kills"] == 1
    assert rows["direct"]["runs"] == 1
    assert "(30.0, 40.0, 20.0)" in serving_table([dual])
    claims = evaluate_serving_claims(list(rows.values()))
    assert any("ledger budget" in why for why in claims["failed"])


def test_one_failed_run_fails_its_row() -> None:
    runs = [
        _summary("dual", 30.0, [0.1]),
        {
            "policy": "dual",
            "limit_bytes": 640 * MiB,
            "oom_kills": 1,
            "error": "killed by the OOM killer",
        },
    ]
    (row,) = combine_repeats(runs)
    assert "1 of 2 runs failed: killed by the OOM killer" in row["error"]
    assert row["oom_kills"] == 1


def _result(policy: str, limit: int, tokens_per_s: float, **extra: Any) -> dict[str, Any]:
    result = {
        "policy": policy,
        "limit_bytes": limit,
        "oom_kills": 0,
        "tokens_per_s": tokens_per_s,
        "step_p50_s": 0.1,
        "step_p99_s": 0.15,
        "residency": {"ok": True, "samples": 10, "max_ratio": 0.9, "samples_over": 0},
    }
    result.update(extra)
    return result


def _good(limit: int = 512 * MiB) -> list[dict[str, Any]]:
    return [
        _result("dual", limit, 30.0),
        _result("baseline", limit, 15.0),
        _result("direct", limit, 25.0),
        _result("cache-policy", limit, 28.0),
    ]


def test_claims_hold_on_good_results() -> None:
    claims = evaluate_serving_claims(_good() + _good(768 * MiB))
    assert claims["all_ok"], claims["failed"]
    assert len(claims["per_limit"]) == 2


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"baseline": {"tokens_per_s": 25.0}}, "vs baseline"),
        ({"cache-policy": {"tokens_per_s": 31.0}}, "better of direct and cache-policy"),
        (
            {
                "dual": {
                    "residency": {"ok": False, "samples": 10, "max_ratio": 1.3, "samples_over": 2}
                }
            },
            "ledger budget",
        ),
        ({"dual": {"step_p99_s": 0.25}}, "p99 step latency"),
        ({"direct": {"oom_kills": 1}}, "OOM kills"),
        ({"dual": {"error": "exit status 1"}}, "dual has no result"),
    ],
)
def test_a_broken_rule_fails_the_claims_and_is_named(
    change: dict[str, dict[str, Any]], named: str
) -> None:
    results = _good()
    for r in results:
        r.update(change.get(r["policy"], {}))
    claims = evaluate_serving_claims(results)
    assert not claims["all_ok"]
    assert any(named in why for why in claims["failed"]), claims["failed"]


def test_percentiles_interpolate() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


def test_a_tiny_run_serves_every_request_and_samples_residency(tmp_path: Path) -> None:
    """The worker end to end, in this process's memory (no cgroup), dual under an explicit
    page-cache budget of two layers shared by three requests."""
    requests = draw_requests(3, seed=1, **KNOBS)
    config = {
        "policy": "dual",
        "model": {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "dtype": "float16"},
        "workload": {"batch": 4, "prompt_len": 60, "max_new_tokens": 3},
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
    spec = {"config": config, "requests": [r.to_dict() for r in requests], "out": str(out)}
    (tmp_path / "spec.json").write_text(json.dumps({**spec, "device": "cpu"}))
    assert serving_worker([str(tmp_path / "spec.json")]) == 0
    record = json.loads(out.read_text())
    assert "error" not in record, record
    assert [r["index"] for r in record["requests"]] == [0, 1, 2]
    for r in record["requests"]:
        assert len(r["step_s"]) == 2
        assert r["verified_bytes"] > 0
        assert r["ttft_s"] >= r["prefill_s"] >= 0
    assert record["residency"]
    assert record["ledger"]["budget_bytes"] == 256 << 10
    summary = summarize_run({**record, "policy": "dual", "limit_bytes": 1 << 30, "oom_kills": 0})
    assert summary["tokens"] == sum(r.batch * r.new_tokens for r in requests)
    assert summary["tokens_per_s"] > 0
    assert summary["residency"]["samples"] > 0
    assert "| dual |" in serving_table([summary])


def test_the_bench_command_hands_the_service_presets_over(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dualblade.cli import main

    assert main(["bench", "--preset", "pressure", "--memory-limits", "1GiB,2GiB"]) == 2
    assert "runs at one limit" in capsys.readouterr().err
    assert main(["bench", "--preset", "pressure", "--repeats", "3"]) == 2
    assert "runs each variant once" in capsys.readouterr().err
    assert main(["bench", "--preset", "serving", "--policies", "dual,fast"]) == 2
    assert "unknown policies" in capsys.readouterr().err
    assert main(["bench", "configs/default.toml", "--preset", "serving"]) == 2
    assert "takes no config file" in capsys.readouterr().err


def test_a_wrong_byte_in_a_read_fails_the_check() -> None:
    from dualblade.bench.kv_workload import VerificationError
    from dualblade.bench.serving_workload import ServingKV

    request = draw_requests(1, seed=3, **KNOBS)[0]
    data = ServingKV(60, 4, 64, "float16", seed=0)
    rows = [data.prompt_rows("K", request, 2)]
    rows += [data.appended_row("K", request, 2, step) for step in range(2)]
    read = torch.cat(rows)
    assert data.check("K", request, 2, read) > 0
    for row in (0, request.prompt_len + 1):  # a sampled prompt row, the newest appended row
        bad = read.clone()
        bad[row, 0, 0] += 1
        with pytest.raises(VerificationError):
            data.check("K", request, 2, bad)
    with pytest.raises(VerificationError):  # another request's rows
        data.check("K", draw_requests(2, seed=3, **KNOBS)[1], 2, read)


@pytest.mark.anyio
async def test_a_request_never_opens_before_its_arrival() -> None:
    """A sleep that ends early (uvloop's timers count whole milliseconds) is slept again."""
    from dualblade.bench.serving_workload import sleep_until

    readings = iter([0.0, 0.0095, 0.0099, 0.0101])  # two wake-ups before the arrival at 10 ms
    seen: list[float] = []

    def clock() -> float:
        seen.append(next(readings))
        return seen[-1]

    await sleep_until(0.01, clock)
    assert seen == [0.0, 0.0095, 0.0099, 0.0101]
