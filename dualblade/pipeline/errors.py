"""Errors the planner raises on purpose; all derive from :class:`~dualblade.errors.DualbladeError`.

Configuration mistakes are :class:`~dualblade.errors.ConfigError` (exit status 2); these are the
problems found while planning: an extent too small for the tensors, a slice outside its tensor,
memory limits that cannot be read.
"""

from __future__ import annotations

from dualblade.errors import DualbladeError


class PlanError(DualbladeError):
    """A request to the planner cannot be satisfied as asked; the message says which and why."""


class ExtentOverflowError(PlanError):
    """The tensors to place need more blocks than the declared extent holds.

    Binding past the extent would write over whatever owns the LBAs behind it (another partition,
    another namespace user), so the planner refuses instead; enlarge ``extent_size`` or move
    ``first_lba``.
    """


class MemoryDiscoveryError(DualbladeError):
    """The host's memory accounting (``/proc/meminfo``, cgroup files) could not be read."""
