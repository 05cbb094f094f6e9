"""``dualblade bench --preset serving|pressure``: run a service preset, write its results.

The bench command hands these two presets here with its parsed options (a mapping of the
command's flags: ``out``, ``memory_limits``, ``policies``, ``steps``, ``requests``, ``work_dir``,
``device``, ``compute``, ``keep_files``, ``json``, and ``squeeze`` for the pressure preset);
each writes ``results.json`` (with a ``claims`` section whose ``all_ok`` holds only when every
rule does), ``results.md`` and PNG plots into ``out``. See docs/serving-bench.md.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualblade.bench.cgroups import CgroupError, can_create_memory_cgroups
from dualblade.bench.stops import (
    progress_fields,
    progress_lines,
    run_keeping,
    say_stopped,
    write_whole,
)
from dualblade.errors import ConfigError

SERVICE_PRESETS = ("serving", "pressure")

ProgressFn = Callable[[str, int, int], None]


def _noop(_label: str, _done: int, _total: int) -> None:
    return None


def parse_limits(text: str | None) -> list[int] | None:
    from dualblade.pipeline import parse_size

    if not text:
        return None
    return [parse_size(part) for part in text.split(",") if part.strip()]


def parse_list(text: str | None) -> list[str] | None:
    return [p.strip() for p in text.split(",") if p.strip()] if text else None


def work_dir_for(options: Mapping[str, Any], name: str) -> Path:
    from dualblade.pipeline import default_cache_dir

    given = options.get("work_dir")
    return Path(given) if given else default_cache_dir() / f"bench-{name}"


def run_meta(name: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "preset": name,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "command": " ".join(["dualblade", *sys.argv[1:]]) if len(sys.argv) > 1 else "",
        **extra,
    }


def run_serving_bench(
    options: Mapping[str, Any], progress: ProgressFn = _noop
) -> tuple[dict[str, Any], str, int]:
    """The serving preset with ``options``: writes the output folder (its results files again
    as each run ends); returns the results.json document, the markdown table and the exit
    status (see :func:`run_service_preset`)."""
    from dualblade.bench.serving import run_order, run_serving, serving_plan, storage_for
    from dualblade.bench.serving_plots import write_serving_plots
    from dualblade.bench.serving_report import (
        combine_repeats,
        evaluate_serving_claims,
        serving_table,
        summarize_run,
    )
    from dualblade.pipeline import config_from_mapping

    steps = options.get("steps")
    plan = serving_plan(
        work_dir=work_dir_for(options, "serving"),
        limits=parse_limits(options.get("memory_limits")),
        policies=parse_list(options.get("policies")),
        requests=options.get("requests"),
        new_tokens=None if steps is None else int(steps) + 1,
        device=options.get("device"),
        compute=options.get("compute"),
        keep_files=bool(options.get("keep_files")),
        repeats=options.get("repeats"),
    )
    need_cgroups()
    config = config_from_mapping(
        {**plan.pipeline, "storage": storage_for(plan.work_dir)}, source="serving", env={}
    )
    shape = config.shape()
    working_set = sum(shape.total_kv_bytes(r.batch, r.max_len) for r in plan.requests)
    planned = len(run_order(plan.policies, plan.limits, plan.repeats))
    meta = run_meta(
        "serving",
        {
            "policies": plan.policies,
            "limits_bytes": plan.limits,
            "repeats": plan.repeats,
            "pipeline": plan.pipeline,
            "compute": plan.compute,
        },
    )
    out = output_dir(options)
    reporting = PresetReport(
        out=out,
        head={
            "kv_working_set_bytes": working_set,
            "requests": [r.to_dict() for r in plan.requests],
        },
        meta=meta,
        planned=planned,
        results_of=lambda runs: combine_repeats([summarize_run(r) for r in runs]),
        claims_of=evaluate_serving_claims,
        table_of=serving_table,
        intro=_SERVING_INTRO,
        plots=_SERVING_PLOTS,
    )
    runs, report, table, status = run_reported(
        lambda keep: run_serving(plan, progress, on_record=keep), reporting
    )
    if runs:
        write_serving_plots(report["results"], runs, out)
    return report, table, status


_SERVING_INTRO = (
    "{n} requests (seeded Poisson arrivals, each its own batch and prompt) on one store per "
    "run, each run in its own memory cgroup; KV of all requests {ws}. Residency: the store's "
    "page-cache files sampled with mincore against the ledger's budget (docs/serving-bench.md)."
)
_SERVING_PLOTS = (
    "![tokens/s](serving_tokens.png) ![steps](serving_steps.png) ![TTFT](serving_ttft.png) "
    "![residency](serving_residency.png)"
)


Records = list[dict[str, Any]]
Results = list[dict[str, Any]]


@dataclass(frozen=True)
class PresetReport:
    """How a service preset turns its runs into its report: results, claims, table, and the
    page they go on (``out``/results.json and results.md)."""

    out: Path
    #: the report's first fields (the workload), ahead of ``complete``
    head: dict[str, Any]
    meta: dict[str, Any]
    planned: int
    results_of: Callable[[Records], Results]
    claims_of: Callable[[Results], dict[str, Any]]
    table_of: Callable[[Results], str]
    intro: str
    plots: str

    def of(self, runs: Records, stopped: str | None) -> tuple[dict[str, Any], str]:
        """The report of ``runs`` (all of them, or those before ``stopped``) and its table."""
        results = self.results_of(runs)
        report = {
            **self.head,
            **progress_fields(len(runs), self.planned, stopped),
            "results": results,
            "claims": self.claims_of(results),
            "runs": runs,
            "meta": {**self.meta, "runs_done": len(runs), "runs_planned": self.planned},
        }
        return report, self.table_of(results)

    def write(self, runs: Records, stopped: str | None) -> None:
        report, table = self.of(runs, stopped)
        page = markdown_page(report, table, self.intro, self.plots)
        write_whole(
            self.out, {"results.json": json.dumps(report, indent=1) + "\n", "results.md": page}
        )


def run_reported(
    run: Callable[[Callable[[dict[str, Any]], None]], object], reporting: PresetReport
) -> tuple[Records, dict[str, Any], str, int]:
    """``run(keep)`` through :func:`.stops.run_keeping`, the report written as each run ends
    (and when a signal stops them); returns the runs, the last report, its table and the exit
    status."""
    runs, stopped, status = run_keeping(run, reporting.write, reporting.planned)
    report, table = reporting.of(runs, stopped)  # as written after the last run, or the stop
    return runs, report, table, status


def output_dir(options: Mapping[str, Any]) -> Path:
    """The output folder of ``options`` (``--out``), made."""
    out = Path(options.get("out") or "bench-results")
    out.mkdir(parents=True, exist_ok=True)
    return out


def markdown_page(report: dict[str, Any], table: str, intro: str, plots: str) -> str:
    ws = report.get("kv_working_set_bytes")
    text = intro.format(
        n=len(report.get("requests", [])), ws="n/a" if ws is None else f"{ws / (1 << 30):.2f} GiB"
    )
    claims = report["claims"]
    verdict = "all met" if claims["all_ok"] else "NOT all met"
    lines = [f"# dualblade bench — preset {report['meta']['preset']}", ""]
    lines += [*progress_lines(report), text, "", table]
    lines += ["## Claims", "", f"**{verdict}**", ""]
    lines += [f"- {why}" for why in claims.get("failed", [])]
    lines += ["", "```json", json.dumps(claims, indent=1), "```", "", plots, ""]
    return "\n".join(lines)


def need_cgroups() -> None:
    reason = can_create_memory_cgroups()
    if reason is not None:
        raise CgroupError(reason)


def run_service_preset(name: str, options: Mapping[str, Any], progress: ProgressFn = _noop) -> int:
    """Run the preset ``name`` (``serving`` or ``pressure``), print its table and verdict (or
    the JSON with ``options["json"]``); returns the exit status (0: the claims are reported,
    not enforced, as the sweep's are; 130 or 143 where Ctrl-C or SIGTERM stopped the runs,
    whose finished ones are written: :func:`.stops.run_keeping`).

    Raises:
        ConfigError: an unknown preset or a bad option; CgroupError: no memory cgroups here.
    """
    if options.get("config"):
        raise ConfigError(f"--preset {name} takes no config file: its shape is the preset's")
    if options.get("trace"):
        raise ConfigError(f"--trace records a sweep's runs; --preset {name} does not take it")
    if name == "serving":
        report, table, status = run_serving_bench(options, progress)
    elif name == "pressure":
        from dualblade.bench.pressure import run_pressure_bench

        report, table, status = run_pressure_bench(options, progress)
    else:
        raise ConfigError(
            f"unknown service preset {name!r} (presets: {', '.join(SERVICE_PRESETS)})"
        )
    out = output_dir(options)
    if report["stopped"] is not None:
        say_stopped(report["stopped"], out)
        return status
    if options.get("json"):
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(table)
        for why in report["claims"].get("failed", []):
            print(f"- {why}")
    verdict = "all met" if report["claims"]["all_ok"] else "NOT all met"
    print(f"claims: {verdict} (see {out}/results.md)")
    return 0
