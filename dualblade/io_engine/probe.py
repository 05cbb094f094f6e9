"""What this machine's io_uring can do: availability, liburing, supported opcodes.

Used by ``dualblade doctor`` and by tests that must skip (with a reason) when the kernel lacks
an opcode.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass, field

from dualblade.io_engine import _liburing, _uapi
from dualblade.io_engine.errors import IOEngineError
from dualblade.io_engine.ring import Ring


@dataclass(frozen=True)
class IoUringProbe:
    """The outcome of probing io_uring."""

    available: bool
    reason: str | None
    kernel: str
    liburing_version: str | None
    liburing_path: str | None
    passthrough_rings: bool  # SQE128 | CQE32 rings can be created
    opcodes: dict[str, bool] = field(default_factory=dict)

    def supports(self, code: int) -> bool:
        """Whether the kernel reported the opcode as supported."""
        return self.opcodes.get(_uapi.OPCODE_NAMES.get(code, str(code)), False)


def probe() -> IoUringProbe:
    """Set up a small ring, ask the kernel which opcodes it supports, and tear it down."""
    kernel = platform.release()
    try:
        lib = _liburing.load()
    except IOEngineError as error:
        return IoUringProbe(False, str(error), kernel, None, None, False)
    try:
        Ring(2, name="probe").close()
    except IOEngineError as error:
        return IoUringProbe(False, str(error), kernel, lib.version, lib.path, False)
    try:
        Ring(2, passthrough=True, name="probe").close()
        passthrough = True
    except IOEngineError:
        passthrough = False
    supported: dict[str, bool] = {}
    handle = lib.io_uring_get_probe()
    if handle:
        try:
            for code, name in sorted(_uapi.OPCODE_NAMES.items()):
                supported[name] = bool(lib.io_uring_opcode_supported(ctypes.c_void_p(handle), code))
        finally:
            lib.io_uring_free_probe(handle)
    return IoUringProbe(True, None, kernel, lib.version, lib.path, passthrough, supported)
