"""From a sweep's raw run records to ``results.json``, a markdown table and the claims checked.

Repeated runs of one (policy, limit) are reduced to medians (latencies, hit rate); the detail
(request metrics, throughput timeline, disk activity) is that of the run whose decode time is the
median. For ``dual`` the record also carries ``decode_floor_s``: the bytes its placement read from
storage during decode at the sweep's O_DIRECT rate plus the bytes it read from page cache at the
cached rate — the time the disk and memory alone would need.

:func:`evaluate_claims` checks the paper's claims on the results (see ``docs/bench.md``); the
sweep reports them, it does not fail on them: a user's machine may legitimately disagree.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

#: Keys reduced to the median over repeats.
_MEDIAN_KEYS = ("prefill_s", "prefill_produce_s", "decode_s", "hit_rate")


def aggregate(
    records: list[dict[str, Any]], direct_bw: float, cached_bw: float
) -> list[dict[str, Any]]:
    """One record per (policy, limit), medians over repeats, ``decode_floor_s`` for dual."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["policy"], record["limit_bytes"]), []).append(record)
    out = []
    for (policy, limit), runs in sorted(groups.items(), key=lambda item: (item[0][1], item[0][0])):
        ok = [r for r in runs if "error" not in r]
        if not ok:
            out.append(
                {
                    "policy": policy,
                    "limit_bytes": limit,
                    "error": runs[-1]["error"],
                    "runs": len(runs),
                }
            )
            continue
        ok.sort(key=lambda r: r["decode_s"])
        middle = dict(ok[(len(ok) - 1) // 2])
        for key in _MEDIAN_KEYS:
            values = [r[key] for r in ok if r.get(key) is not None]
            middle[key] = statistics.median(values) if values else None
        middle["runs"] = len(runs)
        middle["failed_runs"] = len(runs) - len(ok)
        if len(ok) > 1:
            middle["decode_s_runs"] = [round(r["decode_s"], 4) for r in ok]
            middle["prefill_s_runs"] = [round(r["prefill_s"], 4) for r in ok]
        if policy == "dual":
            middle["decode_floor_s"] = decode_floor(middle, direct_bw, cached_bw)
        out.append(middle)
    return out


def decode_floor(record: dict[str, Any], direct_bw: float, cached_bw: float) -> float:
    """Seconds the disk and memory need for what the run read during decode."""
    reads = record["decode_read_bytes"]
    storage = reads.get("direct", 0)
    cached = reads.get("page-cache", 0) + reads.get("baseline", 0)
    return float(storage / direct_bw + cached / cached_bw)


def _by(results: list[dict[str, Any]], policy: str) -> dict[int, dict[str, Any]]:
    return {r["limit_bytes"]: r for r in results if r["policy"] == policy and "error" not in r}


def linear_r2(xs: list[float], ys: list[float]) -> float | None:
    """R² of the least-squares line through the points (None below three points or with no
    spread in y: a flat line is not a rise)."""
    if len(xs) < 3:
        return None
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    syy = sum((y - mean_y) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    return (sxy * sxy) / (sxx * syy)


def evaluate_claims(results: list[dict[str, Any]], working_set: int) -> dict[str, Any]:
    """The issue's and the paper's claims, each with the numbers it was judged on."""
    dual, base = _by(results, "dual"), _by(results, "baseline")
    direct, cache = _by(results, "direct"), _by(results, "cache-policy")
    claims: dict[str, Any] = {}
    rows = []
    for limit, d in sorted(dual.items()):
        row: dict[str, Any] = {"limit_bytes": limit, "dual_decode_s": d["decode_s"]}
        if limit in base:
            row["baseline_decode_s"] = base[limit]["decode_s"]
            row["dual_le_baseline"] = d["decode_s"] <= base[limit]["decode_s"]
        others = [x[limit]["decode_s"] for x in (direct, cache) if limit in x]
        if others:
            row["best_single_path_s"] = min(others)
            row["dual_within_5pct_of_best"] = d["decode_s"] <= 1.05 * min(others)
        row["floor_s"] = d["decode_floor_s"]
        row["floor_ratio"] = d["decode_s"] / d["decode_floor_s"] if d["decode_floor_s"] else None
        row["within_25pct_of_floor"] = row["floor_ratio"] is not None and row["floor_ratio"] <= 1.25
        rows.append(row)
    claims["per_limit"] = rows
    below = [lim for lim in dual if lim in base and lim < working_set]
    if below:
        speedups = {
            lim: (
                base[lim]["decode_s"] / dual[lim]["decode_s"],
                base[lim]["prefill_s"] / dual[lim]["prefill_s"],
            )
            for lim in below
        }
        best = max(speedups, key=lambda lim: speedups[lim][0])
        claims["best_limit_below_working_set"] = {
            "limit_bytes": best,
            "decode_speedup": speedups[best][0],
            "prefill_speedup": speedups[best][1],
            "decode_ok": speedups[best][0] >= 1.5,
            "prefill_ok": speedups[best][1] >= 1.2,
        }
    limits = sorted(dual)
    r2 = linear_r2([float(x) for x in limits], [dual[x]["hit_rate"] for x in limits])
    rising = all(dual[a]["hit_rate"] <= dual[b]["hit_rate"] for a, b in itertools.pairwise(limits))
    claims["dual_hit_rate"] = {
        "r2": r2,
        "rises": rising,
        "ok": r2 is not None and r2 >= 0.95 and rising,
    }
    claims["all_ok"] = (
        bool(rows)
        and all(
            r.get("dual_le_baseline", True)
            and r.get("dual_within_5pct_of_best", True)
            and r["within_25pct_of_floor"]
            for r in rows
        )
        and claims["dual_hit_rate"]["ok"]
        and all(
            claims.get("best_limit_below_working_set", {}).get(k, False)
            for k in ("decode_ok", "prefill_ok")
        )
    )
    return claims


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f}"


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The sweep as a markdown table, one row per (limit, policy)."""
    lines = [
        "| limit GiB | policy | prefill s (producing) | decode s | floor s | hit rate "
        "| decode read MB/s | disk busy % | seq. | p50/p99 read µs | strategy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {_gib(r['limit_bytes'])} | {r['policy']} | failed: {r['error']} |")
            continue
        read_bytes = sum(r["decode_read_bytes"].values()) or r.get("decode_storage_read_bytes", 0)
        rate = read_bytes / r["decode_s"] / 1e6 if r["decode_s"] else 0.0
        disk = r.get("disk", {}).get("decode", {})
        latency = r["requests"]["decode"]["latency"].get("read", {})
        seq = r["requests"]["decode"]["sequentiality"]
        floor = r.get("decode_floor_s")
        hit = "" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        produce = r.get("prefill_produce_s")
        prefill = f"{r['prefill_s']:.3f}" + ("" if produce is None else f" ({produce:.2f})")
        lines.append(
            f"| {_gib(r['limit_bytes'])} | {r['policy']} | {prefill} "
            f"| {r['decode_s']:.3f} | {'' if floor is None else f'{floor:.3f}'} "
            f"| {hit} | {rate:.0f} | {disk.get('busy_percent', '')} "
            f"| {'' if seq is None else f'{seq:.2f}'} "
            f"| {latency.get('p50_us', '')}/{latency.get('p99_us', '')} | {r['strategy']} |"
        )
    return "\n".join(lines) + "\n"
