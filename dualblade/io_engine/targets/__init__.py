"""Storage targets: where bytes live, each with read, write, trim, LBA size and max transfer."""

from dualblade.io_engine.targets.base import Target as Target
from dualblade.io_engine.targets.block_device import BlockDevice as BlockDevice
from dualblade.io_engine.targets.direct_file import DirectFile as DirectFile
from dualblade.io_engine.targets.nvme_namespace import NvmeNamespace as NvmeNamespace
from dualblade.io_engine.targets.page_cache_file import PageCacheFile as PageCacheFile
