"""Byte quantities: the one parser for ``"4GiB"``-style sizes; distinct types for bytes vs blocks.

Every size a user writes (config files, environment overrides, ``--memory-limit``) goes through
:func:`parse_size`, so ``"4G"`` means the same thing everywhere. Inside the planner, a count of
bytes, a count of logical blocks and a logical block address are all ``int`` at run time but
different :class:`~typing.NewType` s for mypy: mixing them up (adding bytes to an LBA, the classic
offset bug of block I/O) is a type error rather than a corrupted neighbour.
"""

from __future__ import annotations

import re
from typing import NewType

from dualblade.errors import ConfigError

#: A count of bytes (sizes, offsets into buffers and files).
ByteCount = NewType("ByteCount", int)
#: A count of logical blocks of the target's LBA size.
BlockCount = NewType("BlockCount", int)
#: A logical block address on the target (for files: byte offset divided by the LBA size).
Lba = NewType("Lba", int)

#: The host page size the planner assumes for page-cache footprints and pinned buffers. The
#: page cache works in 4 KiB pages on every architecture dualblade targets (x86_64, aarch64 with
#: 4 KiB pages); a 64 KiB-page kernel would only make the footprint estimate slightly low.
PAGE_SIZE = ByteCount(4096)

_KIB = 1024
# Binary units (KiB, MiB, ...) and the bare letters K, M, G, T are powers of 1024 — the bare
# letters follow cgroup's memory.limit_in_bytes and docker's ``--memory``; the SI spellings KB,
# MB, GB, TB are powers of 1000 because that is what they mean on an SSD's label.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": _KIB,
    "kib": _KIB,
    "kb": 1000,
    "m": _KIB**2,
    "mib": _KIB**2,
    "mb": 1000**2,
    "g": _KIB**3,
    "gib": _KIB**3,
    "gb": 1000**3,
    "t": _KIB**4,
    "tib": _KIB**4,
    "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

#: The human description of the accepted syntax, reused in error messages and the JSON Schema.
SIZE_SYNTAX = (
    "a non-negative integer number of bytes or a string such as '512', '64KiB', '1.5GiB' or '4G' "
    "(KiB/MiB/GiB/TiB and K/M/G/T are powers of 1024, KB/MB/GB/TB powers of 1000)"
)


def parse_size(value: object) -> ByteCount:
    """Turn ``4096``, ``"4KiB"``, ``"1.5 GiB"`` or ``"4G"`` into a byte count.

    Raises:
        ConfigError: the value is negative, not a whole number of bytes, has an unknown unit or
            is of another type (booleans are refused although ``bool`` is an ``int``).
    """
    if isinstance(value, bool):
        raise ConfigError(f"a size must be {SIZE_SYNTAX}, not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"a size must not be negative (got {value})")
        return ByteCount(value)
    if not isinstance(value, str):
        raise ConfigError(f"a size must be {SIZE_SYNTAX} (got {value!r})")
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{value!r} is not a size: use {SIZE_SYNTAX}")
    number, multiplier = match.group(1), _UNITS[unit]
    if "." in number:
        whole, frac = number.split(".")
        # Exact rational arithmetic: 1.5GiB must be exactly 1610612736, not a float rounding.
        numerator = int(whole + frac) * multiplier
        denominator = 10 ** len(frac)
        if numerator % denominator:
            raise ConfigError(f"{value!r} is not a whole number of bytes")
        return ByteCount(numerator // denominator)
    return ByteCount(int(number) * multiplier)


def format_size(nbytes: int) -> str:
    """Format a byte count for people: ``format_size(3 * 2**30) == "3.00 GiB"``.

    Exact byte counts are what JSON output carries; this is only for tables and messages.
    """
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{nbytes} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= value`` (``multiple > 0``)."""
    assert multiple > 0, multiple
    return -(-value // multiple) * multiple
