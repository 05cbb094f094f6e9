"""``DualBladeCache``: a transformers ``Cache`` whose KV lives in a dualblade store.

Any transformers decoder offloads its KV cache by taking this cache instead of its default one::

    from dualblade.models.hf_cache import DualBladeCache

    with DualBladeCache(model.config, max_cache_len=prompt_len + new_tokens, batch_size=4,
                        policy="dual") as cache:
        ids = model.generate(input_ids, max_new_tokens=new_tokens, cache=cache)

(recent transformers 5.x, 5.24 here, call the argument ``cache``; earlier 5.x releases call
it ``past_key_values``, which later ones still take with a FutureWarning. Tested with 5.0,
5.17 and 5.24.) One :class:`DualBladeLayer` per decoder layer forwards ``update`` to one context of
a blocking :class:`~dualblade.store.blocking.BlockingStore`: the prefill writes rows
``[0, t)`` of the layer's K and V, each decode step appends one row and reads the whole layer
back from the store. That read is the offload: between two steps the model holds no KV at all,
and during a step only the layer that is computing. The store's policy decides the path
(Algorithm 1 under ``dual``), as for every other user of the store.

The store fixes batch, dtype and row count when it opens, so the cache does too: the batch and
dtype are taken from the first ``update`` (or given up front), the row count is
``max_cache_len``. ``generate`` never caches its last token, so ``prompt_len + max_new_tokens - 1``
rows suffice; ``num_beams`` and ``num_return_sequences`` multiply the batch.

The cache owns a background event-loop thread, the store's actors and its files until
:meth:`DualBladeCache.close` (or the end of its ``with`` block); a cache that is garbage
collected unclosed closes itself, but only ``close`` releases at a moment the caller chooses.

Modules: :mod:`.cache` (the ``Cache``); :mod:`.layer` (one decoder layer's K and V, and the
layouts); :mod:`._backing` (the store and context the layers share); :mod:`._sizing` (the
model's geometry, the caller's settings and the store config built from them); :mod:`.errors`;
:mod:`._transformers` imports transformers, or says what to install.
"""

from dualblade.models.hf_cache.cache import DualBladeCache as DualBladeCache
from dualblade.models.hf_cache.errors import DualBladeCacheError as DualBladeCacheError
from dualblade.models.hf_cache.layer import DualBladeLayer as DualBladeLayer

__all__ = ["DualBladeCache", "DualBladeCacheError", "DualBladeLayer"]
