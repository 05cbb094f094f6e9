"""``PipelineConfig``: the declarative description of one dualblade pipeline.

A config says which model shape runs (a preset or explicit numbers), the workload that sizes its KV
cache, where the two paths store their bytes (a page-cache directory for Group 1, a direct target
for Group 2), how the page-cache budget is found, and the knobs of the copy threads. Everything is
validated here, once, with ``extra="forbid"`` so a misspelt key is an error and not a silently
ignored default; loading files and environment overrides lives in :mod:`.config_loader`.

Sizes anywhere accept ``4096`` or strings such as ``"4GiB"`` (:func:`~.sizes.parse_size`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)

from dualblade.errors import ConfigError
from dualblade.pipeline.layer_order import LayerOrder
from dualblade.pipeline.shapes import PRESETS, DType, ModelShape, get_preset
from dualblade.pipeline.sizes import SIZE_SYNTAX, parse_size

_SIZE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "integer", "minimum": 0},
        {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*[a-zA-Z]*\s*$"},
    ],
    "description": f"A size: {SIZE_SYNTAX}.",
}

#: A byte count written as an int or a ``"4GiB"``-style string; validated by the one parser.
Size = Annotated[int, BeforeValidator(parse_size), WithJsonSchema(_SIZE_SCHEMA)]


def _auto_or_size(value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return parse_size(value)


#: ``"auto"`` (discover it) or a size.
AutoSize = Annotated[
    int | None,
    BeforeValidator(_auto_or_size),
    WithJsonSchema({"anyOf": [{"const": "auto"}, _SIZE_SCHEMA]}),
]


#: Far above any real decoder (the largest have a few hundred layers); a bound keeps a typo such
#: as ``num_layers = 1e12`` a config error instead of a planner that runs out of memory.
MAX_LAYERS = 10_000


def _expand(path: Path) -> Path:
    try:
        return path.expanduser()
    except RuntimeError:  # ``~name`` of a user that does not exist
        raise ValueError(f"{path}: cannot expand '~' (no such user or no home folder)") from None


#: A path in which a leading ``~`` is expanded.
UserPath = Annotated[Path, AfterValidator(_expand)]


def _check_lba_size(value: int) -> int:
    if value < 512 or value > 65536 or value & (value - 1):
        raise ValueError("lba_size must be a power of two from 512 to 65536 (usually 512 or 4096)")
    return value


LbaSize = Annotated[int, AfterValidator(_check_lba_size)]


def default_cache_dir() -> Path:
    """Where dualblade keeps its files by default: ``$XDG_CACHE_HOME/dualblade``.

    Falls back to ``~/.cache/dualblade`` as the XDG base-directory spec says.
    """
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "dualblade"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    """A named preset, or an explicit shape; with a preset, given fields override it."""

    preset: str | None = Field(default=None, description=f"One of: {', '.join(PRESETS)}.")
    num_layers: int | None = Field(
        default=None,
        gt=0,
        le=MAX_LAYERS,
        description=f"Decoder layers (at most {MAX_LAYERS}: planning lists every layer).",
    )
    hidden_size: int | None = Field(default=None, gt=0)
    num_heads: int | None = Field(default=None, gt=0)
    num_kv_heads: int | None = Field(
        default=None, gt=0, description="Defaults to num_heads (no GQA)."
    )
    head_dim: int | None = Field(
        default=None, gt=0, description="Defaults to hidden_size / num_heads."
    )
    dtype: DType | None = None

    @model_validator(mode="after")
    def _resolves(self) -> ModelSection:
        self.shape()
        return self

    def shape(self) -> ModelShape:
        """The resolved shape: the preset's numbers with the explicit fields laid over them.

        Raises:
            ConfigError: unknown preset, missing fields without a preset, or an inconsistent shape.
        """
        base = get_preset(self.preset) if self.preset else None
        layers = self.num_layers or (base.num_layers if base else None)
        hidden = self.hidden_size or (base.hidden_size if base else None)
        heads = self.num_heads or (base.num_heads if base else None)
        if layers is None or hidden is None or heads is None:
            raise ConfigError(
                "give either a preset or num_layers, hidden_size and num_heads "
                f"(presets: {', '.join(PRESETS)})"
            )
        kv_heads = self.num_kv_heads or (base.num_kv_heads if base else heads)
        head_dim = self.head_dim or (
            base.head_dim if base and hidden == base.hidden_size and heads == base.num_heads else 0
        )
        if not head_dim:
            if hidden % heads:
                raise ConfigError(
                    f"hidden_size ({hidden}) is not a multiple of num_heads ({heads}); "
                    "give head_dim explicitly"
                )
            head_dim = hidden // heads
        dtype = self.dtype or (base.dtype if base else "float16")
        name = base.name if base else "custom"
        return ModelShape(name, layers, hidden, heads, kv_heads, head_dim, dtype)


class WorkloadSection(_Section):
    """What is generated: it sizes every KV tensor as ``[prompt + new, batch, kv width]``."""

    batch: int = Field(gt=0, description="Sequences decoded together (the batch size).")
    prompt_len: int = Field(gt=0, description="Prompt tokens per sequence (prefill).")
    max_new_tokens: int = Field(ge=0, description="Tokens generated per sequence (decode).")

    @property
    def max_len(self) -> int:
        """Rows a KV tensor must hold: the prompt plus every generated token."""
        return self.prompt_len + self.max_new_tokens


class _TargetBase(_Section):
    first_lba: int = Field(
        default=0, ge=0, description="First LBA of the extent dualblade may use."
    )
    lba_size: LbaSize = Field(
        default=4096, description="Logical block size in bytes (a direct file: 4096)."
    )

    def extent_blocks(self) -> int | None:
        """The declared extent in LBAs, or None where the target grows to fit (files)."""
        extent: int | None = getattr(self, "extent_size", None)
        return None if extent is None else extent // self.lba_size

    @model_validator(mode="after")
    def _extent_aligned(self) -> _TargetBase:
        extent: int | None = getattr(self, "extent_size", None)
        if extent is not None and (extent == 0 or extent % self.lba_size):
            raise ValueError(
                f"extent_size ({extent} bytes) must be a positive multiple of lba_size "
                f"({self.lba_size})"
            )
        return self


class NvmeTarget(_TargetBase):
    """An NVMe namespace's generic character device (``/dev/ngXnY``), driven by passthrough."""

    kind: Literal["nvme"]
    path: UserPath = Field(description="The namespace's char device, e.g. /dev/ng0n1.")
    extent_size: Size = Field(description="Bytes from first_lba that dualblade owns.")


class BlockTarget(_TargetBase):
    """A block device or partition (``/dev/nvme0n1p3``, ``/dev/loop0``) opened O_DIRECT."""

    kind: Literal["block"]
    path: UserPath
    extent_size: Size = Field(description="Bytes from first_lba that dualblade owns.")


class FileTarget(_TargetBase):
    """A preallocated file opened O_DIRECT: the default, works on any Linux file system."""

    kind: Literal["file"] = "file"
    path: UserPath = Field(default_factory=lambda: default_cache_dir() / "direct.kv")
    extent_size: Size | None = Field(
        default=None, description="Cap on the file's size; unset: sized to fit the plan."
    )


DirectTarget = Annotated[NvmeTarget | BlockTarget | FileTarget, Field(discriminator="kind")]


class StorageSection(_Section):
    """Where Group 1 (page-cache files) and Group 2 (the direct extent) keep their bytes."""

    page_cache_dir: UserPath = Field(default_factory=lambda: default_cache_dir() / "page-cache")
    direct: DirectTarget = Field(default_factory=FileTarget)

    @model_validator(mode="before")
    @classmethod
    def _file_is_default_kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("direct"), dict):
            direct = data["direct"]
            if "kind" not in direct:
                data = {**data, "direct": {**direct, "kind": "file"}}
        return data


class MemorySection(_Section):
    """How the page-cache budget B_pc is found, and the knob X of Algorithm 1.

    B_pc = available - copy_threads * M_pin - margin, where available is the memory limit minus
    memory that is not reclaimable page cache, and margin = max(safety_margin, safety_fraction *
    limit); see :mod:`dualblade.pipeline.budget`.
    """

    limit: AutoSize = Field(
        default=None,
        description="Memory limit to plan against; 'auto' discovers the cgroup/host limit.",
    )
    page_cache_budget: Size | None = Field(
        default=None, description="Explicit B_pc; skips the derivation entirely."
    )
    knob_x: Size | None = Field(
        default=None, description="Algorithm 1's X in [0, B_pc] (clamped); unset means X = B_pc."
    )
    safety_margin: Size = Field(
        default=128 * 2**20, description="Minimum headroom left unbudgeted."
    )
    safety_fraction: float = Field(
        default=0.05,
        ge=0.0,
        lt=1.0,
        description="Headroom as a fraction of the limit (larger wins).",
    )


class TelemetrySection(_Section):
    """Where observations go; the CLI applies them, the library only logs."""

    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    log_format: Literal["console", "json"] = "console"
    trace_file: UserPath | None = Field(
        default=None, description="Chrome/Perfetto trace-event JSON of actor activity."
    )


Strategy = Literal["auto", "intra", "cross"]
Policy = Literal["dual", "direct", "page-cache", "cache-policy", "baseline"]


class PipelineConfig(_Section):
    """One pipeline: model, workload, storage, memory and the copy-thread knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="dualblade pipeline config")

    model: ModelSection
    workload: WorkloadSection
    storage: StorageSection = Field(default_factory=StorageSection)
    memory: MemorySection = Field(default_factory=MemorySection)
    copy_threads: int = Field(
        default=2, ge=1, le=64, description="Copy threads, one pinned KPU each."
    )
    queue_depth: int = Field(
        default=32,
        ge=1,
        le=4096,
        description="Chunks in flight per I/O path (the direct device, the page-cache files).",
    )
    max_chunk: Size = Field(
        default=2**20,
        gt=0,
        description=(
            "Largest single command to the direct target; its MDTS may lower it. "
            "Page-cache files cut their own memory copies."
        ),
    )
    strategy: Strategy = Field(
        default="auto", description="Overlap strategy; auto probes decode 2 and 3."
    )
    policy: Policy = Field(default="dual", description="Which KPUs take which path.")
    page_cache_layers: LayerOrder = Field(
        default="spread",
        description=(
            "Which layers Algorithm 1's n1 page-cache layers are: spread over the model (so a "
            "decode step reads both paths at once) or leading (layers 0..n1-1, the paper's)."
        ),
    )
    telemetry: TelemetrySection = Field(default_factory=TelemetrySection)

    @model_validator(mode="after")
    def _chunk_aligned(self) -> PipelineConfig:
        lba = self.storage.direct.lba_size
        if self.max_chunk % lba:
            raise ValueError(
                f"max_chunk ({self.max_chunk} bytes) must be a multiple of "
                f"storage.direct.lba_size ({lba})"
            )
        return self

    def shape(self) -> ModelShape:
        """The resolved model shape."""
        return self.model.shape()
