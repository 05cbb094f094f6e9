"""From serving runs to figures, the claims checked, and a markdown table.

Per run (:func:`summarize_run`): tokens/s (every sequence's new tokens over the time from the
first arrival to the last request's end), time to first token per request (arrival to the end
of its prefill, its wait for a turn included), per-step latency p50/p99 over every request's
decode steps, the page-cache residency of the store's files (``mincore``) against the ledger's
budget at each sample, and the OOM kills of its cgroup. :func:`combine_repeats` then makes one
row per (policy, limit) of its repeated runs: the median tokens/s, step percentiles over every
run's steps, and the worst of what must hold in every run (residency, OOM kills, errors).

:func:`evaluate_serving_claims` judges issue 14's rules at every limit: dual's tokens/s at least
1.5 × baseline's and 1.0 × the better of direct and cache-policy, its sampled residency never
above the ledger's budget + 5 %, its p99 step latency at most 2 × its p50, no OOM kill. A rule
that cannot be judged (a policy missing or failed) fails with a message saying so.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

#: Dual against the baseline, and against the better single path.
BASELINE_SPEEDUP = 1.5
SINGLE_PATH_SPEEDUP = 1.0
#: Residency may exceed the ledger's budget by this share at most.
RESIDENCY_SLACK = 0.05
#: Dual's p99 step latency may be at most this multiple of its p50.
TAIL_RATIO = 2.0

MiB = 1 << 20


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def residency_summary(samples: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The samples ``[t, resident, budget, placed]`` against ``budget × (1 + slack)``."""
    over = [s for s in samples if s[1] > s[2] * (1 + RESIDENCY_SLACK)]
    worst = max(samples, key=lambda s: s[1] - s[2], default=None)
    return {
        "samples": len(samples),
        "max_resident_bytes": max((int(s[1]) for s in samples), default=0),
        "max_over_budget_bytes": int(worst[1] - worst[2]) if worst else 0,
        "max_ratio": max((s[1] / s[2] for s in samples if s[2] > 0), default=None),
        "samples_over": len(over),
        "first_over_s": over[0][0] if over else None,
        "ok": not over,
    }


def summarize_run(record: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (see the module docstring); a failed run keeps its error."""
    base = {
        "policy": record["policy"],
        "limit_bytes": record["limit_bytes"],
        "oom_kills": record.get("oom_kills", 0),
        "wall_s": record.get("wall_s"),
        "cgroup_peak_bytes": record.get("cgroup_peak_bytes"),
    }
    if "error" in record:
        return {**base, "error": record["error"]}
    requests = record["requests"]
    end = max(r["finished_s"] for r in requests)
    tokens = sum(r["tokens"] for r in requests)
    steps = [s for r in requests for s in r["step_s"]]
    ttft = [r["ttft_s"] for r in requests]
    ledger = record.get("ledger", {})
    return {
        **base,
        "tokens": tokens,
        "duration_s": end,
        "tokens_per_s": tokens / end if end > 0 else None,
        "ttft_s": ttft,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_max_s": max(ttft),
        "step_count": len(steps),
        "step_s": steps,
        "step_p50_s": percentile(steps, 50),
        "step_p99_s": percentile(steps, 99),
        "step_max_s": max(steps, default=None),
        "hit_rate": record.get("hit_rate"),
        "read_bytes": record.get("read_bytes", {}),
        "residency": residency_summary(record.get("residency", [])),
        "demotions": ledger.get("demotions", 0),
        "promotions": ledger.get("promotions", 0),
        "failed_moves": ledger.get("failed_moves", 0),
        "strategy": record.get("strategy"),
    }


def _combined_residency(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ratios = [p["max_ratio"] for p in parts if p.get("max_ratio") is not None]
    firsts = [p["first_over_s"] for p in parts if p.get("first_over_s") is not None]
    return {
        "samples": sum(p["samples"] for p in parts),
        "max_resident_bytes": max((p["max_resident_bytes"] for p in parts), default=0),
        "max_over_budget_bytes": max((p["max_over_budget_bytes"] for p in parts), default=0),
        "max_ratio": max(ratios, default=None),
        "samples_over": sum(p["samples_over"] for p in parts),
        "first_over_s": firsts[0] if firsts else None,
        "ok": all(p["ok"] for p in parts),
    }


def combine_repeats(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, limit) of the runs' summaries (:func:`summarize_run`).

    Rates are medians over the runs (``tokens_per_s_runs`` keeps each); step percentiles and
    TTFTs are over every run's requests; what must hold in every run holds only if it held in
    each: the residency (samples summed, the worst ratio), OOM kills (summed), and a failed run
    fails the row (its ``error``). ``runs``: how many runs the row stands for.
    """
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for summary in summaries:
        groups.setdefault((summary["policy"], summary["limit_bytes"]), []).append(summary)
    rows = []
    for (policy, limit), runs in groups.items():
        base = {
            "policy": policy,
            "limit_bytes": limit,
            "runs": len(runs),
            "oom_kills": sum(r.get("oom_kills", 0) for r in runs),
            "cgroup_peak_bytes": max((r.get("cgroup_peak_bytes") or 0 for r in runs), default=0),
        }
        failed = [r for r in runs if "error" in r]
        if failed:
            rows.append(
                {**base, "error": f"{len(failed)} of {len(runs)} runs failed: {failed[0]['error']}"}
            )
            continue
        steps = [s for r in runs for s in r["step_s"]]
        ttft = [t for r in runs for t in r["ttft_s"]]
        rates = [r["tokens_per_s"] for r in runs if r.get("tokens_per_s") is not None]
        hits = [r["hit_rate"] for r in runs if r.get("hit_rate") is not None]
        rows.append(
            {
                **base,
                "tokens_per_s": statistics.median(rates) if rates else None,
                "tokens_per_s_runs": rates,
                "ttft_s": ttft,
                "ttft_p50_s": percentile(ttft, 50),
                "ttft_max_s": max(ttft),
                "step_count": len(steps),
                "step_p50_s": percentile(steps, 50),
                "step_p99_s": percentile(steps, 99),
                "step_max_s": max(steps, default=None),
                "hit_rate": statistics.median(hits) if hits else None,
                "residency": _combined_residency([r["residency"] for r in runs]),
                "demotions": statistics.median(r["demotions"] for r in runs),
                "promotions": statistics.median(r["promotions"] for r in runs),
                "failed_moves": sum(r["failed_moves"] for r in runs),
            }
        )
    return rows


def _at(results: list[dict[str, Any]], policy: str, limit: int) -> dict[str, Any] | None:
    for r in results:
        if r["policy"] == policy and r["limit_bytes"] == limit:
            return r
    return None


def _rate(run: dict[str, Any] | None) -> float | None:
    if run is None or "error" in run:
        return None
    value = run.get("tokens_per_s")
    return float(value) if value is not None else None


def evaluate_serving_claims(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 14's serving rules at every limit; ``all_ok`` only when every rule holds, and
    ``failed`` names each broken rule."""
    limits = sorted({r["limit_bytes"] for r in results})
    rows = []
    failed: list[str] = []
    for limit in limits:
        dual = _at(results, "dual", limit)
        where = f"at {limit / MiB:.0f} MiB"
        row: dict[str, Any] = {"limit_bytes": limit}
        dual_rate = _rate(dual)
        row["dual_tokens_per_s"] = dual_rate
        if dual_rate is None:
            why = dual["error"] if dual is not None and "error" in dual else "no dual run"
            failed.append(f"{where}: dual has no result ({why})")
        base_rate = _rate(_at(results, "baseline", limit))
        row["baseline_tokens_per_s"] = base_rate
        row["vs_baseline"] = dual_rate / base_rate if dual_rate and base_rate else None
        row["vs_baseline_ok"] = (
            row["vs_baseline"] is not None and row["vs_baseline"] >= BASELINE_SPEEDUP
        )
        if not row["vs_baseline_ok"]:
            failed.append(
                f"{where}: dual tokens/s vs baseline {_fmt(row['vs_baseline'])} "
                f"(needs >= {BASELINE_SPEEDUP})"
            )
        singles = {p: _rate(_at(results, p, limit)) for p in ("direct", "cache-policy")}
        best = max((v for v in singles.values() if v is not None), default=None)
        row["best_single_path_tokens_per_s"] = best
        row["vs_best_single_path"] = dual_rate / best if dual_rate and best else None
        row["vs_best_single_path_ok"] = (
            row["vs_best_single_path"] is not None
            and row["vs_best_single_path"] >= SINGLE_PATH_SPEEDUP
        )
        if not row["vs_best_single_path_ok"]:
            failed.append(
                f"{where}: dual tokens/s vs the better of direct and cache-policy "
                f"{_fmt(row['vs_best_single_path'])} (needs >= {SINGLE_PATH_SPEEDUP})"
            )
        residency = dual.get("residency") if dual and "error" not in dual else None
        row["residency_max_ratio"] = residency["max_ratio"] if residency else None
        row["residency_ok"] = bool(residency and residency["ok"] and residency["samples"])
        if not row["residency_ok"]:
            failed.append(
                f"{where}: dual's page-cache residency went above its ledger budget + "
                f"{RESIDENCY_SLACK:.0%} ({residency['samples_over'] if residency else '?'} "
                f"samples, max ratio {_fmt(row['residency_max_ratio'])})"
            )
        p50 = dual.get("step_p50_s") if dual and "error" not in dual else None
        p99 = dual.get("step_p99_s") if dual and "error" not in dual else None
        row["dual_step_p50_s"], row["dual_step_p99_s"] = p50, p99
        row["tail_ratio"] = p99 / p50 if p50 and p99 is not None else None
        row["tail_ok"] = row["tail_ratio"] is not None and row["tail_ratio"] <= TAIL_RATIO
        if not row["tail_ok"]:
            failed.append(
                f"{where}: dual's p99 step latency is {_fmt(row['tail_ratio'])} x its p50 "
                f"(needs <= {TAIL_RATIO})"
            )
        kills = {r["policy"]: r.get("oom_kills", 0) for r in results if r["limit_bytes"] == limit}
        row["oom_kills"] = kills
        row["no_oom_ok"] = not any(kills.values())
        if not row["no_oom_ok"]:
            failed.append(f"{where}: OOM kills {kills}")
        rows.append(row)
    return {"per_limit": rows, "failed": failed, "all_ok": bool(rows) and not failed}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def serving_table(results: list[dict[str, Any]]) -> str:
    """One row per (limit, policy)."""
    lines = [
        "| limit MiB | policy | tokens/s (each run) | TTFT p50 / max s | step p50 / p99 s "
        "| hit rate | resident max MiB (÷ budget) | moves (dem./prom.) | OOM kills |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["limit_bytes"], r["policy"])):
        head = f"| {r['limit_bytes'] / MiB:.0f} | {r['policy']} "
        if "error" in r:
            lines.append(head + f"| failed: {r['error']} | | | | | | {r['oom_kills']} |")
            continue
        res = r["residency"]
        ratio = "" if res["max_ratio"] is None else f" ({res['max_ratio']:.2f})"
        hit = "" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        lines.append(
            head + f"| {r['tokens_per_s']:.1f}{_each(r)} "
            f"| {r['ttft_p50_s']:.2f} / {r['ttft_max_s']:.2f} "
            f"| {r['step_p50_s']:.3f} / {r['step_p99_s']:.3f} | {hit} "
            f"| {res['max_resident_bytes'] / MiB:.0f}{ratio} "
            f"| {r['demotions']:g}/{r['promotions']:g} | {r['oom_kills']} |"
        )
    return "\n".join(lines) + "\n"


def _each(row: dict[str, Any]) -> str:
    """`` (a, b, c)``: each run's tokens/s behind a median of several."""
    rates = row.get("tokens_per_s_runs") or []
    return f" ({', '.join(f'{rate:.1f}' for rate in rates)})" if len(rates) > 1 else ""
