"""``dualblade doctor``: what this machine offers dualblade, and what is missing."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import platform
import resource
import shutil
import tempfile
from typing import Any

from dualblade.commands._output import print_json
from dualblade.pipeline import default_cache_dir


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "doctor", help="report kernel, io_uring, liburing, memory limits, targets and CUDA"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def _io_uring() -> dict[str, Any]:
    from dualblade.io_engine import describe_chunk_pump, probe

    result = probe()
    return {
        "chunk_pump": describe_chunk_pump(),
        "available": result.available,
        "reason": result.reason,
        "liburing_version": result.liburing_version,
        "liburing_path": result.liburing_path,
        "passthrough_rings": result.passthrough_rings,
        "opcodes": result.opcodes,
    }


def _memory() -> dict[str, Any]:
    from dualblade.pipeline import discover_memory

    try:
        snapshot = discover_memory()
    except Exception as error:  # doctor reports, never fails
        return {"error": str(error)}
    return dataclasses.asdict(snapshot)


def _direct_file_usable(folder: str) -> dict[str, Any]:
    from dualblade.io_engine import DirectFile, TargetError

    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            DirectFile(os.path.join(scratch, "probe.dat"), 1 << 20).close()
        return {"usable": True, "folder": folder}
    except (OSError, TargetError) as error:
        return {"usable": False, "folder": folder, "reason": str(error)}


def _nvme_namespaces() -> list[dict[str, Any]]:
    from dualblade.io_engine import NvmeNamespace, TargetError

    found: list[dict[str, Any]] = []
    for path in sorted(glob.glob("/dev/ng*n*")):
        try:
            with NvmeNamespace(path) as namespace:
                found.append(namespace.describe())
        except TargetError as error:
            found.append({"name": path, "error": str(error)})
    return found


def _cuda() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "torch": torch.__version__}
    return {
        "available": True,
        "torch": torch.__version__,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def collect() -> dict[str, Any]:
    """Everything doctor reports, as a JSON-ready dict."""
    memlock_soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unavailable"
    cache = str(default_cache_dir())
    return {
        "kernel": platform.release(),
        "python": platform.python_version(),
        "root": os.geteuid() == 0,
        "io_uring": _io_uring(),
        "memory": _memory(),
        "memlock_limit_bytes": None if memlock_soft == resource.RLIM_INFINITY else memlock_soft,
        "transparent_hugepages": thp,
        "targets": {
            "file": _direct_file_usable(cache),
            "block": {
                "usable": os.geteuid() == 0,
                "reason": None
                if os.geteuid() == 0
                else "raw block devices need root (or the disk group)",
            },
            "nvme": _nvme_namespaces(),
        },
        "fio": shutil.which("fio"),
        "cuda": _cuda(),
    }


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print_json(report)
        return 0
    uring = report["io_uring"]
    print(
        f"kernel             {report['kernel']} (python {report['python']}, root={report['root']})"
    )
    if uring["available"]:
        supported = [name for name, ok in uring["opcodes"].items() if ok]
        print(
            f"io_uring           available, liburing {uring['liburing_version']} "
            f"({uring['liburing_path']})"
        )
        print(f"  passthrough      {'yes' if uring['passthrough_rings'] else 'no'} (SQE128/CQE32)")
        print(f"  opcodes          {', '.join(supported)}")
        print(f"  chunk pump       {uring['chunk_pump']}")
    else:
        print(f"io_uring           UNAVAILABLE: {uring['reason']} (compat engine will be used)")
    memory = report["memory"]
    cgroup = memory.get("cgroup") if isinstance(memory, dict) else None
    host = memory.get("host", {}) if isinstance(memory, dict) else {}
    print(
        f"memory             total {host.get('total_bytes')} B, available "
        f"{host.get('available_bytes')} B"
    )
    if cgroup:
        print(
            f"  cgroup v{cgroup['version']}       {cgroup['path']}: limit {cgroup['limit_bytes']}, "
            f"usage {cgroup['usage_bytes']}"
        )
    print(f"memlock limit      {report['memlock_limit_bytes'] or 'unlimited'}")
    print(f"huge pages (THP)   {report['transparent_hugepages']}")
    targets = report["targets"]
    file_target = targets["file"]
    print(
        f"target file        {'usable' if file_target['usable'] else 'NOT usable'} in "
        f"{file_target['folder']} {file_target.get('reason') or ''}"
    )
    print(f"target block       {'usable' if targets['block']['usable'] else 'needs root'}")
    if targets["nvme"]:
        for namespace in targets["nvme"]:
            if "error" in namespace:
                print(f"target nvme        {namespace['name']}: {namespace['error']}")
                continue
            mdts = namespace["mdts_bytes"]
            dsm = "yes" if namespace["dsm"] else "no"
            print(
                f"target nvme        {namespace['name']}: {namespace['size'] / 2**30:.1f} GiB, "
                f"LBA {namespace['lba_size']} B, MDTS {namespace['mdts']} "
                f"({'no limit' if mdts is None else f'{mdts >> 10} KiB'}), max transfer "
                f"{namespace['max_transfer'] >> 10} KiB, DSM {dsm}, "
                f"{namespace['model']}"
            )
    else:
        print("target nvme        no NVMe namespaces (/dev/ngXnY)")
    print(f"fio                {report['fio'] or 'not installed'}")
    cuda = report["cuda"]
    print(
        f"cuda               {cuda.get('devices') if cuda['available'] else 'not available'} "
        f"(torch {cuda['torch']})"
    )
    return 0
