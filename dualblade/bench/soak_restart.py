"""The kill-restart soak: stores in child processes, killed at random moments and restarted.

Each child (:mod:`.soak_child`) runs the ordinary soak on the same scratch folder (direct file
and page-cache folder). The parent lets it run for a random while after its store opened, kills
it with SIGKILL mid-request, counts what it left (store folders and their page-cache files, and
the bytes that hold data in the direct file), and starts the next, whose store must reclaim
exactly that before it serves. The last child runs to the deadline and closes cleanly; after it
nothing may be left.

Accounting goes on across kills: a child reports its ledger as it goes, and at once after any
mismatch, unexpected error or swallowed fault, so a kill cannot hide one. What a killed child
did after its last report is lost to the counts (bytes verified, say); faults injected into
operations the kill cut short are reported as ``unaccounted_at_kill``, apart from those of the
last child, which must all be accounted.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream

from dualblade.bench.soak_ledger import Ledger
from dualblade.bench.soak_options import SoakOptions, options_to_json
from dualblade.io_engine import DirectFile
from dualblade.testing import FaultKind

Progress = Callable[[str], None]

#: The longest a child may take to open its store (importing torch is most of it).
STARTUP_LIMIT_S = 120.0
#: Seconds between a child's reports.
CHILD_SAMPLE_S = 0.25
#: The page-cache files' lock, not counted as a file a dead store left.
_LOCK_NAME = "owner.lock"


@dataclass(frozen=True)
class Leftovers:
    """What a store that is gone left in the scratch folder."""

    folders: int  # store folders (page-cache folders of stores)
    files: int  # page-cache files in them
    direct_bytes: int  # bytes of the direct file that hold data

    def any(self) -> bool:
        return bool(self.folders or self.files or self.direct_bytes)


def leftovers(folder: Path) -> Leftovers:
    """Count what the stores that used ``folder`` left in it.

    Takes the direct file's lock first: a killed child's io_uring holds the file until the
    kernel has reaped its in-flight I/O, which may still land.
    """
    folders = files = direct_bytes = 0
    direct = folder / "direct.kv"
    if direct.exists():
        target = DirectFile(direct, 0)
        try:
            target.lock_exclusive(wait_s=10.0)
            direct_bytes = sum(n for _, n in target.allocated_ranges(0, target.size))
        finally:
            target.close()
    for entry in folder.iterdir():
        if entry.is_dir() and entry.name.startswith(("store-", ".starting-store-")):
            folders += 1
            files += sum(1 for p in entry.rglob("*") if p.is_file() and p.name != _LOCK_NAME)
    return Leftovers(folders, files, direct_bytes)


@dataclass
class ChildRun:
    """One child, as the parent saw it."""

    index: int
    left_before: Leftovers
    pid: int | None = None
    reclaimed: dict[str, Any] | None = None
    snapshot: dict[str, Any] | None = None
    document: dict[str, Any] | None = None
    killed_after_s: float | None = None
    exit_code: int | None = None
    stderr_tail: str = ""
    problems: list[str] = field(default_factory=list)

    def check_reclaim(self) -> None:
        """Its store must have reclaimed exactly what the one before it left."""
        if self.reclaimed is None:
            return
        left, got = self.left_before, self.reclaimed
        found = Leftovers(got["store_folders"], got["files"], got["direct_bytes"])
        if found != left:
            self.problems.append(f"child {self.index} reclaimed {found}, but {left} was left")


async def _run_child(
    options: SoakOptions,
    folder: Path,
    run: ChildRun,
    deadline: float,
    kill_after: float,
) -> None:
    """Start one child, kill it ``kill_after`` s after its store opened (unless that is past
    ``deadline``: then it runs to the end), and record its reports."""
    command = [
        sys.executable,
        "-m",
        "dualblade.bench.soak_child",
        json.dumps(options_to_json(options)),
        str(folder),
        repr(deadline),
    ]
    with tempfile.TemporaryFile() as stderr:
        process = await anyio.open_process(command, stderr=stderr)
        started = anyio.Event()
        assert process.stdout is not None
        reader = BufferedByteReceiveStream(process.stdout)

        async def read_reports() -> None:
            while True:
                try:
                    line = await reader.receive_until(b"\n", 64 << 20)
                except (anyio.EndOfStream, anyio.IncompleteRead):
                    started.set()  # ended, perhaps before its store opened: stop waiting
                    return
                report = json.loads(line)
                event = report.pop("event")
                if event == "started":
                    run.pid, run.reclaimed = report["pid"], report["reclaimed"]
                    started.set()
                elif event == "snapshot":
                    run.snapshot = report
                elif event == "finished":
                    run.document = report["document"]

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(read_reports)
                with anyio.move_on_after(STARTUP_LIMIT_S):
                    await started.wait()
                if run.pid is None:
                    run.problems.append(f"child {run.index} did not open its store")
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                elif time.monotonic() + kill_after < deadline:
                    await anyio.sleep(kill_after)
                    with contextlib.suppress(ProcessLookupError):  # it may have just ended
                        process.send_signal(signal.SIGKILL)
                        run.killed_after_s = kill_after
        finally:
            with anyio.CancelScope(shield=True):
                run.exit_code = await process.wait()
                await process.aclose()
            if run.exit_code != -signal.SIGKILL:  # it ended by itself just before the kill
                run.killed_after_s = None
        stderr.seek(0)
        run.stderr_tail = stderr.read().decode(errors="replace")[-2000:]
    if run.killed_after_s is None and run.document is None:
        run.problems.append(f"child {run.index} ended (exit {run.exit_code}) without its report")


async def run_kill_restart(
    options: SoakOptions, folder: Path, progress: Progress | None = None
) -> dict[str, Any]:
    """Run the kill-restart soak in ``folder`` (which the caller removes); returns its
    document (``ok`` says whether it passed)."""
    rng = random.Random(options.seed)
    start = time.monotonic()
    deadline = start + options.seconds
    runs: list[ChildRun] = []
    while True:
        left = await anyio.to_thread.run_sync(leftovers, folder)
        run = ChildRun(len(runs), left)
        runs.append(run)
        child_options = replace(options, seed=options.seed + 7919 * run.index)
        child_options = replace(child_options, sample_s=CHILD_SAMPLE_S, kill_restart=False)
        kill_after = rng.uniform(*options.restart_after_s)
        await _run_child(child_options, folder, run, deadline, kill_after)
        run.check_reclaim()
        if progress is not None:
            progress(_progress_line(run, time.monotonic() - start))
        if run.killed_after_s is None or run.problems:
            break
    after = await anyio.to_thread.run_sync(leftovers, folder)
    return restart_document(options, runs, after, time.monotonic() - start)


def _progress_line(run: ChildRun, elapsed: float) -> str:
    got = run.reclaimed or {}
    fate = (
        f"killed after {run.killed_after_s:.1f} s"
        if run.killed_after_s is not None
        else f"ended (exit {run.exit_code})"
    )
    return (
        f"{elapsed:7.1f} s  child {run.index} (pid {run.pid}): reclaimed {got.get('files', 0)} "
        f"files, {got.get('bytes', 0) / 2**20:.2f} MiB; {fate}"
        + (f"; {'; '.join(run.problems)}" if run.problems else "")
    )


def restart_document(
    options: SoakOptions, runs: list[ChildRun], after: Leftovers, elapsed: float
) -> dict[str, Any]:
    """The kill-restart soak's report and verdict."""
    ledger = Ledger()
    injected: Counter[str] = Counter()
    at_kill: Counter[str] = Counter()
    for run in runs:
        if run.snapshot is None:
            continue
        ledger.add(run.snapshot["ledger"])
        injected.update(run.snapshot["injected"])
        if run.killed_after_s is not None:
            child = Ledger()
            child.add(run.snapshot["ledger"])
            attributed = child.attributed()
            for kind, count in run.snapshot["injected"].items():
                at_kill[kind] += count - attributed.get(kind, 0)
    final = runs[-1]
    final_doc = final.document or {}
    problems = [problem for run in runs for problem in run.problems]
    restarts = sum(run.killed_after_s is not None for run in runs)
    if restarts == 0:
        problems.append("no child was killed: run longer, or lower --restart-after")
    if after.any():
        problems.append(f"the last store, closed cleanly, left {after}")
    final_faults = final_doc.get("faults", {})
    faults_ok = (
        not ledger.swallowed and not ledger.unexpected_count and bool(final_faults.get("accounted"))
    )
    reclaimed = [run.reclaimed for run in runs[1:] if run.reclaimed is not None]
    rss = [run.snapshot["rss_bytes"] for run in runs if run.snapshot is not None]
    pressure = _pressure(options, runs)
    if pressure is not None and not pressure["ok"]:
        problems.append(f"a squeeze went wrong: {pressure}")
    ok = not problems and ledger.mismatches == 0 and faults_ok and bool(final_doc.get("ok"))
    hard = {k.value for k in FaultKind if k.hard}
    return {
        "ok": ok,
        "mode": "kill-restart",
        "seconds": round(elapsed, 1),
        "contexts": options.contexts,
        "seed": options.seed,
        "policy": options.policy,
        "fault_rate": options.fault_rate,
        "cancel_rate": options.cancel_rate,
        "restarts": restarts,
        "children": len(runs),
        "problems": problems,
        "operations": dict(ledger.ops),
        "contexts_opened": ledger.contexts,
        "bytes_written": ledger.bytes_written,
        "bytes_verified": ledger.bytes_verified,
        "mismatches": ledger.mismatches,
        "mismatch_examples": ledger.mismatch_examples,
        "cancellations": ledger.cancellations,
        "errors_by_type": dict(ledger.errors),
        "lost_layer_refusals": ledger.lost_refusals,
        "full_disk": {"enabled": options.full_disk, "no_room_errors": dict(ledger.full_disk)},
        "pressure": pressure,
        "reclaim": {
            "reclaimed_bytes": sum(r["bytes"] for r in reclaimed),
            "reclaimed_files": sum(r["files"] for r in reclaimed),
            "reclaimed_store_folders": sum(r["store_folders"] for r in reclaimed),
            "reclaimed_direct_bytes": sum(r["direct_bytes"] for r in reclaimed),
            "reclaimed_direct_extents": sum(r["direct_extents"] for r in reclaimed),
            "seconds_max": max((r["seconds"] for r in reclaimed), default=0.0),
            "left_after_last_store": vars(after),
        },
        "faults": {
            "injected": dict(injected),
            "injected_hard": sum(n for kind, n in injected.items() if kind in hard),
            "surfaced": dict(ledger.surfaced),
            "coalesced_into_one_error": dict(ledger.coalesced),
            "during_cancellation": dict(ledger.during_cancel),
            "absorbed_short_or_slow": dict(ledger.absorbed),
            "swallowed": dict(ledger.swallowed),
            "unaccounted_at_kill": {k: n for k, n in at_kill.items() if n},
            "last_child_unattributed": final_faults.get("unattributed"),
            "unexpected_errors": ledger.unexpected_count,
            "unexpected_examples": ledger.unexpected,
            "accounted": faults_ok,
        },
        "memory": {
            "child_rss_bytes": rss,
            "rss_growth_first_to_last": round((rss[-1] - rss[0]) / rss[0], 4) if rss else None,
            "rss_growth_checked": False,  # each child starts afresh; see the plain soak
        },
        "leaks": final_doc.get("leaks", {}),
        "children_detail": [
            {
                "pid": run.pid,
                "killed_after_s": run.killed_after_s,
                "exit_code": run.exit_code,
                "left_before": vars(run.left_before),
                "reclaimed": run.reclaimed,
                **({"stderr_tail": run.stderr_tail} if run.problems else {}),
            }
            for run in runs
        ],
    }


def _pressure(options: SoakOptions, runs: list[ChildRun]) -> dict[str, Any] | None:
    """--pressure over all children: their last reports added up."""
    if not options.pressure:
        return None
    reports = [r.snapshot["pressure"] for r in runs if r.snapshot and r.snapshot.get("pressure")]
    total: dict[str, Any] = {
        key: sum(report[key] for report in reports)
        for key in ("budget_changes", "demotions", "promotions", "failed_moves")
    }
    total["over_budget_after_moves"] = [
        line for report in reports for line in report["over_budget_after_moves"]
    ][:10]
    total["ok"] = all(report["ok"] for report in reports) and total["budget_changes"] > 0
    return total
