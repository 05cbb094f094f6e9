"""``adapter_params``: what LMCache's plugin spec may say, checked once, at construction.

The adapter's storage is a dualblade store, so the params are a pipeline config (the same keys as
``configs/*.toml``) plus nine of the adapter's own (``OWN_KEYS``)::

    {"config": "/etc/dualblade/kv.toml",        # a pipeline config file (else the embedded one)
     "capacity": "64GiB",                       # bytes of objects the adapter holds at most
     "object_size": "1MiB",                     # the largest object LMCache will store
     "stats_file": "/var/log/kv-stats.json",    # the adapter's last stats, written at close
     "replan": false,                           # move stored objects when the budget changes
     "populate_l1": true,                       # make LMCache's L1 resident at the start
     "freeze_gc": true,                         # keep what exists at the start out of gc passes
     "gc_threshold": [50000, 20, 100],          # the cyclic collector's thresholds (null: leave)
     "switch_interval": 0.0005,                 # the GIL's switch interval, seconds (null: leave)
     "storage": {"direct": {"kind": "block", "path": "/dev/nvme0n1p3", "extent_size": "64GiB"}},
     "copy_threads": 8}

Every key is optional. The pipeline keys are laid over the file (or the embedded default) and
validated by :class:`~dualblade.PipelineConfig`, so a misspelt key is an error that names it.
``model`` and ``workload`` are the adapter's: it stores each object as one layer's K and V of a
shape made for ``object_size`` (:class:`ObjectGeometry`).

With no file and no path of the user's, the store's files go to a fresh folder under the user's
cache directory (``~/.cache/dualblade/lmcache-*``) that the adapter removes when it closes: the
index of what is stored lives in the adapter's memory, so the bytes are of no use after it.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualblade.errors import ConfigError
from dualblade.pipeline import (
    ModelShape,
    PipelineConfig,
    config_for_model,
    config_from_mapping,
    default_cache_dir,
    load_config,
    load_default_config,
    parse_size,
)

#: The adapter's own keys; the rest are the pipeline config's.
OWN_KEYS = (
    "config",
    "capacity",
    "object_size",
    "stats_file",
    "replan",
    "populate_l1",
    "freeze_gc",
    "gc_threshold",
    "switch_interval",
)
#: Pipeline keys the adapter sets itself from ``object_size``.
DERIVED_KEYS = ("model", "workload")
DEFAULT_OBJECT_SIZE = 1 << 20
#: Capacity when neither the params nor the direct target's extent say.
DEFAULT_CAPACITY = 4 << 30
#: ``gc.set_threshold`` while the adapter runs (Python's default is 700, 10, 10). A full pass of
#: the cyclic collector runs on whichever thread allocates, holds the GIL throughout, and the
#: ring thread needs the GIL to reap and submit: in ``dualblade lmcache-bench`` passes of 50-145
#: ms over the objects the stores had made left the disk idle in every other load round, and
#: all-direct loads read at 0.81-0.84 of fio on the same extents, against 0.92-0.93 with these
#: thresholds (young passes every 50,000 allocations, full ones a hundred times rarer).
DEFAULT_GC_THRESHOLD = (50_000, 20, 100)
#: ``sys.setswitchinterval`` while the adapter runs (Python's default is 5 ms): how long the ring
#: thread, woken by the disk, may wait for the GIL while another thread runs Python. In
#: ``dualblade lmcache-bench --adapters dualblade-direct`` (queue depth 64), all-direct loads
#: read at 0.886 of fio at 5 ms and at 0.946 at 0.5 ms, medians of eight alternated runs each,
#: faster in seven pairs of eight; fifteen runs of the whole benchmark at 0.5 ms gave 0.909
#: (docs/lmcache.md). The cost is more frequent GIL hand-overs between the process's busy
#: threads.
DEFAULT_SWITCH_INTERVAL = 0.0005
#: Laid over the embedded default (not over a user's file): LMCache keeps many objects in flight,
#: so more copy threads for the objects that cannot move straight (unaligned or ragged ones),
#: each moving one object's K or V at a time. Aligned objects move straight between the ring and
#: LMCache's memory, a 1 MiB object's K and V as one request, so chunks of 1 MiB: in
#: ``dualblade lmcache-bench`` all-direct loads ran at 1557 MB/s with them against 1388-1408
#: with 256 KiB chunks. A queue of 64 chunks, not the embedded default's 32: loads and stores
#: move between the ring and LMCache's own memory, so a deeper queue holds no more memory of
#: ours, and it keeps the disk fed while the ring thread reaps a batch of completions and
#: submits the next (this VM's disk completes a full queue at a time): all-direct loads read at
#: 0.886 of fio at the same depth against 0.861 at 32 (medians of eight alternated runs; fio
#: itself reads as fast at 64 as at 32). The page-cache share follows the budget (the
#: embedded default pins Algorithm 1's X at 32 MiB to show both paths on a small model).
ADAPTER_DEFAULTS: dict[str, Any] = {
    "copy_threads": 8,
    "queue_depth": 64,
    "max_chunk": 1 << 20,
    "memory": {"knob_x": None},
}
#: Bytes per row of an object's K or V: float16 rows of one "head" that fill one 4 KiB block.
MIN_ROW_BYTES = 4096


class AdapterParamsError(ConfigError):
    """``adapter_params`` cannot make a store; the message names the key and what is allowed."""


@dataclass(frozen=True)
class ObjectGeometry:
    """How an object's bytes lie in the store: one layer, K then V, each ``rows`` rows of
    ``row_bytes`` (float16, batch 1, one head). An object of ``n`` bytes takes
    ``rows_for(n)`` rows of each; the last row is zero-padded when ``n`` is not a multiple of
    ``2 * row_bytes``."""

    row_bytes: int
    max_rows: int

    @property
    def row_elements(self) -> int:
        return self.row_bytes // 2

    @property
    def max_object_bytes(self) -> int:
        return 2 * self.max_rows * self.row_bytes

    def rows_for(self, nbytes: int) -> int:
        """Rows of K (and of V) an object of ``nbytes`` needs (at least one)."""
        return max(1, -(-nbytes // (2 * self.row_bytes)))

    def footprint(self, nbytes: int) -> int:
        """Bytes an object of ``nbytes`` takes of the capacity: its padded K and V."""
        return 2 * self.rows_for(nbytes) * self.row_bytes

    def shape(self) -> ModelShape:
        """The model shape the store is opened with."""
        width = self.row_elements
        return ModelShape("lmcache-object", 1, width, 1, 1, width, "float16")


@dataclass(frozen=True)
class AdapterSetup:
    """What the params resolve to: the store's config, the capacity, the object geometry, and
    the scratch folder the adapter made (and removes on close), if it made one."""

    config: PipelineConfig
    capacity: int
    geometry: ObjectGeometry
    scratch: Path | None
    stats_file: Path | None = None
    replan: bool = False
    populate_l1: bool = True
    freeze_gc: bool = True
    gc_threshold: tuple[int, ...] | None = DEFAULT_GC_THRESHOLD
    switch_interval: float | None = DEFAULT_SWITCH_INTERVAL

    def remove_scratch(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def resolve_params(params: Mapping[str, Any] | None) -> AdapterSetup:
    """Check ``params`` and make the store's config from them (see the module docstring).

    Raises:
        AdapterParamsError: an unknown or derived key, a bad size, an unreadable config file,
            an invalid pipeline config, or a capacity beyond the direct target's extent.
    """
    params = dict(params or {})
    if not isinstance(params, dict):
        raise AdapterParamsError(f"adapter_params must be a mapping, got {type(params).__name__}")
    allowed = [*OWN_KEYS, *(k for k in PipelineConfig.model_fields if k not in DERIVED_KEYS)]
    for key in params:
        if key in DERIVED_KEYS:
            raise AdapterParamsError(
                f"adapter_params.{key}: the adapter sets the model and workload itself (one "
                "layer whose K and V hold an object); give object_size instead"
            )
        if key not in allowed:
            raise AdapterParamsError(
                f"adapter_params.{key}: unknown key; the keys allowed are {', '.join(allowed)}"
            )
    object_size = _size(params, "object_size", DEFAULT_OBJECT_SIZE) or DEFAULT_OBJECT_SIZE
    capacity = _size(params, "capacity", None)
    base = _base(params.get("config"))
    overrides = {k: v for k, v in params.items() if k not in OWN_KEYS}
    data = _merge(base.model_dump(), overrides)
    replan, populate_l1, freeze_gc = (_flag(params, key, default) for key, default in _FLAGS)
    stats_file = params.get("stats_file")
    if stats_file is not None and not isinstance(stats_file, str | Path):
        raise AdapterParamsError(f"adapter_params.stats_file must be a path, got {stats_file!r}")
    scratch = _scratch_for(data, overrides, from_file=params.get("config") is not None)
    try:
        setup = _setup(data, object_size, capacity, scratch)
        return dataclasses.replace(
            setup,
            stats_file=None if stats_file is None else Path(stats_file).expanduser(),
            replan=replan,
            populate_l1=populate_l1,
            freeze_gc=freeze_gc,
            gc_threshold=_gc_threshold(params),
            switch_interval=_switch_interval(params),
        )
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise


def _setup(
    data: dict[str, Any], object_size: int, capacity: int | None, scratch: Path | None
) -> AdapterSetup:
    direct = data["storage"]["direct"]
    lba = _size(direct, "lba_size", 4096, "storage.direct.") or 4096
    extent = _size(direct, "extent_size", None, "storage.direct.")
    if capacity is None:
        capacity = extent if extent is not None else DEFAULT_CAPACITY
    if extent is None:
        direct["extent_size"] = -(-capacity // lba) * lba  # a file: grows up to the capacity
    elif capacity > extent:
        raise AdapterParamsError(
            f"adapter_params.capacity ({capacity} bytes) is more than the direct target's "
            f"extent_size ({extent} bytes): every object may have to go direct"
        )
    row = max(MIN_ROW_BYTES, lba)
    geometry = ObjectGeometry(row, max(1, -(-object_size // (2 * row))))
    try:
        validated = config_from_mapping(data, source="adapter_params", env={})
        config = config_for_model(
            validated,
            geometry.shape(),
            batch=1,
            prompt_len=geometry.max_rows,
            max_new_tokens=0,
            source="adapter_params",
        )
    except AdapterParamsError:
        raise
    except ConfigError as error:
        raise AdapterParamsError(str(error)) from None
    return AdapterSetup(config, capacity, geometry, scratch)


#: The adapter's true/false keys and their defaults.
_FLAGS = (("replan", False), ("populate_l1", True), ("freeze_gc", True))


def _gc_threshold(params: Mapping[str, Any]) -> tuple[int, ...] | None:
    value = params.get("gc_threshold", DEFAULT_GC_THRESHOLD)
    if value is None:
        return None
    if (
        not isinstance(value, list | tuple)
        or not 1 <= len(value) <= 3
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)
    ):
        raise AdapterParamsError(
            "adapter_params.gc_threshold must be null or a list of 1 to 3 positive integers "
            f"(gc.set_threshold's), got {value!r}"
        )
    return tuple(value)


def _switch_interval(params: Mapping[str, Any]) -> float | None:
    value = params.get("switch_interval", DEFAULT_SWITCH_INTERVAL)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise AdapterParamsError(
            "adapter_params.switch_interval must be null or seconds above 0 and at most 1 "
            f"(sys.setswitchinterval's), got {value!r}"
        )
    return float(value)


def _flag(params: Mapping[str, Any], key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise AdapterParamsError(f"adapter_params.{key} must be true or false, got {value!r}")
    return value


def _size(params: Mapping[str, Any], key: str, default: int | None, where: str = "") -> int | None:
    value = params.get(key)
    if value is None:
        return default
    try:
        size = parse_size(value)
    except (ValueError, TypeError) as error:
        raise AdapterParamsError(f"adapter_params.{where}{key}: {error}") from None
    if size <= 0:
        raise AdapterParamsError(f"adapter_params.{where}{key} must be positive, got {value!r}")
    return size


def _base(path: object) -> PipelineConfig:
    if path is None:
        return config_from_mapping(
            _merge(load_default_config().model_dump(), ADAPTER_DEFAULTS),
            source="embedded default",
            env={},
        )
    if not isinstance(path, str | Path):
        raise AdapterParamsError(f"adapter_params.config must be a file path, got {path!r}")
    try:
        return load_config(path)
    except ConfigError as error:
        raise AdapterParamsError(f"adapter_params.config: {error}") from None


def _scratch_for(
    data: dict[str, Any], overrides: Mapping[str, Any], from_file: bool
) -> Path | None:
    """Point the paths nobody chose at a fresh folder of the adapter's (see the module
    docstring), so that two adapters never share a file; return it, or None when every path
    was chosen."""
    if from_file:
        return None
    storage_given = overrides.get("storage")
    storage_given = storage_given if isinstance(storage_given, Mapping) else {}
    direct_given = storage_given.get("direct")
    direct_given = direct_given if isinstance(direct_given, Mapping) else {}
    direct = data["storage"]["direct"]
    own_direct = direct.get("kind", "file") == "file" and "path" not in direct_given
    own_pages = "page_cache_dir" not in storage_given
    if not (own_direct or own_pages):
        return None
    root = default_cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        scratch = Path(tempfile.mkdtemp(prefix="lmcache-", dir=root))
    except OSError as error:
        raise AdapterParamsError(
            f"cannot make the adapter's folder under {root}: {error.strerror}; give "
            "storage.direct.path and storage.page_cache_dir"
        ) from None
    if own_direct:
        direct["path"] = scratch / "direct.kv"
    if own_pages:
        data["storage"]["page_cache_dir"] = scratch / "page-cache"
    return scratch


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid over ``base``, table by table (a copy; neither is changed)."""
    merged = {k: (_merge(v, {}) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for key, value in over.items():
        old = merged.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            merged[key] = _merge(old, value)
        else:
            merged[key] = _merge(value, {}) if isinstance(value, Mapping) else value
    return merged
