"""PNG plots of a serving bench, in the sweep plots' style (matplotlib, headless Agg).

- ``serving_tokens.png``: tokens/s against the memory limit, one line per policy;
- ``serving_steps.png``: per-step latency p50 (solid) and p99 (dashed) against the limit;
- ``serving_ttft.png``: each request's time to first token, per policy, at each limit;
- ``serving_residency.png``: dual's resident page-cache bytes (``mincore``) and its ledger's
  budget through each run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MiB = 1 << 20


def pyplot() -> Any:
    """matplotlib's pyplot on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, ax: Any, path: Path) -> Path:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series(results: list[dict[str, Any]], key: str) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    for r in sorted(results, key=lambda r: r["limit_bytes"]):
        if "error" in r or r.get(key) is None:
            continue
        xs, ys = out.setdefault(r["policy"], ([], []))
        xs.append(r["limit_bytes"] / MiB)
        ys.append(r[key])
    return out


def write_serving_plots(
    results: list[dict[str, Any]], runs: list[dict[str, Any]], out_dir: Path
) -> list[Path]:
    """Write the four plots into ``out_dir``; returns their paths."""
    plt = pyplot()
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, (xs, ys) in sorted(_series(results, "tokens_per_s").items()):
        ax.plot(xs, ys, marker="o", label=policy)
    ax.set_xlabel("memory limit (MiB)")
    ax.set_ylabel("tokens/s (all requests)")
    written.append(_save(plt, fig, ax, out_dir / "serving_tokens.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    p99 = _series(results, "step_p99_s")
    for policy, (xs, ys) in sorted(_series(results, "step_p50_s").items()):
        (line,) = ax.plot(xs, ys, marker="o", label=f"{policy} p50")
        if policy in p99:
            ax.plot(
                *p99[policy], marker="x", ls="--", color=line.get_color(), label=f"{policy} p99"
            )
    ax.set_xlabel("memory limit (MiB)")
    ax.set_ylabel("decode step latency (s)")
    written.append(_save(plt, fig, ax, out_dir / "serving_steps.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ordered = sorted(results, key=lambda r: (r["limit_bytes"], r["policy"]))
    labels = []
    for x, r in enumerate(ordered):
        labels.append(f"{r['policy']}\n{r['limit_bytes'] / MiB:.0f}")
        if "error" not in r:
            ax.scatter([x] * len(r["ttft_s"]), r["ttft_s"], s=14)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_xlabel("policy, memory limit (MiB)")
    ax.set_ylabel("time to first token per request (s)")
    written.append(_save(plt, fig, ax, out_dir / "serving_ttft.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in sorted(runs, key=lambda r: r["limit_bytes"]):
        if run.get("policy") != "dual" or "error" in run or not run.get("residency"):
            continue
        ts = [s[0] for s in run["residency"]]
        limit = f"{run['limit_bytes'] / MiB:.0f} MiB"
        if "repeat" in run:
            limit += f", run {run['repeat'] + 1}"
        (line,) = ax.plot(
            ts, [s[1] / MiB for s in run["residency"]], lw=1, label=f"resident @ {limit}"
        )
        ax.plot(
            ts,
            [s[2] / MiB for s in run["residency"]],
            lw=1,
            ls="--",
            color=line.get_color(),
            label=f"ledger budget @ {limit}",
        )
    ax.set_xlabel("seconds since the first arrival")
    ax.set_ylabel("dual: page-cache MiB (mincore) and budget")
    written.append(_save(plt, fig, ax, out_dir / "serving_residency.png"))
    return written
