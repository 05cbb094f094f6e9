"""Creating an io_uring instance: the flags asked for, the retry without them on older kernels,
and why setup failed, in words a user can act on.

Kept apart from :mod:`.ring`, which drives a ring once it exists.
"""

from __future__ import annotations

import ctypes
import errno
import os

from dualblade.io_engine import _uapi
from dualblade.io_engine._liburing import LibUring
from dualblade.io_engine.errors import IoUringUnavailableError


def init_ring(lib: LibUring, ring: int, queue_depth: int, *, passthrough: bool) -> int:
    """Initialise the liburing ``struct io_uring`` at address ``ring``; return its setup flags.

    Call it on the thread that will submit: with SINGLE_ISSUER the creator is the submitter.

    Raises:
        IoUringUnavailableError: the kernel refused the ring; the message says why.
    """
    base_flags = _uapi.IORING_SETUP_SQE128 | _uapi.IORING_SETUP_CQE32 if passthrough else 0
    # Room for every chunk plus the wake-up read and one cancel per in-flight chunk.
    entries = 1 << (2 * queue_depth + 2).bit_length()
    # Completion work is run only when this thread waits (DEFER_TASKRUN, Linux 6.1+), in a
    # batch, instead of interrupting it once per completion; that needs one submitter,
    # which the ring thread is. Older kernels refuse the flags: retry without them.
    rc = -errno.EINVAL
    for extra in (_uapi.IORING_SETUP_SINGLE_ISSUER | _uapi.IORING_SETUP_DEFER_TASKRUN, 0):
        params = _uapi.IoUringParams()
        params.flags = base_flags | extra
        rc = lib.io_uring_queue_init_params(entries, ring, ctypes.byref(params))
        if rc != -errno.EINVAL:
            break
    if rc < 0:
        raise IoUringUnavailableError(explain_setup_failure(-rc))
    flags: int = params.flags
    return flags


def explain_setup_failure(code: int) -> str:
    """Why ``io_uring_queue_init`` failed with errno ``code``, and what to do about it."""
    disabled = _io_uring_disabled_sysctl()
    if disabled:
        return (
            f"io_uring is disabled by the sysctl kernel.io_uring_disabled={disabled} "
            "(set it to 0, or use compat mode 'on')"
        )
    reasons = {
        errno.ENOSYS: "the kernel has no io_uring (too old, or compiled out)",
        errno.EPERM: "io_uring is blocked for this process (seccomp or container policy)",
        errno.ENOMEM: "not enough locked memory for the ring (raise RLIMIT_MEMLOCK)",
        errno.EINVAL: "the kernel rejected the ring flags (SQE128/CQE32 need Linux 5.19+)",
    }
    return f"io_uring_queue_init failed: {os.strerror(code)}; " + reasons.get(code, "see dmesg")


def _io_uring_disabled_sysctl() -> int:
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0
