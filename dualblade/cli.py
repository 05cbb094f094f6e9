"""The ``dualblade`` command line: one sub-command per module in :mod:`dualblade.commands`.

The CLI is the only place that configures logging. Errors that derive from
:class:`~dualblade.errors.DualbladeError` are printed as one readable paragraph with the error's
exit code; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import structlog

from dualblade.errors import DualbladeError

#: Modules under dualblade.commands; each has ``register(subparsers)`` that adds one sub-command
#: whose parser sets ``func(args) -> int``. Imported lazily so ``dualblade --help`` stays fast.
COMMAND_MODULES: tuple[str, ...] = (
    "run",
    "generate",
    "pipebench",
    "doctor",
    "iobench",
    "config",
    "plan",
    "bench",
    "soak",
    "lmcache_bench",
)


def build_parser() -> argparse.ArgumentParser:
    """Build the parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="dualblade",
        description="Dual-path NVMe-direct KV-cache offloading for LLM inference.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (repeat for debug)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"dualblade.commands.{name}")
        module.register(subparsers)
    return parser


def configure_logging(verbosity: int) -> None:
    """Route structlog events to stderr, warnings and up unless ``-v`` is given."""
    import logging

    level = logging.WARNING - 10 * min(verbosity, 2)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dualblade`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        status: int = args.func(args)
    except DualbladeError as error:
        print(f"dualblade {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of our stdout went away (``| head``): not an error worth a traceback.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return status


if __name__ == "__main__":
    raise SystemExit(main())
