"""A dependency-free progress bar on stderr (redrawn in place on a terminal, lines otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Shows ``phase [#####.....] done/total`` for each phase of a run."""

    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self._phase: str | None = None
        self._last_line = 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{phase:8} [{bar}] {done}/{total}"
        if self.tty:
            end = "\n" if done >= total else ""
            self.stream.write(f"\r{line}{end}")
        elif done >= total or time.monotonic() - self._last_line > 2.0:
            self._last_line = time.monotonic()
            self.stream.write(line + "\n")
        self.stream.flush()
