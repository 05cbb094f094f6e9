"""The start and end of a bench worker process: join the run's memory cgroup, run, report.

Each (policy, limit) of a sweep, serving or pressure run is a fresh process in a fresh memory
cgroup. It joins the cgroup before it loads anything heavy (so torch, the model and the KV are
charged there), runs its spec, and writes its report, or the error that stopped it, as JSON to
the spec's ``out`` for the parent to read. Light imports only here, for that reason.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

RunSpec = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def join_cgroup(spec: dict[str, Any]) -> None:
    """Move this process into the run's cgroup (the spec's ``cgroup_procs``), if it has one."""
    procs = spec.get("cgroup_procs")
    if procs:
        Path(procs).write_text(str(os.getpid()))


def run_worker(run_spec: RunSpec, argv: list[str] | None = None) -> int:
    """``python -m dualblade.bench.<worker> SPEC.json``: 0 with the report written, 1 with
    the error written in its place (a :class:`~dualblade.errors.DualbladeError`)."""
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    join_cgroup(spec)
    from dualblade import event_loop
    from dualblade.errors import DualbladeError

    try:
        report = event_loop.run(run_spec, spec)
    except DualbladeError as error:
        Path(spec["out"]).write_text(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        return 1
    Path(spec["out"]).write_text(json.dumps(report))
    return 0
