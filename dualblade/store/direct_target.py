"""The configured direct target, opened and checked against the config before anything moves."""

from __future__ import annotations

from dualblade.errors import ConfigError
from dualblade.io_engine import (
    DIRECT_FILE_ALIGNMENT,
    BlockDevice,
    DirectFile,
    NvmeNamespace,
    Target,
)
from dualblade.pipeline import PipelineConfig


def open_direct_target(config: PipelineConfig) -> tuple[Target, int, int | None]:
    """The configured direct target, its first LBA and its extent in blocks (None: grows)."""
    spec = config.storage.direct
    if spec.kind == "file":
        if spec.lba_size != DIRECT_FILE_ALIGNMENT:
            # Rows padded to smaller blocks would fail O_DIRECT at the first write.
            raise ConfigError(
                f"storage.direct.lba_size is {spec.lba_size} but a direct file moves "
                f"{DIRECT_FILE_ALIGNMENT}-byte blocks (O_DIRECT alignment); set lba_size = "
                f"{DIRECT_FILE_ALIGNMENT} or leave it out"
            )
        # The extent starts at first_lba: the file holds the blocks before it too.
        size = spec.first_lba * spec.lba_size + spec.extent_size if spec.extent_size else 0
        target: Target = DirectFile(spec.path, size)
        return target, spec.first_lba, spec.extent_blocks()
    target = BlockDevice(str(spec.path)) if spec.kind == "block" else NvmeNamespace(str(spec.path))
    if target.lba_size != spec.lba_size:
        lba = target.lba_size
        target.close()
        raise ConfigError(
            f"storage.direct.lba_size is {spec.lba_size} but {spec.path} has {lba}-byte "
            f"blocks; set lba_size = {lba}"
        )
    return target, spec.first_lba, spec.extent_blocks()
