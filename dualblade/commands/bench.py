"""``dualblade bench``: the paper's experiment — policies × memory limits, each in a cgroup.

Writes ``DIR/results.json``, ``DIR/results.md`` and PNG plots; see ``docs/bench.md`` for what
is measured and how. The two results files are rewritten as each run ends, so a sweep stopped
part way (a timeout's SIGTERM, Ctrl-C) leaves every run it finished, marked incomplete.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

from dualblade.commands._output import print_json
from dualblade.commands._progress import ProgressBar


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench", help="sweep policies over memory limits (each run in its own memory cgroup)"
    )
    parser.add_argument("config", nargs="?", help="pipeline config (TOML/YAML) to sweep")
    parser.add_argument(
        "--preset",
        help="quick, paper or long-context (default: quick); serving or pressure: many requests "
        "on one store, or memory taken midway (docs/serving-bench.md)",
    )
    parser.add_argument("--memory-limits", help="comma-separated limits, e.g. 1GiB,2GiB")
    parser.add_argument(
        "--policies",
        help="comma-separated: baseline,cache-policy,direct,dual; flexgen = the real FlexGen",
    )
    parser.add_argument("--steps", type=int, help="decode steps per run")
    parser.add_argument(
        "--repeats",
        type=int,
        help="runs per (policy, limit), medians reported (default: the preset's, 3 for quick; 1 "
        "with a config file)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="where the runs' files go (default: the cache dir); overrides a config's storage",
    )
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument(
        "--verify",
        choices=("sample", "full"),
        default="sample",
        help="how much of each read to check",
    )
    parser.add_argument(
        "--compute",
        metavar="PRESET",
        help="run real inference (an OPT preset, random weights) instead of synthetic KV traffic",
    )
    parser.add_argument("--keep-files", action="store_true", help="keep the runs' KV files")
    parser.add_argument("--json", action="store_true", help="print results.json to stdout")
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="write each run's Perfetto/Chrome trace into DIR (its store's actors and, with "
        "--compute, the engine's steps); tracing costs each run some Python per event",
    )
    parser.add_argument("--requests", type=int, help="--preset serving: requests per run")
    parser.add_argument(
        "--squeeze",
        choices=("hog", "limit"),
        help="--preset pressure: a memory hog or a lower limit",
    )
    parser.set_defaults(func=bench)


def _plan(args: argparse.Namespace) -> tuple[Any, str]:
    from dualblade.bench import SweepPlan, check_plan, get_bench_preset
    from dualblade.errors import ConfigError
    from dualblade.pipeline import default_cache_dir, load_config, parse_size

    if args.config and args.preset:
        raise ConfigError("give a config file or --preset, not both")
    preset = get_bench_preset(args.preset or "quick")
    if args.config:
        pipeline = load_config(args.config).model_dump(mode="json", exclude_none=True)
        label = str(args.config)
        limits: list[int] = []
        steps = None
        repeats = 1  # the quick preset's three repeats are its own, not a config file's
    else:
        pipeline = json.loads(json.dumps(preset.pipeline))
        label = f"preset {preset.name}"
        limits = list(preset.limits)
        steps = preset.decode_steps
        repeats = preset.repeats
    if args.work_dir is not None:
        pipeline.pop("storage", None)
    if args.memory_limits:
        limits = [parse_size(part) for part in args.memory_limits.split(",") if part.strip()]
    policies = (
        [p.strip() for p in args.policies.split(",") if p.strip()]
        if args.policies
        else list(preset.policies)
    )
    compute = None
    if args.compute:
        pipeline["model"] = {"preset": args.compute}
        gpu = (args.device or "").startswith("cuda")
        compute = {"preset": args.compute, "dtype": "float16" if gpu else "float32"}
    max_new = int(pipeline["workload"]["max_new_tokens"])
    plan = SweepPlan(
        pipeline=pipeline,
        limits=limits,
        policies=policies,
        decode_steps=args.steps if args.steps is not None else steps or max_new,
        repeats=args.repeats if args.repeats is not None else repeats,
        work_dir=args.work_dir or default_cache_dir() / "bench",
        device=args.device,
        verify=args.verify,
        keep_files=args.keep_files,
        label=label,
        compute=compute,
        trace_dir=args.trace,
    )
    check_plan(plan)
    if plan.decode_steps > max_new:
        raise ConfigError(
            f"--steps {plan.decode_steps} exceeds workload.max_new_tokens ({max_new})"
        )
    return plan, label


def bench(args: argparse.Namespace) -> int:
    from dualblade.bench import SERVICE_PRESETS, run_service_preset

    if args.preset in SERVICE_PRESETS:
        return run_service_preset(args.preset, vars(args), ProgressBar())
    from dualblade.bench import (
        CgroupError,
        Sweep,
        aggregate,
        can_create_memory_cgroups,
        evaluate_claims,
        markdown_table,
        progress_fields,
        run_keeping,
        say_stopped,
        write_plots,
    )
    from dualblade.pipeline import config_from_mapping

    plan, label = _plan(args)
    # The shape does not depend on the policy; "dual" stands for all (flexgen is no pipeline
    # policy, and it may come first in --policies).
    config = config_from_mapping(Sweep(plan).pipeline_for("dual"), source=label, env={})
    shape = config.shape()
    working_set = int(shape.total_kv_bytes(config.workload.batch, config.workload.max_len))
    reason = can_create_memory_cgroups()
    if reason is not None:
        raise CgroupError(reason)

    sweep = Sweep(plan, progress=ProgressBar())
    started = datetime.datetime.now(datetime.UTC)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    planned = sweep.planned_runs()

    def report_of(records: list[dict[str, Any]], stopped: str | None) -> dict[str, Any]:
        results = aggregate(records)
        return {
            "kv_working_set_bytes": working_set,
            **progress_fields(len(records), planned, stopped),
            "results": results,
            "claims": evaluate_claims(results, working_set),
            "runs": records,
            "meta": {
                "sweep": label,
                "started": started.isoformat(timespec="seconds"),
                "host": platform.node(),
                "kernel": platform.release(),
                "policies": plan.policies,
                "limits_bytes": sorted(plan.limits),
                "decode_steps": plan.decode_steps,
                "repeats": plan.repeats,
                "runs_done": len(records),
                "runs_planned": planned,
                "pipeline": plan.pipeline,
                "command": " ".join(["dualblade", *sys.argv[1:]]) if len(sys.argv) > 1 else "",
            },
        }

    records, stopped, status = run_keeping(
        lambda keep: sweep.run(on_record=keep),
        lambda records, stopped: _write_report(out, report_of(records, stopped)),
        planned,
    )
    report = report_of(records, stopped)  # as written after the last run, or the stop
    table = markdown_table(report["results"])
    if records:
        write_plots(report["results"], out, working_set)
    if stopped is not None:
        say_stopped(stopped, out)
        return status
    claims = report["claims"]
    if args.json:
        print_json(report)
    else:
        print(table)
        print(f"claims: {'all met' if claims['all_ok'] else 'NOT all met'} (see {out}/results.md)")
        for entry in claims["floors"]["invalid"]:
            where = f"{entry['policy']} at {entry['limit_bytes'] / (1 << 30):.2f} GiB"
            print(f"invalid floor, {where}: {entry['why']}")
    return 0


def _write_report(out: Path, report: dict[str, Any]) -> None:
    """``results.json`` and ``results.md`` into ``out``, each replaced whole (a file killed
    half-written is never left)."""
    from dualblade.bench import markdown_table, write_whole

    table = markdown_table(report["results"])
    markdown = _markdown(report, table)
    write_whole(out, {"results.json": json.dumps(report, indent=1) + "\n", "results.md": markdown})


def _markdown(report: dict[str, Any], table: str) -> str:
    from dualblade.bench import progress_lines

    gib = 1 << 30
    claims = report["claims"]
    lines = [
        f"# dualblade bench — {report['meta']['sweep']}",
        "",
        *progress_lines(report),
        f"KV working set {report['kv_working_set_bytes'] / gib:.2f} GiB. Each run measured its "
        "own floor right after its decode (its own extents and resident files, the store's "
        "engine; docs/bench.md); a decode / floor ratio below 0.95 marks the floor invalid (✗): "
        "with repeats, the ratio of the medians, and the runs beaten alone are counted beside it.",
        "",
        table,
        "## Claims",
        "",
        "```json",
        json.dumps(claims, indent=1),
        "```",
        "",
        "![decode](decode.png) ![prefill](prefill.png) ![hit rate](hit_rate.png) "
        "![throughput](throughput.png)",
        "",
    ]
    return "\n".join(lines)
