"""The root of dualblade's exception tree.

Every error that reaches a user through the public API or the CLI derives from
:class:`DualbladeError`, so an application can catch ours apart from bugs, and the CLI can print
the message (which must say what to do) instead of a traceback. This module imports nothing from
the rest of the package so every layer may depend on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class DualbladeError(Exception):
    """Base class of all errors dualblade raises on purpose."""

    #: Process exit status the CLI uses for this kind of error.
    exit_code: int = 1


class ConfigError(DualbladeError, ValueError):
    """A configuration or command-line value is invalid; the message names the field."""

    exit_code = 2


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


@contextlib.contextmanager
def plain_errors() -> Iterator[None]:
    """Let an error leave a task group as itself, not wrapped in an exception group.

    Callers catch :class:`~dualblade.errors.DualbladeError` (a copy thread routes a failed I/O
    to its requester by it, the CLI prints it); anyio task groups always raise exception
    groups. A group of one error, or of :class:`DualbladeError` only (K and V both failed),
    is raised as its first error; any other mix stays a group.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if len(leaves) != 1 and not all(isinstance(e, DualbladeError) for e in leaves):
            raise
        first = leaves[0]
        raise first from first.__cause__
