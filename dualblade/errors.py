"""The root of dualblade's exception tree.

Every error that reaches a user through the public API or the CLI derives from
:class:`DualbladeError`, so an application can catch ours apart from bugs, and the CLI can print
the message (which must say what to do) instead of a traceback. This module imports nothing from
the rest of the package so every layer may depend on it.
"""

from __future__ import annotations


class DualbladeError(Exception):
    """Base class of all errors dualblade raises on purpose."""

    #: Process exit status the CLI uses for this kind of error.
    exit_code: int = 1


class ConfigError(DualbladeError, ValueError):
    """A configuration or command-line value is invalid; the message names the field."""

    exit_code = 2
