"""Python's cyclic collector in dualblade's own processes: what the setup made is left out.

A full pass of the collector walks every tracked object the process holds, on whichever thread
happens to allocate, with the GIL held throughout. A process that has built a model holds
hundreds of thousands of them (modules, parameters, torch's and transformers' own state), and
the decode's transfers allocate enough that a full pass comes due during it. On the H100
machine, OPT-6.7B at an 11 GiB limit (every layer in the page cache, 0.28-0.31 s a step), one
full pass of 71-72 ms landed in the second decode step of both runs of ``dualblade bench`` and
made it the slowest: the ring thread cannot reap or submit, and the copy threads' completions
wait on the event loop (docs/bench.md). The LMCache adapter met the same passes (300 ms over
LMCache's objects) and freezes its setup for the same reason.

:func:`freeze_setup` is called by the commands and the bench's workers once the model and the
store are set up, before the timed work: what is alive then lives as long as the process, and
the collector's later passes walk only what was made after. An application that embeds a store
decides this for its own process (the LMCache adapter's ``freeze_gc`` is that choice made for
LMCache's): the call belongs where its own setup ends.
"""

from __future__ import annotations

import gc


def freeze_setup() -> int:
    """Collect the setup's garbage, then move every object still alive into the collector's
    permanent generation (:func:`gc.freeze`); returns how many objects are frozen.

    The cost: a reference cycle among those objects that becomes garbage later is never
    collected, which for a model and a store kept until the process ends costs nothing.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
