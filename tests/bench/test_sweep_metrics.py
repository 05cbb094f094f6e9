"""The sweep's pure parts: request-log metrics, run order, aggregation, claims, derived KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dualblade.bench.kv_workload import VerificationError
from dualblade.bench.request_log import (
    ChunkRecord,
    RequestLog,
    latency_percentiles,
    percentile,
    queue_depth_bins,
    sequentiality,
)
from dualblade.bench.sweep import run_order
from dualblade.bench.sweep_report import aggregate, evaluate_claims, linear_r2, markdown_table
from dualblade.bench.sweep_workload import DerivedKV


def _rec(
    offset: int, length: int, submitted: float, completed: float, op: str = "read"
) -> ChunkRecord:
    return ChunkRecord("t", op, offset, length, submitted, completed)


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.99) == 5.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)


def test_sequentiality_counts_continuations_within_the_window() -> None:
    # Two interleaved streams on one target: after the jump that opens the second, each request
    # continues one of the last two.
    records = [_rec(0, 10, 0, 1), _rec(100, 10, 1, 2), _rec(10, 10, 2, 3), _rec(110, 10, 3, 4)]
    assert sequentiality(records, window=2) == pytest.approx(2 / 3)
    # With a window of one the interleaving breaks every continuation.
    assert sequentiality(records, window=1) == 0.0
    # A jump back is not sequential.
    assert sequentiality([_rec(0, 10, 0, 1), _rec(0, 10, 1, 2)], window=1) == 0.0
    assert sequentiality([_rec(0, 10, 0, 1)], window=1) is None


def test_queue_depth_is_what_was_in_flight_at_submission() -> None:
    # Three overlapping requests (depth 1, 2, 3), then one alone (depth 1).
    records = [
        _rec(0, 1, 0.0, 10.0),
        _rec(1, 1, 1.0, 10.0),
        _rec(2, 1, 2.0, 10.0),
        _rec(3, 1, 20.0, 21.0),
    ]
    bins = {b["queue_depth"]: b["count"] for b in queue_depth_bins(records, edges=(1, 2, 3))}
    assert bins == {"1-1": 2, "2-2": 1, "3+": 1}


def test_latency_percentiles_per_op() -> None:
    records = [_rec(0, 1, 0, 0.001 * i, op) for i in range(1, 101) for op in ("read", "write")]
    out = latency_percentiles(records)
    assert set(out) == {"read", "write"}
    assert out["read"]["count"] == 100
    assert out["read"]["max_us"] == pytest.approx(100_000, rel=1e-6)
    assert out["read"]["p50_us"] == pytest.approx(50_500, rel=1e-3)


def test_request_log_ignores_failed_chunks_and_orders_by_submission() -> None:
    log = RequestLog()
    log("t", "read", 0, 4096, 2.0, 3.0, 4096)
    log("t", "read", 4096, 4096, 1.0, 2.0, 4096)
    log("t", "read", 8192, 4096, 1.5, 2.0, -5)
    assert [r.offset for r in log.records()] == [4096, 0]
    assert [r.offset for r in log.records(since=1.5)] == [0]


@given(
    st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4, unique=True),
    st.integers(1, 4),
    st.integers(1, 3),
)
def test_run_order_runs_every_pair_once_per_repeat_and_rotates(
    policies: list[str], n_limits: int, repeats: int
) -> None:
    limits = [(i + 1) << 20 for i in range(n_limits)]
    order = run_order(policies, limits, repeats)
    assert sorted(order) == sorted(
        (r, lim, p) for r in range(repeats) for lim in limits for p in policies
    )
    if len(policies) > 1 and n_limits * repeats >= len(policies):
        firsts = [order[i * len(policies)][2] for i in range(n_limits * repeats)]
        assert set(firsts) == set(policies)


def _run(
    policy: str, limit: int, decode: float, prefill: float, hit: float, **reads: int
) -> dict[str, object]:
    return {
        "policy": policy,
        "limit_bytes": limit,
        "decode_s": decode,
        "prefill_s": prefill,
        "hit_rate": hit,
        "decode_read_bytes": reads or {"direct": 0},
        "requests": {"decode": {"latency": {}, "sequentiality": None}},
        "strategy": "intra",
    }


def test_aggregate_takes_medians_of_decode_and_floor() -> None:
    runs = [
        _run("dual", 1 << 30, d, 1.0, 0.5, direct=1_000_000_000, **{"page-cache": 3_000_000_000})
        for d in (3.0, 1.0, 2.0)
    ]
    for run, floor in zip(runs, (1.8, 0.9, 1.6), strict=True):
        run.update(floor_s=floor, floor_serial_s=floor + 0.5, floor_ratio=run["decode_s"] / floor)
    runs.append({"policy": "baseline", "limit_bytes": 1 << 30, "error": "killed by the OOM killer"})
    out = aggregate(runs)
    dual = next(r for r in out if r["policy"] == "dual")
    assert dual["decode_s"] == 2.0
    assert dual["floor_s"] == pytest.approx(1.6)
    assert dual["floor_ratio"] == pytest.approx(2.0 / 1.6)
    assert dual["floor_valid"]
    assert dual["runs"] == 3
    failed = next(r for r in out if r["policy"] == "baseline")
    assert "OOM" in failed["error"]
    assert failed["floor_s"] is None
    assert "failed" in markdown_table(out)
    assert "1.25" in markdown_table(out)


def test_a_single_run_that_beats_its_floor_invalidates_it_and_fails_the_claims() -> None:
    run = _run("direct", 1 << 30, 2.1, 1.0, 0.0)
    run.update(floor_s=2.4, floor={"disk_s": 2.4, "memory_s": 0.0})  # 0.875 of its floor
    (record,) = aggregate([run])
    assert not record["floor_valid"]
    assert record["floor_beaten_runs"] == 1
    assert "disk part" in record["floor_invalid_why"]
    claims = evaluate_claims([record], working_set=1 << 32)
    (invalid,) = claims["floors"]["invalid"]
    assert invalid["policy"] == "direct"
    assert "0.875" in invalid["why"]
    assert not claims["floors"]["ok"]
    assert not claims["all_ok"]
    assert "✗" in markdown_table([record])


def _repeats(
    decodes: tuple[float, ...], floors: tuple[float | None, ...]
) -> list[dict[str, object]]:
    runs = [_run("baseline", 1 << 30, d, 1.0, 0.0) for d in decodes]
    for run, floor in zip(runs, floors, strict=True):
        run.update(floor_s=floor, floor={"disk_s": floor, "memory_s": 0.0})
        if floor is None:
            run["floor_error"] = "the floor's passes failed: OSError: boom"
    return runs


def test_with_repeats_the_floor_is_judged_on_the_medians_and_a_beaten_run_is_shown() -> None:
    # One run of three beat its own floor (2.0 / 2.2 = 0.91); the medians do not (2.1 / 2.0).
    (record,) = aggregate(_repeats((2.0, 2.1, 2.3), (2.2, 2.0, 1.9)))
    assert record["floor_ratio"] == pytest.approx(2.1 / 2.0)
    assert record["floor_valid"]
    assert record["floor_beaten_runs"] == 1
    assert evaluate_claims([record], working_set=1 << 32)["floors"]["ok"]
    assert "(1 of 3 runs < 0.95)" in markdown_table([record])


def test_with_repeats_medians_that_beat_the_floor_invalidate_it() -> None:
    # Two runs of three beaten, and so are the medians (2.05 / 2.2 = 0.932).
    (record,) = aggregate(_repeats((2.0, 2.05, 2.4), (2.2, 2.3, 2.2)))
    assert not record["floor_valid"]
    assert record["floor_beaten_runs"] == 2
    assert "0.932" in record["floor_invalid_why"]
    assert not evaluate_claims([record], working_set=1 << 32)["floors"]["ok"]
    assert "✗ (2 of 3 runs < 0.95)" in markdown_table([record])


def test_with_repeats_one_run_without_a_floor_invalidates_the_record() -> None:
    (record,) = aggregate(_repeats((2.0, 2.1, 2.3), (1.9, None, 2.0)))
    assert not record["floor_valid"]
    assert "boom" in record["floor_invalid_why"]


def test_a_run_without_a_floor_says_why() -> None:
    run = _run("baseline", 1 << 30, 2.0, 1.0, 0.0)
    run.update(floor_s=None, floor_error="the floor's passes failed: OSError: boom")
    (record,) = aggregate([run])
    assert not record["floor_valid"]
    assert "boom" in record["floor_invalid_why"]


def test_claims_judge_each_rule() -> None:
    gib = 1 << 30
    results = []
    for i, limit in enumerate((gib, 2 * gib, 3 * gib)):
        dual = _run("dual", limit, 2.0, 1.0, 0.1 * (i + 1), direct=2_000_000_000)
        dual.update(floor_s=1.9, floor_ratio=2.0 / 1.9)
        results += [
            dual,
            _run("baseline", limit, 4.0, 1.5, 0.0),
            _run("direct", limit, 2.0, 1.0, 0.0),
            _run("cache-policy", limit, 2.5, 1.2, 0.1),
        ]
        for record in results[-3:]:
            record.update(floor_s=1.0, floor_ratio=record["decode_s"])
    claims = evaluate_claims(results, working_set=8 * gib)
    assert claims["dual_hit_rate"]["r2"] == pytest.approx(1.0)
    best = claims["best_limit_below_working_set"]
    assert best["decode_speedup"] == pytest.approx(2.0)
    assert best["prefill_ok"]
    assert best["decode_ok"]
    assert claims["floors"]["ok"]
    assert all(row["within_15pct_of_floor"] for row in claims["per_limit"])
    assert claims["all_ok"]
    # dual slower than direct by more than 5 %: that claim fails and so does the whole.
    results[2]["decode_s"] = 1.5
    assert not evaluate_claims(results, working_set=8 * gib)["all_ok"]
    results[2]["decode_s"] = 2.0
    # dual more than 15 % above its floor: fails.
    results[0].update(floor_s=1.7, floor_ratio=2.0 / 1.7)
    claims = evaluate_claims(results, working_set=8 * gib)
    assert not claims["per_limit"][0]["within_15pct_of_floor"]
    assert not claims["all_ok"]


def test_linear_r2_needs_spread() -> None:
    assert linear_r2([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert linear_r2([1, 2, 3], [1, 1, 1]) is None
    assert linear_r2([1, 2], [1, 2]) is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_derived_kv_checks_what_it_derives_and_catches_a_wrong_row(dtype: str) -> None:
    data = DerivedKV(prompt=130, batch=3, width=8, dtype=dtype, seed=1)
    k = data.prompt_rows("K", 5)
    full = torch.cat([k, data.appended_row("K", 5, 0), data.appended_row("K", 5, 1)])
    assert data.check("K", 5, full, "full") == full.numel() * full.element_size()
    assert data.check("K", 5, full, "sample") > 0
    # Layers and tensors differ from each other.
    assert not torch.equal(k, data.prompt_rows("K", 6))
    assert not torch.equal(k, data.prompt_rows("V", 5))
    wrong = full.clone()
    wrong[61] = data.prompt_rows("K", 4)[61]  # a sampled row from another layer
    with pytest.raises(VerificationError):
        data.check("K", 5, wrong, "sample")
    appended_wrong = full.clone()
    appended_wrong[131] = appended_wrong[130]
    with pytest.raises(VerificationError):
        data.check("K", 5, appended_wrong, "sample")
    unsampled = full.clone()
    unsampled[7] = data.prompt_rows("K", 4)[7]
    data.check("K", 5, unsampled, "sample")  # row 7 is not in the sample ...
    with pytest.raises(VerificationError):
        data.check("K", 5, unsampled, "full")  # ... but full mode sees it


def test_flexgen_log_parsing() -> None:
    from dualblade.bench.flexgen_peer import parse_log

    log = (
        "model size: 12.386 GB\tcache size: 8.100 GB\thidden size (p): 0.031 GB\n"
        "peak gpu mem: 13.914 GB\tprojected: False\n"
        "prefill latency: 3.212 s\tprefill throughput: 5101.003 token/s\n"
        "decode latency: 4.315 s\tdecode throughput: 51.912 token/s\n"
    )
    assert parse_log(log) == {"prefill_s": 3.212, "decode_s": 4.315}
    with pytest.raises(ValueError, match="decode latency"):
        parse_log("prefill latency: 1.0 s\n")


def test_flexgen_policy_without_the_package_is_a_recorded_error(tmp_path: Path) -> None:
    import importlib.util
    import json

    from dualblade.bench.flexgen_peer import main as peer_main

    if importlib.util.find_spec("flexgen") is not None:
        pytest.skip("flexgen is installed here")
    spec = tmp_path / "spec.json"
    out = tmp_path / "out.json"
    spec.write_text(
        json.dumps(
            {
                "config": {"model": {"preset": "opt-6.7b"}, "workload": {}},
                "offload_dir": str(tmp_path),
                "decode_steps": 1,
                "out": str(out),
            }
        )
    )
    assert peer_main([str(spec)]) == 1
    assert "not installed" in json.loads(out.read_text())["error"]
