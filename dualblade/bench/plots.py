"""PNG plots of a sweep (matplotlib, headless Agg backend).

- ``decode.png`` / ``prefill.png``: latency against the memory limit, one line per policy;
- ``hit_rate.png``: page-cache hit rate against the limit, with dual's least-squares line;
- ``throughput.png``: read throughput through the decode phase of each dual run (the strategy
  probe's iterations show as the first steps), step boundaries marked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GiB = 1 << 30


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(results: list[dict[str, Any]], key: str) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    for r in sorted(results, key=lambda r: r["limit_bytes"]):
        if "error" in r:
            continue
        xs, ys = out.setdefault(r["policy"], ([], []))
        xs.append(r["limit_bytes"] / GiB)
        ys.append(r[key])
    return out


def write_plots(results: list[dict[str, Any]], out_dir: Path, working_set: int) -> list[Path]:
    """Write the four plots into ``out_dir``; returns their paths."""
    plt = _pyplot()
    written = []
    for key, name, label in (
        ("decode_s", "decode.png", "decode latency (s)"),
        ("prefill_s", "prefill.png", "prefill latency (s)"),
        ("hit_rate", "hit_rate.png", "page-cache hit rate (share of decode KV bytes)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, (xs, ys) in sorted(_series(results, key).items()):
            ax.plot(xs, ys, marker="o", label=policy)
        if key == "hit_rate":
            xs, ys = _series(results, key).get("dual", ([], []))
            if len(xs) >= 2:
                import numpy as np

                slope, intercept = np.polyfit(xs, ys, 1)
                ax.plot(xs, [slope * x + intercept for x in xs], "k--", lw=1, label="dual fit")
        ax.axvline(working_set / GiB, color="grey", ls=":", lw=1, label="KV working set")
        ax.set_xlabel("memory limit (GiB)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in sorted(results, key=lambda r: r["limit_bytes"]):
        if r["policy"] != "dual" or "error" in r or not r.get("decode_throughput"):
            continue
        ts = [p[0] for p in r["decode_throughput"]]
        rates = [p[1] / 1e6 for p in r["decode_throughput"]]
        (line,) = ax.plot(ts, rates, lw=1, label=f"dual @ {r['limit_bytes'] / GiB:.2f} GiB")
        for end in r.get("decode_step_ends_s", []):
            ax.axvline(end, color=line.get_color(), alpha=0.25, lw=0.8)
    ax.set_xlabel("seconds since decode start (vertical lines: step ends)")
    ax.set_ylabel("KV read throughput (MB/s)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # decode may be shorter than one sampling interval
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
