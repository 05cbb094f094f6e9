"""dualblade as an LMCache L2 storage adapter (``pip install 'dualblade[lmcache]'``).

LMCache's multiprocess server loads it as a plugin::

    {"type": "plugin", "module_path": "dualblade.integrations.lmcache",
     "class_name": "DualBladeL2Adapter", "adapter_params": {}}

Every LMCache object becomes a context of one dualblade store: the store-wide page-cache budget
puts it on the page-cache path or the direct path (consecutive blocks of a file, a block device
or an NVMe namespace, through the io_uring ring), and evicting or deleting it TRIMs its blocks.
``docs/lmcache.md`` has the configuration keys and how to run vLLM or SGLang with it.

Importing this module imports LMCache (0.5.6), and nothing in ``dualblade`` imports this module.
"""

from dualblade.integrations.lmcache.adapter import AdapterClosedError as AdapterClosedError
from dualblade.integrations.lmcache.adapter import DualBladeL2Adapter as DualBladeL2Adapter
from dualblade.integrations.lmcache.extent_reference import (
    ExtentReferenceAdapter as ExtentReferenceAdapter,
)
from dualblade.integrations.lmcache.index import Entry as Entry
from dualblade.integrations.lmcache.index import ObjectIndex as ObjectIndex
from dualblade.integrations.lmcache.object_store import Placement as Placement
from dualblade.integrations.lmcache.objects import ObjectShapeError as ObjectShapeError
from dualblade.integrations.lmcache.params import AdapterParamsError as AdapterParamsError
from dualblade.integrations.lmcache.params import AdapterSetup as AdapterSetup
from dualblade.integrations.lmcache.params import ObjectGeometry as ObjectGeometry
from dualblade.integrations.lmcache.params import resolve_params as resolve_params
from dualblade.integrations.lmcache.stats import AdapterStats as AdapterStats
from dualblade.integrations.lmcache.striped_shares import StripedShares as StripedShares

__all__ = [
    "AdapterClosedError",
    "AdapterParamsError",
    "AdapterSetup",
    "AdapterStats",
    "DualBladeL2Adapter",
    "Entry",
    "ExtentReferenceAdapter",
    "ObjectGeometry",
    "ObjectIndex",
    "ObjectShapeError",
    "Placement",
    "StripedShares",
    "resolve_params",
]
