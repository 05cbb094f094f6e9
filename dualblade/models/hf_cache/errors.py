"""What :class:`~dualblade.models.hf_cache.DualBladeCache` raises."""

from dualblade.errors import DualbladeError


class DualBladeCacheError(DualbladeError, ValueError):
    """The cache was used in a way its store cannot serve (batch, length, dtype, closed...)."""

    exit_code = 2
