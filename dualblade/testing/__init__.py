"""Test aids for code built on dualblade: storage targets that inject faults, and their log.

A :class:`FaultyTarget` wraps a store's direct target and a :class:`FaultyPageCacheFile` stands
in for its page-cache files; a seeded :class:`FaultPolicy` gives some share of their I/O chunks a
fault (:class:`FaultKind`: ``EIO`` or ``ENOSPC`` fail the chunk with :class:`InjectedIOError`,
``SHORT`` and ``SLOW`` make the engine retry or wait), and a shared :class:`FaultLog` numbers
each :class:`InjectedFault`. The faults travel the engine's and the store's real error paths, so
a test sees exactly what an application would see on a failing disk::

    from dualblade import LayerLostError, open_store
    from dualblade.testing import (
        FaultKind,
        FaultLog,
        FaultPolicy,
        FaultyPageCacheFile,
        FaultyTarget,
        InjectedIOError,
    )

    async def test_a_failed_write_is_reported_and_the_layer_refused(config, k, v):
        policy, log = FaultPolicy(1.0, kinds=(FaultKind.EIO,)), FaultLog()

        def direct(target):
            return FaultyTarget(target, policy, log=log)

        def page_cache_file(path, size):
            return FaultyPageCacheFile(path, size, policy, log)

        async with open_store(config, wrap_direct=direct, page_cache_file=page_cache_file) as store:
            async with store.context() as ctx:
                with pytest.raises(InjectedIOError) as caught:
                    await ctx.write(0, k, v)
                assert caught.value.serial in {fault.serial for fault in log.injected}
                with pytest.raises(LayerLostError):  # half-written: refused until rewritten
                    await ctx.read(0)

Set ``policy.enabled = False`` to stop injecting, give a lower ``rate`` (and a ``seed``) for
random faults, and :meth:`FaultyTarget.limit_to` one context's byte range of the direct target
(``ctx.direct_map()``) to fault only that context. ``dualblade soak`` runs a store under these
faults for minutes and accounts for every one.
"""

from dualblade.testing.faults import FaultKind as FaultKind
from dualblade.testing.faults import FaultLog as FaultLog
from dualblade.testing.faults import FaultPolicy as FaultPolicy
from dualblade.testing.faults import InjectedFault as InjectedFault
from dualblade.testing.faults import InjectedIOError as InjectedIOError
from dualblade.testing.targets import FaultyPageCacheFile as FaultyPageCacheFile
from dualblade.testing.targets import FaultyTarget as FaultyTarget

__all__ = [
    "FaultKind",
    "FaultLog",
    "FaultPolicy",
    "FaultyPageCacheFile",
    "FaultyTarget",
    "InjectedFault",
    "InjectedIOError",
]
