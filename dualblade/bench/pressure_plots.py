"""PNG plots of a pressure bench (the sweep plots' style).

- ``pressure_steps.png``: each variant's step latency through the decode, the squeeze marked,
  dual's new floor and 1.15 × it drawn;
- ``pressure_ledger.png``: each variant's ledger budget and placed bytes, and its page-cache
  layers, through the decode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dualblade.bench.pressure_report import FLOOR_SLACK
from dualblade.bench.serving_plots import pyplot

MiB = 1 << 20


def write_pressure_plots(
    runs: list[dict[str, Any]], results: list[dict[str, Any]], out_dir: Path
) -> list[Path]:
    """Write the two plots into ``out_dir``; returns their paths."""
    plt = pyplot()
    floors = {r["variant"]: r.get("floor_s") for r in results if "error" not in r}
    ok = [r for r in runs if "error" not in r and r.get("steps")]

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in ok:
        ts = [s["start_s"] + s["step_s"] for s in run["steps"]]
        (line,) = ax.plot(
            ts, [s["step_s"] for s in run["steps"]], marker=".", lw=1, label=run["variant"]
        )
        floor = floors.get(run["variant"])
        if run["variant"] == "dual" and floor:
            ax.axhline(floor, color=line.get_color(), lw=0.8, ls=":", label="dual's new floor")
            ax.axhline(
                FLOOR_SLACK * floor, color=line.get_color(), lw=0.8, ls="--", label="1.15 × floor"
            )
        if run.get("squeeze_at_s") is not None:
            ax.axvline(run["squeeze_at_s"], color=line.get_color(), alpha=0.4, lw=1)
    ax.set_xlabel("seconds since decode start (vertical lines: the squeeze)")
    ax.set_ylabel("decode step latency (s)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    steps_png = out_dir / "pressure_steps.png"
    fig.savefig(steps_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    right = ax.twinx()
    for run in ok:
        ts = [s["start_s"] for s in run["steps"]]
        (line,) = ax.plot(
            ts,
            [s["ledger_budget_bytes"] / MiB for s in run["steps"]],
            lw=1,
            ls="--",
            label=f"{run['variant']} budget",
        )
        ax.plot(
            ts,
            [s["ledger_placed_bytes"] / MiB for s in run["steps"]],
            lw=1,
            color=line.get_color(),
            label=f"{run['variant']} placed",
        )
        right.plot(
            ts,
            [s["page_cache_layers"] for s in run["steps"]],
            lw=0.8,
            ls=":",
            color=line.get_color(),
        )
    ax.set_xlabel("seconds since decode start")
    ax.set_ylabel("ledger MiB (dashed: budget, solid: placed)")
    right.set_ylabel("page-cache layers (dotted)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    ledger_png = out_dir / "pressure_ledger.png"
    fig.savefig(ledger_png, dpi=110)
    plt.close(fig)
    return [steps_png, ledger_png]
