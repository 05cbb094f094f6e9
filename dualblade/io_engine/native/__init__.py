"""The chunk pump's shared library (``chunk_pump.c``): building it and loading it.

The ring thread posts and counts chunks in C when this library loads (see ``chunk_pump.c`` for
why), and in Python otherwise: the library is an accelerator, never a requirement. It is built
from the source next to this file by ``scripts/bootstrap`` (``python -m
dualblade.io_engine.native``) with the system's C compiler and the kernel's UAPI headers
(``linux-libc-dev``), into ``_chunk_pump.so`` beside it. ``DUALBLADE_NATIVE_PUMP=0`` keeps the
ring on its Python path (for side-by-side measurements and tests).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("chunk_pump.c")
LIBRARY = Path(__file__).with_name("_chunk_pump.so")
#: The C side's ``DB_PUMP_ABI``: a library built from another version of the source is not used.
ABI = 3
_DISABLE_VARIABLE = "DUALBLADE_NATIVE_PUMP"

_c_int, _c_uint, _c_void_p = ctypes.c_int, ctypes.c_uint, ctypes.c_void_p


class NativeBuildError(RuntimeError):
    """The pump's library could not be built; the message says what to install or fix."""


def build(*, compiler: str | None = None, target: Path = LIBRARY) -> Path:
    """Compile ``chunk_pump.c`` into ``target`` (replaced atomically) and return its path.

    Raises:
        NativeBuildError: no C compiler, missing kernel headers, or the compiler failed.
    """
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeBuildError(
            "no C compiler (cc or gcc) to build the chunk pump: install gcc "
            "(apt-get install gcc linux-libc-dev); the ring keeps its Python path"
        )
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    command = [compiler, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(partial)]
    try:
        done = subprocess.run(
            [*command, str(SOURCE)], capture_output=True, text=True, check=False, timeout=120
        )
    except OSError as error:
        raise NativeBuildError(f"cannot run {compiler}: {error.strerror}") from error
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        hint = " (install linux-libc-dev)" if "linux/io_uring.h" in done.stderr else ""
        raise NativeBuildError(f"{compiler} failed on {SOURCE.name}{hint}:\n{done.stderr.strip()}")
    partial.replace(target)
    load.cache_clear()
    return target


def _bind(path: Path) -> ctypes.PyDLL:
    """The library, its calls that do not wait keeping the GIL (PyDLL, as the ring thread's
    other non-waiting liburing calls: io_engine/_liburing.py says why), and ``db_pump_run``,
    which waits, bound again through CDLL as ``db_pump_run_nogil``: it lets the GIL go."""
    library = ctypes.PyDLL(str(path))
    for name in ("db_pump_abi", "db_pump_slot_bytes", "db_pump_bytes"):
        getattr(library, name).restype = _c_int
        getattr(library, name).argtypes = ()
    library.db_pump_fill.restype = _c_int
    library.db_pump_fill.argtypes = (_c_void_p, _c_uint, _c_uint)
    library.db_pump_reap.restype = None
    library.db_pump_reap.argtypes = (_c_void_p,)
    run = ctypes.CDLL(str(path)).db_pump_run
    run.restype = _c_int
    run.argtypes = (_c_void_p,)
    library.db_pump_run_nogil = run  # type: ignore[attr-defined]
    return library


@functools.cache
def load() -> tuple[ctypes.PyDLL | None, str]:
    """The loaded library and "", or None and why not (not built, switched off, stale)."""
    if os.environ.get(_DISABLE_VARIABLE, "1") == "0":
        return None, f"{_DISABLE_VARIABLE}=0"
    if not LIBRARY.exists():
        return None, f"{LIBRARY} is not built (python -m dualblade.io_engine.native builds it)"
    try:
        library = _bind(LIBRARY)
    except (OSError, AttributeError) as error:
        return None, f"{LIBRARY} does not load: {error}"
    if library.db_pump_abi() != ABI:
        return None, f"{LIBRARY} was built from another version of chunk_pump.c: rebuild it"
    return library, ""


def describe_chunk_pump() -> str:
    """One line for ``dualblade doctor``: the library in use, or why the ring posts in Python."""
    library, why = load()
    return f"native ({LIBRARY})" if library is not None else f"Python path: {why}"
