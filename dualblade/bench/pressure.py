"""The pressure preset: one long decode, and midway memory taken from under it.

Three variants run, each in its own process and memory cgroup from a cold page cache
(:func:`.serving.run_in_cgroup`): ``dual`` with live re-planning, ``dual-static``
(``open_store(replan=False)``: contexts keep the share they were admitted with) and
``baseline``. Each prefills one context, then decodes; before the middle step a memory hog in
the worker (so in the same cgroup) takes a fixed share of the limit (or ``--squeeze limit``
lowers the cgroup's limit by it). See :mod:`.pressure_worker` for the run and
:mod:`.pressure_report` for the phases and the claim.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualblade.bench.cgroups import remove_stale_groups
from dualblade.bench.pressure_report import (
    VARIANTS,
    evaluate_pressure_claims,
    pressure_table,
    summarize_pressure_run,
)
from dualblade.bench.serving import MiB, run_in_cgroup, storage_for
from dualblade.errors import ConfigError

#: A 24-layer, 1024-wide fp16 model, batch 8, 1000 + 40 tokens: 780 MiB of KV, decoded for
#: 40 steps under a 1 GiB limit; the hog takes a quarter of the limit before step 20.
#:
#: Four copy threads, so the decode keeps four layers' reads in flight (``read_parallelism``).
#: After the squeeze dual's layers alternate between the paths; with two layers ahead the
#: device's next layer was requested only once the layer before it had been used, and the disk
#: idled between direct layers (1.3-1.4x the floor), with three the two direct layers in flight
#: often ended together (1.15-1.3x). docs/serving-bench.md has the measurements.
PRESSURE_PIPELINE: dict[str, Any] = {
    "model": {"num_layers": 24, "hidden_size": 1024, "num_heads": 16, "dtype": "float16"},
    "workload": {"batch": 8, "prompt_len": 1000, "max_new_tokens": 40},
    "copy_threads": 4,
    "queue_depth": 32,
    "max_chunk": "1MiB",
    "memory": {"limit": "auto", "safety_margin": "192MiB"},
}
PRESSURE_LIMIT = 1024 * MiB
SQUEEZE_SHARE = 0.25


@dataclass
class PressurePlan:
    """What the pressure bench runs."""

    pipeline: dict[str, Any]
    limit: int
    variants: list[str]
    decode_steps: int
    squeeze_step: int
    squeeze: dict[str, Any]
    work_dir: Path
    device: str | None = None
    keep_files: bool = False


def pressure_plan(
    *,
    work_dir: Path,
    limits: list[int] | None = None,
    variants: list[str] | None = None,
    steps: int | None = None,
    squeeze_kind: str = "hog",
    share: float = SQUEEZE_SHARE,
    device: str | None = None,
    keep_files: bool = False,
) -> PressurePlan:
    """The preset's plan with the user's overrides.

    Raises:
        ConfigError: more than one limit, an unknown variant, fewer than 4 steps, a share
            outside (0, 1), an unknown squeeze kind.
    """
    if limits is not None and len(limits) != 1:
        raise ConfigError("--memory-limits: the pressure preset runs at one limit")
    chosen = variants or list(VARIANTS)
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        raise ConfigError(f"unknown pressure variants {unknown} (known: {', '.join(VARIANTS)})")
    pipeline: dict[str, Any] = json.loads(json.dumps(PRESSURE_PIPELINE))
    decode_steps = steps or int(pipeline["workload"]["max_new_tokens"])
    if decode_steps < 4:
        raise ConfigError("--steps: the pressure preset needs at least 4 decode steps")
    pipeline["workload"]["max_new_tokens"] = max(decode_steps, 1)
    if not 0 < share < 1:
        raise ConfigError(f"the squeeze's share of the limit must be in (0, 1), got {share}")
    if squeeze_kind not in ("hog", "limit"):
        raise ConfigError(f"the squeeze is 'hog' or 'limit', got {squeeze_kind!r}")
    limit = limits[0] if limits else PRESSURE_LIMIT
    return PressurePlan(
        pipeline=pipeline,
        limit=limit,
        variants=chosen,
        decode_steps=decode_steps,
        squeeze_step=decode_steps // 2,
        squeeze={"kind": squeeze_kind, "bytes": int(share * limit) // 4096 * 4096},
        work_dir=work_dir,
        device=device,
        keep_files=keep_files,
    )


ProgressFn = Callable[[str, int, int], None]


def _noop(_label: str, _done: int, _total: int) -> None:
    return None


def run_pressure(
    plan: PressurePlan,
    progress: ProgressFn = _noop,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Each variant in its own cgroup; returns the run records, and hands each to
    ``on_record`` as its run ends (as :func:`.serving.run_serving` does)."""
    plan.work_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_groups()  # of an earlier run killed outright
    records = []
    try:
        for index, variant in enumerate(plan.variants):
            progress(variant, index, len(plan.variants))
            policy, replan = VARIANTS[variant]
            pipeline = json.loads(json.dumps(plan.pipeline))
            pipeline["policy"] = policy
            pipeline.setdefault("storage", storage_for(plan.work_dir))
            spec = {
                "config": pipeline,
                "decode_steps": plan.decode_steps,
                "squeeze_step": plan.squeeze_step,
                "squeeze": plan.squeeze,
                "replan": replan,
                "device": plan.device,
                "seed": index,
            }
            name = f"pressure-{index:02d}-{variant}"
            record = run_in_cgroup("pressure_worker", spec, plan.limit, name, plan.work_dir)
            record["variant"] = variant
            records.append(record)
            if on_record is not None:
                on_record(record)
        progress("done", len(plan.variants), len(plan.variants))
    finally:
        if not plan.keep_files:
            shutil.rmtree(plan.work_dir / "page-cache", ignore_errors=True)
            (plan.work_dir / "direct.kv").unlink(missing_ok=True)
    return records


def run_pressure_bench(
    options: Mapping[str, Any], progress: ProgressFn = _noop
) -> tuple[dict[str, Any], str, int]:
    """The pressure preset with the bench command's ``options`` (see
    :func:`.serving_command.run_service_preset`): writes the output folder (its results files
    again as each run ends); returns the results.json document, the markdown table and the
    exit status."""
    from dualblade.bench.pressure_plots import write_pressure_plots
    from dualblade.bench.serving_command import (
        PresetReport,
        need_cgroups,
        output_dir,
        parse_limits,
        parse_list,
        run_meta,
        run_reported,
        work_dir_for,
    )

    if options.get("repeats") not in (None, 1):
        raise ConfigError("--repeats: the pressure preset runs each variant once")
    plan = pressure_plan(
        work_dir=work_dir_for(options, "pressure"),
        limits=parse_limits(options.get("memory_limits")),
        variants=parse_list(options.get("policies")),
        steps=options.get("steps"),
        squeeze_kind=options.get("squeeze") or "hog",
        device=options.get("device"),
        keep_files=bool(options.get("keep_files")),
    )
    need_cgroups()
    planned = len(plan.variants)
    meta = run_meta(
        "pressure",
        {
            "variants": plan.variants,
            "limit_bytes": plan.limit,
            "decode_steps": plan.decode_steps,
            "squeeze_step": plan.squeeze_step,
            "squeeze": plan.squeeze,
            "pipeline": plan.pipeline,
        },
    )
    out = output_dir(options)
    squeeze = plan.squeeze
    intro = (
        f"One context decodes {plan.decode_steps} steps under {plan.limit / MiB:.0f} MiB; "
        f"before step {plan.squeeze_step} a {squeeze['kind']} takes "
        f"{squeeze['bytes'] / MiB:.0f} MiB. Phases: before the squeeze, its first "
        "2 s, after. The new floor: the last step's bytes at the rates the run's own storage "
        "gives after the decode, squeeze still on (docs/serving-bench.md)."
    )
    plots = "![steps](pressure_steps.png) ![ledger](pressure_ledger.png)"

    reporting = PresetReport(
        out=out,
        head={},
        meta=meta,
        planned=planned,
        results_of=lambda runs: [summarize_pressure_run(r) for r in runs],
        claims_of=evaluate_pressure_claims,
        table_of=pressure_table,
        intro=intro,
        plots=plots,
    )
    runs, report, table, status = run_reported(
        lambda keep: run_pressure(plan, progress, on_record=keep), reporting
    )
    if runs:
        write_pressure_plots(runs, report["results"], out)
    return report, table, status
