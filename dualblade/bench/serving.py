"""The serving preset: many requests on one store per run, policies × memory limits.

Each (policy, limit) run is a process of its own (:mod:`.serving_worker`) in a fresh memory
cgroup, started from a cold page cache, serving the same seeded requests
(:mod:`.serving_requests`) on one store: staggered arrivals, each a prefill then decode steps,
all in flight at once. Every (policy, limit) runs :data:`SERVING_REPEATS` times by default and
the report takes medians (:func:`dualblade.bench.serving_report.combine_repeats`). Limits
ascend; at each limit the policies take turns, their order rotating from round to round and
from limit to limit, so the disk's drift hits each alike. A run the OOM killer ends is recorded
with its count.

:func:`run_in_cgroup` is the isolation both service presets use (the pressure preset too).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dualblade.bench.cgroups import create_memory_cgroup, remove_stale_groups, run_group_name
from dualblade.bench.page_cache import drop_page_cache
from dualblade.bench.serving_requests import RequestSpec, draw_requests
from dualblade.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20

#: As the sweep's workers: a fixed mmap threshold keeps freed layer-sized tensors out of the
#: heap (else a run's anonymous memory drifts and its budget with it); two malloc arenas.
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_ARENA_MAX": "2"}
RUN_TIMEOUT_S = 1800.0
SERVING_POLICIES: tuple[str, ...] = ("baseline", "cache-policy", "direct", "dual")
KNOWN_POLICIES = frozenset({"baseline", "cache-policy", "direct", "dual", "page-cache"})

#: The preset: a 24-layer, 1024-wide fp16 model; six requests of batch 6-8 and 384-504-token
#: prompts, 12 new tokens each, arriving at 6 per second: 1.65 GiB of KV in all. At 1 GiB the
#: baseline's page cache held what was decoding at once (hit rate 0.92-0.98: prefills wait
#: behind decode, so 2-3 requests decode together), so the limits are 640 and 768 MiB, where
#: it is in its cliff (hit rate 0.25-0.6) and no policy was OOM-killed.
SERVING_PIPELINE: dict[str, Any] = {
    "model": {"num_layers": 24, "hidden_size": 1024, "num_heads": 16, "dtype": "float16"},
    "workload": {"batch": 8, "prompt_len": 504, "max_new_tokens": 12},
    "copy_threads": 2,
    "queue_depth": 32,
    "max_chunk": "1MiB",
    "memory": {"limit": "auto", "safety_margin": "192MiB"},
}
SERVING_REQUESTS: dict[str, Any] = {
    "count": 6,
    "rate": 6.0,
    "batches": (6, 7, 8),
    "prompt_min": 384,
    "prompt_max": 504,
    "new_tokens": 12,
}
SERVING_LIMITS: tuple[int, ...] = (640 * MiB, 768 * MiB)
#: Runs of each (policy, limit). One run each made the claims a coin toss: on this VM's disk
#: direct's tokens/s moved 24.7-37.4 and the baseline's 18.3-24.7 between invocations of one
#: tree (docs/serving-bench.md), while the claims compare dual with them at 1.0x and 1.5x.
SERVING_REPEATS = 3


@dataclass
class ServingPlan:
    """What a serving bench runs: the store's pipeline, the requests, limits and policies."""

    pipeline: dict[str, Any]
    requests: list[RequestSpec]
    limits: list[int]
    policies: list[str]
    work_dir: Path
    device: str | None = None
    compute: dict[str, Any] | None = None
    keep_files: bool = False
    seed: int = 0
    repeats: int = 1
    label: str = "preset serving"
    extra: dict[str, Any] = field(default_factory=dict)


def serving_plan(
    *,
    work_dir: Path,
    limits: list[int] | None = None,
    policies: list[str] | None = None,
    requests: int | None = None,
    new_tokens: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    device: str | None = None,
    compute: str | None = None,
    keep_files: bool = False,
    repeats: int | None = None,
) -> ServingPlan:
    """The preset's plan with the user's overrides (``repeats``: default
    :data:`SERVING_REPEATS`).

    ``compute``: an OPT preset (random weights) whose shape the store takes and whose engine
    serves the requests instead of synthetic traffic.

    Raises:
        ConfigError: an unknown policy, no limit, fewer than one repeat, or a request shape the
            store cannot hold.
    """
    repeats = SERVING_REPEATS if repeats is None else repeats
    if repeats < 1:
        raise ConfigError(f"--repeats: at least 1 run per (policy, limit), got {repeats}")
    pipeline: dict[str, Any] = json.loads(json.dumps(SERVING_PIPELINE))
    knobs = dict(SERVING_REQUESTS)
    if new_tokens is not None:
        knobs["new_tokens"] = new_tokens
        pipeline["workload"]["max_new_tokens"] = new_tokens
    compute_spec = None
    if compute:
        pipeline["model"] = {"preset": compute}
        gpu = (device or "").startswith("cuda")
        compute_spec = {"preset": compute, "dtype": "float16" if gpu else "float32"}
        pipeline["copy_threads"] = 4 if gpu else pipeline["copy_threads"]
    specs = draw_requests(
        requests or knobs["count"],
        seed=seed,
        rate=rate or knobs["rate"],
        batches=knobs["batches"],
        prompt_min=knobs["prompt_min"],
        prompt_max=knobs["prompt_max"],
        new_tokens=knobs["new_tokens"],
    )
    plan = ServingPlan(
        pipeline=pipeline,
        requests=specs,
        limits=sorted(limits or list(SERVING_LIMITS)),
        policies=policies or list(SERVING_POLICIES),
        work_dir=work_dir,
        device=device,
        compute=compute_spec,
        keep_files=keep_files,
        seed=seed,
        repeats=repeats,
    )
    check_policies(plan.policies, plan.limits)
    return plan


def check_policies(policies: list[str], limits: list[int]) -> None:
    """Raises ConfigError for no limit, no policy or an unknown policy."""
    if not limits:
        raise ConfigError("--memory-limits: give at least one limit")
    if not policies:
        raise ConfigError("--policies: give at least one policy")
    unknown = sorted(set(policies) - KNOWN_POLICIES)
    if unknown:
        raise ConfigError(
            f"unknown policies {unknown} (known: {', '.join(sorted(KNOWN_POLICIES))})"
        )


def run_order(
    policies: list[str], limits: list[int], repeats: int = 1
) -> list[tuple[int, str, int]]:
    """``(limit, policy, repeat)``: limits ascending; at each limit ``repeats`` rounds of every
    policy, the order rotated by one from round to round and from limit to limit."""
    order: list[tuple[int, str, int]] = []
    for turn, limit in enumerate(sorted(limits)):
        for repeat in range(repeats):
            k = (turn + repeat) % len(policies)
            order.extend((limit, policy, repeat) for policy in policies[k:] + policies[:k])
    return order


def storage_for(work_dir: Path) -> dict[str, Any]:
    """The runs' storage: page-cache files and a direct file under ``work_dir``."""
    return {
        "page_cache_dir": str(work_dir / "page-cache"),
        "direct": {"kind": "file", "path": str(work_dir / "direct.kv")},
    }


def run_in_cgroup(
    worker: str, spec: dict[str, Any], limit: int, name: str, work_dir: Path
) -> dict[str, Any]:
    """Run ``python -m dualblade.bench.<worker> SPEC`` in a fresh cgroup limited to ``limit``,
    from a cold page cache; returns the worker's JSON with ``limit_bytes``, ``wall_s``,
    ``oom_kills``, ``cgroup_peak_bytes`` and ``error`` when it failed.

    Raises:
        CgroupError: no memory cgroup can be made here.
    """
    run_dir = work_dir / "runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    out, spec_path = run_dir / f"{name}.json", run_dir / f"{name}-spec.json"
    out.unlink(missing_ok=True)
    how = drop_page_cache([work_dir / "page-cache", work_dir / "direct.kv"])
    # the group is removed on leaving the block, whatever ends it (Ctrl-C too)
    with create_memory_cgroup(run_group_name(name), limit) as group:
        spec = {**spec, "cgroup_procs": str(group.path / "cgroup.procs"), "out": str(out)}
        spec_path.write_text(json.dumps(spec))
        started = time.perf_counter()
        try:
            completed = subprocess.run(
                [sys.executable, "-m", f"dualblade.bench.{worker}", str(spec_path)],
                env={**os.environ, **WORKER_ENV},
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
                check=False,
            )
            returncode, stderr = completed.returncode, completed.stderr
        except subprocess.TimeoutExpired as expired:
            returncode, stderr = -9, f"timed out after {expired.timeout} s"
        wall = time.perf_counter() - started
        kills = group.oom_kills()
        peak = group.peak_bytes()
    record: dict[str, Any] = {}
    if out.exists():
        record.update(json.loads(out.read_text()))
    record.update(
        limit_bytes=limit,
        wall_s=round(wall, 3),
        oom_kills=kills,
        cgroup_peak_bytes=peak,
        cache_drop=how,
    )
    if returncode != 0 and "error" not in record:
        reason = "killed by the OOM killer" if kills else f"exit status {returncode}"
        tail = stderr.strip().splitlines()[-5:]
        record["error"] = f"{reason}: {' | '.join(tail)}"
    return record


ProgressFn = Callable[[str, int, int], None]


def _noop(_label: str, _done: int, _total: int) -> None:
    return None


def run_serving(
    plan: ServingPlan,
    progress: ProgressFn = _noop,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every (policy, limit) of ``plan`` in its own cgroup; returns the run records, and hands
    each to ``on_record`` as its run ends (a caller that writes its report then keeps the runs
    that finished when a later one is stopped)."""
    plan.work_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_groups()  # of an earlier run killed outright
    order = run_order(plan.policies, plan.limits, plan.repeats)
    records = []
    try:
        for index, (limit, policy, repeat) in enumerate(order):
            progress(f"{policy}@{limit >> 20}MiB", index, len(order))
            pipeline = json.loads(json.dumps(plan.pipeline))
            pipeline["policy"] = policy
            pipeline.setdefault("storage", storage_for(plan.work_dir))
            spec = {
                "config": pipeline,
                "requests": [r.to_dict() for r in plan.requests],
                "device": plan.device,
                "compute": plan.compute,
                "seed": plan.seed,
            }
            name = f"serving-{index:02d}-{policy}"
            record = run_in_cgroup("serving_worker", spec, limit, name, plan.work_dir)
            record.update(policy=policy, limit_bytes=limit, repeat=repeat)
            records.append(record)
            if on_record is not None:
                on_record(record)
        progress("done", len(order), len(order))
    finally:
        if not plan.keep_files:
            shutil.rmtree(plan.work_dir / "page-cache", ignore_errors=True)
            (plan.work_dir / "direct.kv").unlink(missing_ok=True)
    return records
