"""Running fio with the same parameters as our own measurement, as the disk's reference.

Here, beside the engine, so that every room that measures the engine can set fio beside it:
the benchmarks, and the LMCache adapter's reference read of its own extents."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass

from dualblade.errors import DualbladeError


@dataclass(frozen=True)
class FioResult:
    """One fio job's outcome."""

    bytes_per_s: float
    total_ios: int
    usr_cpu_us_per_io: float
    runtime_s: float


#: fio's buffers come from glibc's malloc; this tunable (glibc 2.35 and later; older ones ignore
#: it) has malloc advise its large blocks into transparent huge pages, as our own buffers are
#: (``buffers.py``). From 4 KiB pages a 1 MiB read needs 256 segments, and a virtio disk that
#: takes 254 splits each one in two: fio then read this VM's disk at 1.9-2.2 GB/s in 485 KiB
#: requests while the same reads from huge pages ran at 3.1-3.4 GB/s in 870 KiB ones, and our
#: loads, whose buffers are huge pages, beat that reference (docs/lmcache.md).
HUGE_PAGE_MALLOC = "glibc.malloc.hugetlb=1"


def fio_environment() -> dict[str, str]:
    """The environment fio runs in: ours, with malloc's huge-page tunable added."""
    tunables = os.environ.get("GLIBC_TUNABLES")
    merged = f"{tunables}:{HUGE_PAGE_MALLOC}" if tunables else HUGE_PAGE_MALLOC
    return {**os.environ, "GLIBC_TUNABLES": merged}


def fio_path() -> str | None:
    """The fio binary on PATH, or None."""
    return shutil.which("fio")


def run_fio(
    path: str,
    op: str,
    size: int,
    block_size: int,
    queue_depth: int,
    *,
    direct: bool = True,
    passthrough: bool = False,
    offset: int = 0,
    io_size: int | None = None,
) -> FioResult:
    """Run one sequential fio job (io_uring engine, fixed buffers in huge pages, as ours are)
    and parse its JSON.

    ``offset`` and ``size`` bound the region of ``path`` it moves; ``io_size``, when larger than
    ``size``, makes fio go over the region again (e.g. as many passes as the measured side made).

    ``passthrough``: ``path`` is an NVMe generic char device (``/dev/ngXnY``), driven as our
    passthrough path drives it: fio's ``io_uring_cmd`` engine sends NVMe read and write commands
    through the ring, with no block layer and no page cache (``direct`` does not apply).

    Raises:
        DualbladeError: fio is missing or failed; the message carries fio's stderr.
    """
    binary = fio_path()
    if binary is None:
        raise DualbladeError("fio is not installed (apt-get install fio)")
    command = [
        binary,
        "--name=dualblade-ref",
        f"--filename={path}",
        f"--rw={op}",
        f"--bs={block_size}",
        f"--size={size}",
        *((f"--offset={offset}",) if offset else ()),
        *((f"--io_size={io_size}",) if io_size is not None else ()),
        f"--iodepth={queue_depth}",
        *(
            # Passthrough commands meet no block-layer plug, so batches cost the device nothing:
            # in the QEMU guest, 8 SQEs a submit and up to 32 CQEs a reap read at a median 1.54
            # GB/s at 128 KiB against 1.23 without (4 rounds alternated): fio at its best there.
            (
                "--ioengine=io_uring_cmd",
                "--cmd_type=nvme",
                "--iodepth_batch_submit=8",
                "--iodepth_batch_complete_min=1",
                "--iodepth_batch_complete_max=32",
            )
            if passthrough
            else (f"--direct={int(direct)}", "--ioengine=io_uring")
        ),
        "--fixedbufs=1",
        "--iomem_align=2m",  # the first buffer on a huge page's start, the rest follow it
        "--thread=1",
        # fio at its fastest: no clock reads per I/O for latency statistics we do not use. In
        # the QEMU guest, where each guest CPU microsecond is emulated, they held fio below our
        # passthrough (once the chunk pump took our per-command work out of Python), so fio was
        # no limit there; on the host's CPUs they cost next to nothing.
        "--gtod_reduce=1",
        "--output-format=json",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, env=fio_environment()
    )
    if done.returncode != 0:
        raise DualbladeError(f"fio failed ({' '.join(command)}): {done.stderr.strip()}")
    # fio may print warnings before the JSON document.
    report = json.loads(done.stdout[done.stdout.index("{") :])
    job = report["jobs"][0]
    side = job["write" if op == "write" else "read"]
    runtime_s = job["job_runtime"] / 1000.0
    total_ios = int(side["total_ios"])
    usr_cpu_us = job["usr_cpu"] / 100.0 * runtime_s * 1e6
    return FioResult(
        bytes_per_s=float(side["bw_bytes"]),
        total_ios=total_ios,
        usr_cpu_us_per_io=usr_cpu_us / total_ios if total_ios else 0.0,
        runtime_s=runtime_s,
    )
