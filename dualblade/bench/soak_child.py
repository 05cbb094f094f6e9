"""One store of a kill-restart soak, in a process of its own, reporting as it goes.

``python -m dualblade.bench.soak_child OPTIONS_JSON FOLDER DEADLINE`` runs the ordinary soak
(faults, cancellations, every byte checked) on a store in ``FOLDER`` until ``DEADLINE`` (a
``time.monotonic()`` reading, the same clock in every process), unless the parent kills it
first. It reports on stdout, one JSON object a line:

- ``started``: its pid and what its store reclaimed of the dead predecessor before serving;
- ``snapshot``: its ledger, the faults injected so far and its RSS, every sample, at once after
  a mismatch, an unexpected error or a swallowed fault (so a kill cannot hide one), and at the
  end;
- ``finished``: the soak's document, when it ran to its deadline.

Logs go to stderr. A line is written whole with one ``write`` and flushed, so a kill leaves at
most one partial last line, which the parent drops.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

import structlog

from dualblade import event_loop
from dualblade.bench.process_stats import MemorySample
from dualblade.bench.soak import run_in_folder
from dualblade.bench.soak_options import options_from_json
from dualblade.bench.soak_worker import Soak
from dualblade.store import KVStore
from dualblade.testing import FaultLog


class LineReporter:
    """Writes the child's reports to ``out``, one JSON object a line."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def emit(self, event: str, **data: Any) -> None:
        self.out.write(json.dumps({"event": event, **data}) + "\n")
        self.out.flush()

    def opened(self, store: KVStore) -> None:
        stats = store.stats()
        reclaimed = stats.reclaimed
        self.emit("started", pid=os.getpid(), reclaimed=reclaimed.to_dict())

    def sampled(self, soak: Soak, faults: FaultLog, sample: MemorySample) -> None:
        self.emit(
            "snapshot",
            ledger=soak.ledger.to_json(),
            injected={kind.value: n for kind, n in faults.counts().items()},
            rss_bytes=sample.rss_bytes,
            pressure=soak.pressure,
        )


def main(argv: list[str]) -> int:
    """Run one child; returns its exit status (0 when its soak passed)."""
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    options = options_from_json(json.loads(argv[0]))
    folder, deadline = Path(argv[1]), float(argv[2])
    seconds = max(0.5, deadline - time.monotonic())
    options = type(options)(**{**vars(options), "seconds": seconds, "kill_restart": False})
    reporter = LineReporter(sys.stdout)
    document = event_loop.run(run_in_folder, options, folder, None, reporter)
    reporter.emit("finished", document=document)
    return 0 if document["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
