"""From pressure runs to phases, the recovery claim, and a markdown table.

Each run's steps fall in three phases around the squeeze (its start ``s``): *before* (steps that
began before ``s``), *during* (steps that began in ``[s, s + RECOVERY_S)``), *after* (the rest).
The run's new floor is the last step's bytes priced at rates measured after the decode, with
the squeeze still on (:mod:`.floor`). A run has *recovered* at the end of the first step that
began after ``s`` whose time is at most ``FLOOR_SLACK`` × the floor and from which on the median
step is too; ``recovered_after_s`` is that end minus ``s``.

The claim (issue 14): dual with live re-planning recovers within :data:`RECOVERY_S` seconds.
A floor that the steps after the squeeze beat by more than 5 % (``after_p50_over_floor`` below
:data:`~dualblade.bench.floor.VALID_RATIO`) is no floor, and the claim fails saying so.
The static variant and the baseline are reported beside it, unjudged.
"""

from __future__ import annotations

import statistics
from typing import Any

from dualblade.bench.floor import VALID_RATIO
from dualblade.bench.serving_report import percentile

RECOVERY_S = 2.0
FLOOR_SLACK = 1.15
#: The variants: (name, policy, live re-planning).
VARIANTS: dict[str, tuple[str, bool]] = {
    "dual": ("dual", True),
    "dual-static": ("dual", False),
    "baseline": ("baseline", False),
}


def _phase(steps: list[dict[str, Any]]) -> dict[str, Any]:
    times = [s["step_s"] for s in steps]
    return {
        "steps": len(times),
        "p50_s": percentile(times, 50),
        "p99_s": percentile(times, 99),
        "max_s": max(times, default=None),
    }


def recovery(steps: list[dict[str, Any]], squeeze_s: float, floor_s: float | None) -> float | None:
    """Seconds from the squeeze to the end of the step it recovered at (None: never)."""
    if not floor_s:
        return None
    bound = FLOOR_SLACK * floor_s
    later = [s for s in steps if s["start_s"] >= squeeze_s]
    for index, step in enumerate(later):
        rest = [s["step_s"] for s in later[index:]]
        if step["step_s"] <= bound and statistics.median(rest) <= bound:
            return float(step["start_s"] + step["step_s"] - squeeze_s)
    return None


def summarize_pressure_run(record: dict[str, Any]) -> dict[str, Any]:
    """A run's phases, floor and recovery (a failed run keeps its error)."""
    base = {
        "variant": record["variant"],
        "limit_bytes": record["limit_bytes"],
        "oom_kills": record.get("oom_kills", 0),
    }
    if "error" in record:
        return {**base, "error": record["error"]}
    steps = record["steps"]
    squeeze = record.get("squeeze_at_s")
    if squeeze is None:
        return {**base, "error": "the squeeze never started"}
    floor = record.get("floor", {})
    floor_s = floor.get("floor_s")
    before = [s for s in steps if s["start_s"] < squeeze]
    during = [s for s in steps if squeeze <= s["start_s"] < squeeze + RECOVERY_S]
    after = [s for s in steps if s["start_s"] >= squeeze + RECOVERY_S]
    recovered = recovery(steps, squeeze, floor_s)
    after_p50 = _phase(after)["p50_s"]
    return {
        **base,
        "squeeze_at_s": squeeze,
        "squeeze_took_s": (record.get("squeeze_done_s") or squeeze) - squeeze,
        "before": _phase(before),
        "during": _phase(during),
        "after": _phase(after),
        "floor_s": floor_s,
        "floor_error": floor.get("floor_error"),
        "after_p50_over_floor": after_p50 / floor_s if after_p50 and floor_s else None,
        "recovered_after_s": recovered,
        "page_cache_layers_before": before[-1]["page_cache_layers"] if before else None,
        "page_cache_layers_end": steps[-1]["page_cache_layers"] if steps else None,
        "demotions": record.get("ledger", {}).get("demotions", 0),
        "promotions": record.get("ledger", {}).get("promotions", 0),
    }


def evaluate_pressure_claims(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Dual with re-planning recovers within :data:`RECOVERY_S` to at most
    :data:`FLOOR_SLACK` × its new floor, with no OOM kill; ``failed`` names what broke."""
    failed: list[str] = []
    dual = next((r for r in results if r["variant"] == "dual"), None)
    claim: dict[str, Any] = {"recovery_limit_s": RECOVERY_S, "floor_slack": FLOOR_SLACK}
    if dual is None or "error" in dual:
        why = dual["error"] if dual else "no dual run"
        failed.append(f"dual with live re-planning has no result ({why})")
    else:
        claim["recovered_after_s"] = dual["recovered_after_s"]
        claim["floor_s"] = dual["floor_s"]
        if dual["floor_s"] is None:
            failed.append(f"dual's new floor was not measured ({dual.get('floor_error')})")
        elif (ratio := dual["after_p50_over_floor"]) is not None and ratio < VALID_RATIO:
            failed.append(
                f"dual's steps after the squeeze took {ratio:.2f} x its new floor (< "
                f"{VALID_RATIO}): the floor measured something else than the run's storage "
                "(the disk drifted, or the host cached the decode's reads and not the passes')"
            )
        elif dual["recovered_after_s"] is None:
            failed.append(
                f"dual never returned to <= {FLOOR_SLACK} x its new floor "
                f"({dual['floor_s']:.3f} s) after the squeeze"
            )
        elif dual["recovered_after_s"] > RECOVERY_S:
            failed.append(
                f"dual returned to <= {FLOOR_SLACK} x its new floor "
                f"{dual['recovered_after_s']:.2f} s after the squeeze (needs <= {RECOVERY_S})"
            )
    kills = {r["variant"]: r.get("oom_kills", 0) for r in results}
    if any(kills.values()):
        failed.append(f"OOM kills {kills}")
    claim["oom_kills"] = kills
    return {"dual_recovery": claim, "failed": failed, "all_ok": dual is not None and not failed}


def _cell(phase: dict[str, Any]) -> str:
    if not phase["steps"]:
        return "–"
    return f"{phase['p50_s']:.3f} / {phase['max_s']:.3f} ({phase['steps']})"


def pressure_table(results: list[dict[str, Any]]) -> str:
    """One row per variant: step p50 / max (count) before, during and after the squeeze."""
    lines = [
        "| variant | before: step p50 / max s (n) | during | after | new floor s "
        "| after p50 ÷ floor | recovered after s | page-cache layers before → end "
        "| moves (dem./prom.) | OOM kills |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(
                f"| {r['variant']} | failed: {r['error']} | | | | | | | | {r['oom_kills']} |"
            )
            continue
        floor = "–" if r["floor_s"] is None else f"{r['floor_s']:.3f}"
        ratio = r["after_p50_over_floor"]
        rec = r["recovered_after_s"]
        lines.append(
            f"| {r['variant']} | {_cell(r['before'])} | {_cell(r['during'])} "
            f"| {_cell(r['after'])} | {floor} | {'–' if ratio is None else f'{ratio:.2f}'} "
            f"| {'never' if rec is None else f'{rec:.2f}'} "
            f"| {r['page_cache_layers_before']} → {r['page_cache_layers_end']} "
            f"| {r['demotions']}/{r['promotions']} | {r['oom_kills']} |"
        )
    return "\n".join(lines) + "\n"
