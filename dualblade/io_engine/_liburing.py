"""ctypes bindings to liburing's FFI surface (ABI only: library loading and prototypes).

liburing 2.4 and later export every helper (``io_uring_get_sqe``, ``io_uring_prep_*``,
``io_uring_peek_batch_cqe``, ``io_uring_cq_advance`` ...) as real functions in
``liburing-ffi.so.2``, with the memory barriers the ring protocol needs, so no ring layout is
mirrored in Python. We load, in order:

1. ``$DUALBLADE_LIBURING`` if set (an explicit path, for packagers and tests);
2. the system's ``liburing-ffi.so.2`` (liburing >= 2.4);
3. the shared library bundled in the ``liburing`` wheel on PyPI, which exports the same C symbols
   (x86_64 only). Debian 12's own liburing is 2.3 and has no FFI library.

Calls that may wait (``io_uring_submit_and_wait``, setting up and tearing down, registering
buffers) go through :class:`ctypes.CDLL`, which releases the GIL: the ring thread waits inside C
while the event loop and copy threads keep running. The calls that never wait (getting and
preparing an SQE, submitting without waiting, peeking at and advancing the CQ ring) go through
:class:`ctypes.PyDLL`, which keeps it: a thread that lets the GIL go must take it back after the
call, and while the event loop runs Python it gets it back only when the loop blocks or at the
interpreter's switch interval (5 ms). With every call through ``CDLL`` the ring thread dropped the
GIL five times or more per chunk, and in LMCache's loads, while the loop posted a round's 512
reads, it submitted about one chunk per 5 ms and the disk idled (docs/lmcache.md).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

from dualblade.io_engine.errors import IoUringUnavailableError

_c_void_p = ctypes.c_void_p
_c_int = ctypes.c_int
_c_uint = ctypes.c_uint
_c_u64 = ctypes.c_uint64

#: Prototypes: name -> (restype, argtypes). Pointers to liburing structures are ``void *``: the
#: ring and probe are opaque to Python.
_PROTOTYPES: dict[str, tuple[object, tuple[object, ...]]] = {
    "io_uring_queue_init_params": (_c_int, (_c_uint, _c_void_p, _c_void_p)),
    "io_uring_queue_exit": (None, (_c_void_p,)),
    "io_uring_get_sqe": (_c_void_p, (_c_void_p,)),
    "io_uring_submit": (_c_int, (_c_void_p,)),
    "io_uring_submit_and_wait": (_c_int, (_c_void_p, _c_uint)),
    "io_uring_peek_batch_cqe": (_c_uint, (_c_void_p, _c_void_p, _c_uint)),
    "io_uring_cq_advance": (None, (_c_void_p, _c_uint)),
    "io_uring_register_buffers": (_c_int, (_c_void_p, _c_void_p, _c_uint)),
    "io_uring_unregister_buffers": (_c_int, (_c_void_p,)),
    "io_uring_register_buffers_sparse": (_c_int, (_c_void_p, _c_uint)),
    "io_uring_register_buffers_update_tag": (
        _c_int,
        (_c_void_p, _c_uint, _c_void_p, _c_void_p, _c_uint),
    ),
    "io_uring_prep_read": (None, (_c_void_p, _c_int, _c_void_p, _c_uint, _c_u64)),
    "io_uring_prep_write": (None, (_c_void_p, _c_int, _c_void_p, _c_uint, _c_u64)),
    "io_uring_prep_read_fixed": (None, (_c_void_p, _c_int, _c_void_p, _c_uint, _c_u64, _c_int)),
    "io_uring_prep_write_fixed": (None, (_c_void_p, _c_int, _c_void_p, _c_uint, _c_u64, _c_int)),
    "io_uring_prep_fallocate": (None, (_c_void_p, _c_int, _c_int, _c_u64, _c_u64)),
    "io_uring_prep_cancel64": (None, (_c_void_p, _c_u64, _c_int)),
    "io_uring_sqe_set_data64": (None, (_c_void_p, _c_u64)),
    "io_uring_sqe_set_flags": (None, (_c_void_p, _c_uint)),
    "io_uring_get_probe": (_c_void_p, ()),
    "io_uring_free_probe": (None, (_c_void_p,)),
    "io_uring_opcode_supported": (_c_int, (_c_void_p, _c_int)),
    "io_uring_major_version": (_c_int, ()),
    "io_uring_minor_version": (_c_int, ()),
}

#: The calls that never wait, bound through ``ctypes.PyDLL`` (the GIL kept: see the module
#: docstring). ``io_uring_submit`` enters the kernel without waiting for completions.
_KEEP_GIL = frozenset(
    {
        "io_uring_get_sqe",
        "io_uring_submit",
        "io_uring_peek_batch_cqe",
        "io_uring_cq_advance",
        "io_uring_prep_read",
        "io_uring_prep_write",
        "io_uring_prep_read_fixed",
        "io_uring_prep_write_fixed",
        "io_uring_prep_fallocate",
        "io_uring_prep_cancel64",
        "io_uring_sqe_set_data64",
        "io_uring_sqe_set_flags",
    }
)

#: Bytes reserved for ``struct io_uring``. liburing 2.4-2.15 use about 216 bytes; the struct is
#: opaque to us and only ever passed by pointer, so a generous, aligned block is enough.
RING_STRUCT_BYTES = 1024


class LibUring:
    """The loaded library: its path, version and the bound functions as attributes.

    Functions are set as instance attributes (not looked up through ``__getattr__``) because the
    ring thread calls several of them per chunk and a failed attribute lookup costs about as much
    as the C call itself.
    """

    def __init__(self, path: str, cdll: ctypes.CDLL, pydll: ctypes.PyDLL) -> None:
        self.path = path
        self.cdll = cdll
        for name, (restype, argtypes) in _PROTOTYPES.items():
            library = pydll if name in _KEEP_GIL else cdll
            function = getattr(library, name)  # AttributeError: not an FFI build
            function.restype = restype
            function.argtypes = argtypes
            setattr(self, name, function)
        self.version = f"{cdll.io_uring_major_version()}.{cdll.io_uring_minor_version()}"

    def __getattr__(self, name: str) -> Any:
        """Only reached for names that are not bound: say which."""
        raise AttributeError(f"liburing function {name!r} is not bound in dualblade")


def _candidates() -> list[str]:
    paths: list[str] = []
    explicit = os.environ.get("DUALBLADE_LIBURING")
    if explicit:
        paths.append(explicit)
    paths.append("liburing-ffi.so.2")
    spec = importlib.util.find_spec("liburing")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            paths.extend(str(p) for p in sorted(Path(folder).glob("liburing*.so")))
    return paths


def _bind(path: str) -> LibUring:
    return LibUring(path, ctypes.CDLL(path), ctypes.PyDLL(path))


@functools.cache
def load() -> LibUring:
    """Load liburing's FFI library once per process.

    Raises:
        IoUringUnavailableError: no candidate library loads or exports the FFI helpers; the
            message lists what was tried and how to install one.
    """
    tried: list[str] = []
    for path in _candidates():
        try:
            return _bind(path)
        except (OSError, AttributeError) as error:
            tried.append(f"{path}: {error}")
    raise IoUringUnavailableError(
        "no liburing FFI library found (need liburing >= 2.4's liburing-ffi.so.2, or "
        "`pip install liburing` on x86_64); tried: " + "; ".join(tried)
    )
