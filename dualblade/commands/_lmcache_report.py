"""What ``dualblade lmcache-bench`` reports: its issue's two ratios, and the table it prints."""

from __future__ import annotations

from typing import Any

from dualblade.commands._output import format_table
from dualblade.pipeline import format_size

#: Our all-direct loads above fio's read of the same extents by more than this (1 / 0.95, the
#: bench's floor rule) mean the reference was no bound that run: the VM's disk swung between the
#: two, or fio's requests took another shape (docs/lmcache.md).
BEATEN_ABOVE = 1 / 0.95


def lmcache_ratios(results: list[dict[str, Any]], fio: dict[str, Any] | None) -> dict[str, Any]:
    """The issue's two ratios: our load throughput over the fs adapter's best, and our direct
    path's (all objects direct) over fio's O_DIRECT read of the same adapter's extents (its
    first pass: data as old as the loads read); and whether that fio read was a bound (None:
    no ratio)."""
    by_name = {r["adapter"]: r.get("load_mbps") for r in results}
    fs_best = max((v for k, v in by_name.items() if k.startswith("fs") and v), default=None)
    # ours on the dual policy: on the file, else on the block device (--block)
    ours = by_name.get("dualblade") or by_name.get("dualblade-block")
    direct = by_name.get("dualblade-direct")
    versus_fio = round(direct / fio["mbps"], 2) if direct and fio and fio.get("mbps") else None
    return {
        "dualblade_vs_fs_best": round(ours / fs_best, 2) if ours and fs_best else None,
        "direct_vs_fio": versus_fio,
        "fio_is_a_bound": None if versus_fio is None else versus_fio <= BEATEN_ABOVE,
    }


def print_lmcache_table(document: dict[str, Any]) -> None:
    """The report as a table, then the two ratios and any adapter's failure."""
    rows = []
    stored = document["setup"].get("stored_bytes")
    for r in document["adapters"]:
        placed = (r.get("dualblade") or {}).get("placed") or {}
        hit = (r.get("dualblade") or {}).get("page_cache_hit_rate")
        budget = ((r.get("dualblade") or {}).get("ledger") or {}).get("budget_bytes")
        rows.append(
            [
                r["adapter"],
                r.get("store_mbps", "-"),
                r.get("load_mbps", "-"),
                r.get("load_ok", "-"),
                "yes" if r["verified"] else "NO",
                " ".join(f"{k}:{v}" for k, v in sorted(placed.items())) or "-",
                "-" if hit is None else f"{hit:.2f}",
                _budget(budget, stored),
                "-" if r["cgroup_peak_bytes"] is None else format_size(r["cgroup_peak_bytes"]),
            ]
        )
    for r in document["adapters"]:
        fio = r.get("fio_own_extents")
        if fio:
            passes = "/".join(str(p) for p in fio.get("passes_mbps", [])) or fio.get("error")
            rows.append([f"fio, {r['adapter']}'s extents", "-", passes, *["-"] * 6])
    headers = ["adapter", "store MB/s", "load MB/s", "loaded", "verified", "placed", "pc hit"]
    headers += ["pc budget (of stored)", "peak mem"]
    print(format_table(headers, rows))
    ratios = document["ratios"]
    beaten = ratios.get("fio_is_a_bound") is False
    print(
        f"load vs fs adapter's best: {ratios['dualblade_vs_fs_best']}; "
        f"direct vs fio: {ratios['direct_vs_fio']}"
        + (" (fio was beaten: no bound this run, the ratio means nothing)" if beaten else "")
    )
    for r in document["adapters"]:
        if "error" in r:
            print(f"{r['adapter']} failed (exit {r['exit_code']}): {r['error'][-500:]}")


def _budget(budget: int | None, stored: int | None) -> str:
    """Our store's page-cache budget at its close, and its share of the stored set: how much of
    the set the limit really left the page cache, by the store's own reading of it."""
    if budget is None:
        return "-"
    share = f" ({budget / stored:.0%})" if stored else ""
    return format_size(budget) + share
