"""The memory-limit sweep: every (policy, limit) run in its own memory cgroup, interleaved.

For each repeat and each limit (ascending) the sweep runs each policy once, in an order rotated
from limit to limit and repeat to repeat so that the disk's drift hits every policy alike. Each
run:

1. gets a fresh memory cgroup limited to the limit under test;
2. starts from a cold page cache (``sync`` + ``drop_caches`` as root; otherwise
   ``fadvise(DONTNEED)`` of the sweep's files);
3. is a separate process (:mod:`dualblade.bench.sweep_worker`) that joins the group before it
   imports torch, opens a store whose budgeter discovers the limit, runs the KV workload, and
   measures its own decode floor right after its decode (:mod:`dualblade.bench.floor`).

A run that fails (the kernel's OOM killer, an error) is recorded with its reason; the sweep goes
on. Each finished run is handed to ``on_record`` as it ends, so a sweep stopped part way (a
timeout, Ctrl-C) still leaves the runs it finished. Records of repeated runs are reduced to their
medians.
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
from dualblade.errors import ConfigError

#: glibc's malloc raises its mmap threshold each time a large block is freed, after which blocks
#: of tens of MiB (a layer's K and V) come from the heap and stay resident when freed: the
#: process's anonymous memory then drifts by hundreds of MiB from run to run, and with it the
#: page-cache budget a run derives. A fixed threshold keeps large blocks in mmap, returned on
#: free. ``MALLOC_ARENA_MAX`` bounds the per-thread arenas of the worker threads.
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_ARENA_MAX": "2"}

#: How long one run may take before it is killed (the paper preset's runs take minutes).
RUN_TIMEOUT_S = 3600.0


@dataclass
class SweepPlan:
    """What to run: a validated pipeline mapping plus the sweep's own knobs."""

    pipeline: dict[str, Any]
    limits: list[int]
    policies: list[str]
    decode_steps: int
    repeats: int
    work_dir: Path
    device: str | None = None
    verify: str = "sample"
    keep_files: bool = False
    label: str = "custom"
    #: Real inference instead of synthetic KV traffic: ``{"preset": "opt-6.7b", "dtype": ...}``.
    compute: dict[str, Any] | None = None
    #: Where each pipeline run writes its trace (FlexGen's runs have none); None: no tracing.
    trace_dir: Path | None = None
    extra_meta: dict[str, Any] = field(default_factory=dict)


ProgressFn = Callable[[str, int, int], None]
#: Called with each run's record as soon as the run ends (see the module).
RecordFn = Callable[[dict[str, Any]], None]


def _noop(_label: str, _done: int, _total: int) -> None:
    return None


def run_order(policies: list[str], limits: list[int], repeats: int) -> list[tuple[int, int, str]]:
    """``(repeat, limit, policy)`` in run order: limits ascending, policies rotated by one at
    every limit and repeat so each policy runs first, second, ... equally often."""
    order: list[tuple[int, int, str]] = []
    turn = 0
    for repeat in range(repeats):
        for limit in sorted(limits):
            rotated = policies[turn % len(policies) :] + policies[: turn % len(policies)]
            order.extend((repeat, limit, policy) for policy in rotated)
            turn += 1
    return order


class Sweep:
    """Runs a :class:`SweepPlan` and returns the raw run records."""

    def __init__(self, plan: SweepPlan, progress: ProgressFn = _noop) -> None:
        self.plan = plan
        self.progress = progress
        self.page_cache_dir = plan.work_dir / "page-cache"
        self.direct_path = plan.work_dir / "direct.kv"

    def pipeline_for(self, policy: str) -> dict[str, Any]:
        """The run's pipeline mapping: the plan's, with the policy and the sweep's storage."""
        data: dict[str, Any] = json.loads(json.dumps(self.plan.pipeline))
        data["policy"] = policy
        storage = data.setdefault("storage", {})
        storage.setdefault("page_cache_dir", str(self.page_cache_dir))
        storage.setdefault("direct", {"kind": "file", "path": str(self.direct_path)})
        return data

    def device_path(self, pipeline: dict[str, Any]) -> str:
        """The direct target, or its nearest existing folder: its device's counters are read."""
        direct = pipeline["storage"]["direct"]
        path = Path(direct.get("path", self.direct_path))
        while not path.exists() and path != path.parent:
            path = path.parent
        return str(path)

    def planned_runs(self) -> int:
        """How many runs :meth:`run` makes."""
        return len(run_order(self.plan.policies, self.plan.limits, self.plan.repeats))

    def run(self, on_record: RecordFn | None = None) -> list[dict[str, Any]]:
        """Every run of the plan, in :func:`run_order`; each record also goes to ``on_record``
        as its run ends. The sweep's files are removed at the end, or when it is stopped."""
        plan = self.plan
        plan.work_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_groups()  # of an earlier sweep killed outright
        order = run_order(plan.policies, plan.limits, plan.repeats)
        records: list[dict[str, Any]] = []
        try:
            for index, (repeat, limit, policy) in enumerate(order):
                self.progress(f"{policy}@{limit >> 20}MiB", index, len(order))
                record = self._one(index, repeat, limit, policy)
                records.append(record)
                if on_record is not None:
                    on_record(record)
            self.progress("done", len(order), len(order))
        finally:
            if not plan.keep_files:
                shutil.rmtree(self.page_cache_dir, ignore_errors=True)
                shutil.rmtree(plan.work_dir / "flexgen", ignore_errors=True)
                if self.direct_path.exists():
                    self.direct_path.unlink()
        return records

    def _one(self, index: int, repeat: int, limit: int, policy: str) -> dict[str, Any]:
        plan = self.plan
        pipeline = self.pipeline_for(policy)
        run_dir = plan.work_dir / "runs"
        run_dir.mkdir(exist_ok=True)
        out = run_dir / f"{index:03d}-{policy}-{limit}.json"
        spec_path = run_dir / f"{index:03d}-spec.json"
        trace = None
        if plan.trace_dir is not None and policy != "flexgen":
            trace = plan.trace_dir / f"{index:03d}-{policy}-{limit >> 20}MiB-r{repeat}.json"
        how = drop_page_cache([self.page_cache_dir, self.direct_path])
        # the group is removed on leaving the block, whatever ends it (a signal too)
        with create_memory_cgroup(run_group_name(f"bench-{index:03d}"), limit) as group:
            spec = {
                "compute": plan.compute,
                "offload_dir": str(plan.work_dir / "flexgen"),
                "config": pipeline,
                "decode_steps": plan.decode_steps,
                "cgroup_procs": str(group.path / "cgroup.procs"),
                "device": plan.device,
                "device_path": self.device_path(pipeline),
                "verify": plan.verify,
                "out": str(out),
                "seed": index,
            }
            if trace is not None:
                spec["trace"] = str(trace)
            spec_path.write_text(json.dumps(spec))
            started = time.perf_counter()
            worker = "flexgen_peer" if policy == "flexgen" else "sweep_worker"
            completed = subprocess.run(
                [sys.executable, "-m", f"dualblade.bench.{worker}", str(spec_path)],
                env={**os.environ, **WORKER_ENV},
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
                check=False,
            )
            wall = time.perf_counter() - started
            oom = group.oom_kills()
            peak = group.peak_bytes()
        record: dict[str, Any] = {
            "policy": policy,
            "limit_bytes": limit,
            "repeat": repeat,
            "wall_s": round(wall, 3),
            "cache_drop": how,
            "cgroup_peak_bytes": peak,
        }
        if out.exists():
            record.update(json.loads(out.read_text()))
        if trace is not None and trace.exists():
            record["trace"] = str(trace)
        if completed.returncode != 0 and "error" not in record:
            reason = "killed by the OOM killer" if oom else f"exit status {completed.returncode}"
            tail = completed.stderr.strip().splitlines()[-5:]
            record["error"] = f"{reason}: {' | '.join(tail)}"
        return record


def check_plan(plan: SweepPlan) -> None:
    """Refuse a sweep that cannot mean anything before a minute is spent on it.

    Raises:
        ConfigError: no limits or policies, an unknown policy, no decode step.
    """
    known = {"baseline", "cache-policy", "direct", "dual", "page-cache", "flexgen"}
    if not plan.limits:
        raise ConfigError("--memory-limits: give at least one limit")
    if not plan.policies:
        raise ConfigError("--policies: give at least one policy")
    unknown = [p for p in plan.policies if p not in known]
    if unknown:
        raise ConfigError(f"unknown policies {unknown} (known: {', '.join(sorted(known))})")
    if plan.decode_steps < 1:
        raise ConfigError("the sweep needs at least one decode step")
    if plan.repeats < 1:
        raise ConfigError("--repeats must be at least 1")
    if plan.trace_dir is not None and plan.trace_dir.exists() and not plan.trace_dir.is_dir():
        raise ConfigError(f"--trace {plan.trace_dir} is a file: name a folder for the traces")
