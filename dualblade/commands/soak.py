"""``dualblade soak``: many concurrent contexts with injected faults and cancellations, every
byte checked; exits non-zero on any mismatch, unaccounted fault, leak or RSS growth.

``--kill-restart`` kills and restarts the store's process, ``--full-disk`` runs it on a small
file system, ``--pressure`` shrinks and grows the page-cache budget (live re-planning) while
contexts decode; modes combine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dualblade import event_loop
from dualblade.commands._output import format_table, print_json
from dualblade.errors import ConfigError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "soak",
        help="concurrent contexts with random faults and cancellations; every byte checked",
        description=(
            "Run a store on a scratch direct file with injected EIO/ENOSPC/short/slow faults "
            "and random cancellations, check every byte read, account for every fault, sample "
            "RSS and pinned memory, and check for leaks afterwards. Exit status 1 when any "
            "check fails."
        ),
    )
    parser.add_argument("--minutes", type=float, default=1.0, help="run time (default 1)")
    parser.add_argument("--seconds", type=float, help="run time in seconds (overrides --minutes)")
    parser.add_argument("--contexts", type=int, default=8, help="concurrent contexts (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, ops and faults")
    parser.add_argument(
        "--fault-rate",
        type=float,
        default=None,
        help="share of direct chunks faulted (0.02; 0 under --pressure)",
    )
    parser.add_argument(
        "--cancel-rate", type=float, default=0.1, help="share of operations cancelled (0.1)"
    )
    parser.add_argument(
        "--policy",
        default="dual",
        choices=["dual", "direct", "page-cache", "cache-policy", "baseline"],
        help="placement policy (faults hit its direct path; default dual)",
    )
    parser.add_argument("--dir", type=Path, help="scratch folder parent (default: cache dir)")
    parser.add_argument(
        "--max-rss-growth",
        type=float,
        default=0.05,
        help="fail above this RSS growth, first to last minute (runs of 2+ minutes; 0.05)",
    )
    modes = parser.add_argument_group("serving modes")
    modes.add_argument(
        "--kill-restart",
        action="store_true",
        help="run the store in child processes killed (SIGKILL) at random moments and "
        "restarted on the same folder; each restart must reclaim all the dead one left",
    )
    modes.add_argument(
        "--restart-after",
        type=float,
        nargs=2,
        default=(1.0, 4.0),
        metavar=("MIN_S", "MAX_S"),
        help="kill a child this many seconds after its store opened (uniform; default 1 4)",
    )
    modes.add_argument(
        "--full-disk",
        action="store_true",
        help="put the scratch folder on a small tmpfs (root only), so contexts meet ENOSPC "
        "for real at claims, page-cache files and writes",
    )
    modes.add_argument(
        "--pressure",
        action="store_true",
        help="shrink and grow the page-cache budget every second or so while contexts decode: "
        "the store demotes and promotes live layers (no injected faults)",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON report")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dualblade.bench import SoakOptions, run_soak

    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    options = SoakOptions(
        seconds=seconds,
        contexts=args.contexts,
        seed=args.seed,
        fault_rate=(0.0 if args.pressure else 0.02) if args.fault_rate is None else args.fault_rate,
        cancel_rate=args.cancel_rate,
        policy=args.policy,
        workdir=args.dir,
        max_rss_growth=args.max_rss_growth,
        kill_restart=args.kill_restart,
        restart_after_s=tuple(args.restart_after),
        full_disk=args.full_disk,
        pressure=args.pressure,
    )
    if args.max_rss_growth <= 0:
        raise ConfigError(f"--max-rss-growth must be positive, got {args.max_rss_growth}")
    report = event_loop.run(
        lambda: run_soak(options, progress=lambda line: print(line, file=sys.stderr, flush=True))
    )
    if args.json:
        print_json(report)
    else:
        print(_summary(report))
    return 0 if report["ok"] else 1


def _summary(report: dict[str, Any]) -> str:
    faults = report["faults"]
    memory = report["memory"]
    rows = [
        ("result", "PASS" if report["ok"] else "FAIL"),
        ("seconds", report["seconds"]),
        ("contexts (concurrent / opened)", f"{report['contexts']} / {report['contexts_opened']}"),
        ("operations", sum(report["operations"].values())),
        ("bytes verified", report["bytes_verified"]),
        ("mismatches", report["mismatches"]),
        ("cancellations", report["cancellations"]),
        ("errors by type", report["errors_by_type"] or "-"),
        ("faults injected", faults["injected"] or "-"),
        ("faults surfaced", faults["surfaced"] or "-"),
        ("faults accounted", faults["accounted"]),
        ("rss growth (first to last window)", memory["rss_growth_first_to_last"]),
        ("leaks", {k: v for k, v in report["leaks"].items() if v and "bytes" not in k} or "none"),
    ]
    pressure = report.get("pressure")
    if pressure:
        rows.append(
            (
                "pressure: budget changes / demotions / promotions / failed moves",
                f"{pressure['budget_changes']} / {pressure['demotions']} / "
                f"{pressure['promotions']} / {pressure['failed_moves']}",
            )
        )
    if report["full_disk"]["enabled"]:
        rows.append(("full disk: ENOSPC met (op:io)", report["full_disk"]["no_room_errors"] or "-"))
    if report.get("mode") == "kill-restart":
        reclaim = report["reclaim"]
        rows += [
            ("restarts (children killed)", report["restarts"]),
            ("reclaimed bytes (files / direct)", _reclaimed(reclaim)),
            ("faults cut short by a kill", faults["unaccounted_at_kill"] or "-"),
            ("left after the last store", reclaim["left_after_last_store"]),
            ("problems", report["problems"] or "none"),
        ]
    return format_table(["check", "value"], rows)


def _reclaimed(reclaim: dict[str, Any]) -> str:
    files = reclaim["reclaimed_bytes"] - reclaim["reclaimed_direct_bytes"]
    return (
        f"{reclaim['reclaimed_bytes']} ({reclaim['reclaimed_files']} files, {files} B / "
        f"{reclaim['reclaimed_direct_extents']} runs, {reclaim['reclaimed_direct_bytes']} B)"
    )
