"""The soak's verdict: its JSON document, and which checks make it pass.

It passes when no byte mismatched, every injected fault was accounted to an operation (and none
swallowed, no unexpected error), nothing leaked (fds, threads, busy or open buffers, held extents
or files, pinned memory), and, for runs of two minutes or more, resident memory grew less than
``max_rss_growth`` from the first window to the last. A full-disk run must also have met the
full disk (ENOSPC nobody injected, accounted to the operation that met it).
"""

from __future__ import annotations

from typing import Any

from dualblade.bench.soak_disk import full_disk_bytes
from dualblade.bench.soak_ledger import Ledger
from dualblade.bench.soak_memory import MemorySampler
from dualblade.bench.soak_options import SoakOptions
from dualblade.testing import FaultKind


def soak_document(
    options: SoakOptions,
    ledger: Ledger,
    injected: dict[str, int],
    sampler: MemorySampler,
    sample_s: float,
    elapsed: float,
    leaks: dict[str, Any],
    pressure: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report; ``injected`` counts faults by kind, ``leaks`` what was left afterwards."""
    attributed = ledger.attributed()
    unattributed = {
        kind.value: injected.get(kind.value, 0) - attributed.get(kind.value, 0)
        for kind in FaultKind
    }
    faults_ok = (
        not any(unattributed.values()) and not ledger.swallowed and not ledger.unexpected_count
    )
    width, windows = sampler.windows(options.seconds, slack=sample_s * 0.5)
    growth = None
    if len(windows) >= 2:
        first = windows[0]["rss_bytes"]
        growth = (windows[-1]["rss_bytes"] - first) / first
    growth_checked = options.seconds >= 120 and growth is not None
    growth_ok = not growth_checked or (growth is not None and growth < options.max_rss_growth)
    leaks_ok = not (
        leaks["fds"]
        or leaks["threads"]
        or leaks["buffers_busy_or_open"]
        or leaks["extents_held"]
        or leaks["files_held"]
        or leaks["pinned_bytes_after"] > leaks["pinned_bytes_before"]
        or leaks.get("ledger_placed_bytes", 0)
    )
    # A full-disk run that never found the disk full tested nothing.
    full_disk_ok = not options.full_disk or sum(ledger.full_disk.values()) > 0
    pressure_ok = pressure is None or bool(pressure["ok"])
    ok = (
        ledger.mismatches == 0
        and faults_ok
        and leaks_ok
        and growth_ok
        and full_disk_ok
        and pressure_ok
    )
    hard = [k.value for k in FaultKind if k.hard]
    return {
        "ok": ok,
        "seconds": round(elapsed, 1),
        "contexts": options.contexts,
        "seed": options.seed,
        "policy": options.policy,
        "fault_rate": options.fault_rate,
        "cancel_rate": options.cancel_rate,
        "operations": dict(ledger.ops),
        "contexts_opened": ledger.contexts,
        "bytes_written": ledger.bytes_written,
        "bytes_verified": ledger.bytes_verified,
        "mismatches": ledger.mismatches,
        "mismatch_examples": ledger.mismatch_examples,
        "cancellations": ledger.cancellations,
        "errors_by_type": dict(ledger.errors),
        "lost_layer_refusals": ledger.lost_refusals,
        "full_disk": {
            "enabled": options.full_disk,
            "disk_bytes": full_disk_bytes(options) if options.full_disk else None,
            "no_room_errors": dict(ledger.full_disk),
            "ok": full_disk_ok,
        },
        "pressure": pressure,
        "faults": {
            "injected": injected,
            "injected_hard": sum(injected.get(k, 0) for k in hard),
            "surfaced": dict(ledger.surfaced),
            "coalesced_into_one_error": dict(ledger.coalesced),
            "during_cancellation": dict(ledger.during_cancel),
            "absorbed_short_or_slow": dict(ledger.absorbed),
            "swallowed": dict(ledger.swallowed),
            "unattributed": unattributed,
            "attributed_by_path": dict(ledger.by_path),
            "by_type": {
                kind.value: {
                    "injected": injected.get(kind.value, 0),
                    "surfaced": ledger.surfaced.get(kind.value, 0),
                    "coalesced": ledger.coalesced.get(kind.value, 0),
                    "during_cancellation": ledger.during_cancel.get(kind.value, 0),
                    "absorbed": ledger.absorbed.get(kind.value, 0),
                    "swallowed": ledger.swallowed.get(kind.value, 0),
                }
                for kind in FaultKind
            },
            "unexpected_errors": ledger.unexpected_count,
            "unexpected_examples": ledger.unexpected,
            "accounted": faults_ok,
        },
        "memory": {
            "window_s": round(width, 1),
            "windows": windows,
            "rss_growth_first_to_last": None if growth is None else round(growth, 4),
            "rss_growth_checked": growth_checked,
            "max_rss_growth": options.max_rss_growth,
        },
        "leaks": leaks,
    }
