"""The library's loggers: the application's structlog configuration when it has one, else quiet.

structlog, left unconfigured, prints every event (debug included) to standard output, where an
application that embeds dualblade may be writing its own data: JSON lines, a streamed HTTP
response, a CLI's table. A library should not speak there unasked. So until the application
configures structlog, our warnings and errors go to standard error and the rest are dropped; once
it does (as ``dualblade``'s own CLI does), its processors, level and destination apply, checked
at every call, so configuring after import works too.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def _quiet_logger() -> Any:
    """Warnings and up to the *current* ``sys.stderr``, the rest dropped."""
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
    )


class LibraryLogger:
    """A structlog logger that picks its configuration at each call (see the module docstring).

    ``bind`` decides once: the bound logger keeps the choice made when it was bound.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def _target(self) -> Any:
        if structlog.is_configured():
            return structlog.get_logger(self._name)
        return _quiet_logger()

    def __getattr__(self, method: str) -> Any:
        return getattr(self._target(), method)


def get_logger(name: str) -> LibraryLogger:
    """The logger of module ``name``."""
    return LibraryLogger(name)
