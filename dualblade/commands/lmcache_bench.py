"""``dualblade lmcache-bench``: LMCache's ``lmcache bench l2`` on our adapter and LMCache's own,
each inside one memory cgroup, caches dropped between them, with fio as the floor.

Why a wrapper: ``lmcache bench l2`` runs one adapter per process (it benchmarks the first
``--l2-adapter`` it is given) and knows nothing of memory limits or the page cache. Disk
adapters are only comparable on the same disk, from a cold cache, under the same limit — and the
limit is what decides between them: the page cache holds part of the stored set, and what does
not fit is read from the disk. So each adapter runs in a fresh folder under ``--dir``, as a child
process that joins a memory cgroup first, and caches are dropped before each. The disk's
reference is fio's O_DIRECT read of our own adapter's direct extents, taken inside its process
after LMCache's last load and before the adapter closes (it trims them then): data as old as the
loads read, where they read it, at our queue depth and chunk size
(``dualblade.integrations.lmcache.ExtentReferenceAdapter``).

The default limit leaves page-cache room for about half of the stored set beyond the
benchmark's own memory: ``L1 (2 x keys per round x size) + --overhead + stored / 2``.
Root is needed for the cgroup (cgroup v1 here, v2 where delegated) and for dropping caches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from dualblade.commands._lmcache_report import lmcache_ratios, print_lmcache_table
from dualblade.commands._output import print_json
from dualblade.errors import ConfigError, DualbladeError
from dualblade.io_engine import fio_path
from dualblade.pipeline import default_cache_dir, format_size, parse_size

ADAPTERS = ("dualblade", "dualblade-direct", "fs-odirect", "fs")
_PLUGIN = {"type": "plugin", "module_path": "dualblade.integrations.lmcache"}
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_REFERENCE = "extent-reference.json"  # what ExtentReferenceAdapter writes in the adapter's folder


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "lmcache-bench",
        help="lmcache bench l2: our LMCache adapter vs LMCache's fs adapter, in a memory cgroup",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument(
        "--dir",
        default=str(default_cache_dir() / "lmcache-bench"),
        help="where every adapter's files and fio's go, on the disk under test "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--adapters",
        default=",".join(ADAPTERS),
        help="which to run, in order: dualblade (dual policy), dualblade-direct (all direct), "
        "fs-odirect, fs (LMCache's fs adapter with use_odirect on and off), and with --block "
        "dualblade-block and raw-block (LMCache's io_uring raw-block adapter) "
        "(default: %(default)s)",
    )
    parser.add_argument("--block", help="a block device for dualblade-block and raw-block")
    parser.add_argument("--num-keys", type=int, default=8, help="keys per submit (default: 8)")
    parser.add_argument(
        "--in-flight", type=int, default=64, help="submits in flight per round (default: 64)"
    )
    parser.add_argument(
        "--data-size-kb", type=int, default=1024, help="KiB per key (default: 1024)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (default: 3)")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="(default: 1)")
    parser.add_argument(
        "--memory-limit",
        default="auto",
        help="the cgroup's limit: a size, 'auto' (see above) or 'none' (default: %(default)s)",
    )
    parser.add_argument(
        "--overhead",
        default="512MiB",
        # Runs that keep none of their data in the page cache (all direct, fs with O_DIRECT)
        # peaked 0.85-0.91 GiB above L1 here, but about 0.5 GiB of that is clean file pages
        # (Python, torch, LMCache) that the kernel reclaims and the store's budget counts as
        # room: with 1 GiB the budget came to 68-71 % of the stored set, with 512 MiB 45-47 %.
        help="what the store's budget counts as the process's own besides L1, for 'auto' "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--capacity",
        default=None,
        help="our adapter's capacity (default: the stored set; an L2 tier runs full, and its "
        "page-cache share is the budget over this capacity)",
    )
    parser.add_argument(
        "--copy-threads", type=int, default=8, help="our adapter's copy threads (default: 8)"
    )
    parser.add_argument(
        "--max-chunk", default="1MiB", help="our adapter's largest I/O (default: %(default)s)"
    )
    # loads go straight from the ring into LMCache's memory: the ring bounds what is in flight
    # (the adapter's own default, params.ADAPTER_DEFAULTS)
    parser.add_argument("--queue-depth", type=int, default=64, help="ours and fio's (default: 64)")
    parser.add_argument(
        "--no-fio", action="store_true", help="skip fio's read of our adapters' direct extents"
    )
    parser.add_argument("--json", action="store_true", help="print JSON, not the table")
    parser.add_argument("--out", help="also write the JSON document to this file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.adapters.split(",") if n.strip()]
    known = (*ADAPTERS, "dualblade-block", "raw-block")
    if not names or any(n not in known for n in names):
        raise ConfigError(f"--adapters takes a list of {', '.join(known)}; got {args.adapters!r}")
    if any(n in ("dualblade-block", "raw-block") for n in names) and not args.block:
        raise ConfigError("dualblade-block and raw-block need --block DEVICE")
    if min(args.num_keys, args.in_flight, args.data_size_kb, args.rounds, args.queue_depth) < 1:
        raise ConfigError(
            "--num-keys, --in-flight, --data-size-kb, --rounds and --queue-depth must be >= 1"
        )
    size = args.data_size_kb << 10
    per_round = args.num_keys * args.in_flight * size
    stored = (args.rounds + args.warmup_rounds) * per_round
    limit = _limit(args.memory_limit, 2 * per_round + parse_size(args.overhead) + stored // 2)
    capacity = _size_option("--capacity", args.capacity) if args.capacity else stored
    root = Path(args.dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    setup = {"key_bytes": size, "keys_per_round": per_round // size, "stored_bytes": stored}
    setup |= {"l1_bytes": 2 * per_round, "memory_limit": limit, "dir": str(root)}
    setup["capacity"] = capacity
    _say(
        f"stored set {format_size(stored)}, L1 {format_size(2 * per_round)}, memory limit "
        f"{format_size(limit) if limit else 'none'}; files under {root}"
    )
    if not args.no_fio and fio_path() is None:
        _say("fio is not installed: no reference read of our extents")
    results = [_run_adapter(name, args, root, limit, capacity) for name in names]
    # the all-direct adapter's own extents: the reference for its loads
    fio = next(
        (r.get("fio_own_extents") for r in results if r["adapter"] == "dualblade-direct"), None
    )
    document = {"setup": setup, "adapters": results, "fio_read": fio}
    document["ratios"] = lmcache_ratios(results, fio)
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=2, default=str) + "\n")
    if args.json:
        print_json(document)
    else:
        print_lmcache_table(document)
    return 0 if all(r.get("verified") for r in results) else 1


def _limit(text: str, auto: int) -> int | None:
    if text in ("none", "auto"):
        return None if text == "none" else auto
    return _size_option("--memory-limit", text)


def _size_option(option: str, text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise ConfigError(f"{option}: {error}") from None


def _say(line: str) -> None:
    print(f"lmcache-bench: {line}", file=sys.stderr, flush=True)  # progress, not the report


# -- one adapter -----------------------------------------------------------------------------------
def _spec(
    name: str, folder: Path, args: argparse.Namespace, size: int, capacity: int
) -> dict[str, Any]:
    spec = _adapter_spec(name, folder, args, size, capacity)
    if spec.get("class_name") == "DualBladeL2Adapter" and not args.no_fio and fio_path():
        # the same adapter, which has fio read its direct extents before it closes
        params = {**spec["adapter_params"], "reference_out": str(folder / _REFERENCE)}
        spec = {**spec, "class_name": "ExtentReferenceAdapter", "adapter_params": params}
    return spec


def _adapter_spec(
    name: str, folder: Path, args: argparse.Namespace, size: int, capacity: int
) -> dict[str, Any]:
    own = {
        "object_size": size,
        "capacity": capacity,
        "copy_threads": args.copy_threads,
        "queue_depth": args.queue_depth,
        "max_chunk": args.max_chunk,
        "stats_file": str(folder / "adapter-stats.json"),
        "storage": {"page_cache_dir": str(folder / "pc"), "direct": {"path": str(folder / "d.kv")}},
    }
    if name == "dualblade":
        return {**_PLUGIN, "class_name": "DualBladeL2Adapter", "adapter_params": own}
    if name == "dualblade-direct":
        params = {**own, "policy": "direct"}
        return {**_PLUGIN, "class_name": "DualBladeL2Adapter", "adapter_params": params}
    if name == "dualblade-block":
        extent = _device_bytes(args.block)
        direct = {
            "kind": "block",
            "path": args.block,
            "extent_size": extent,
            "lba_size": _device_lba(args.block),
        }
        params = {**own, "storage": {**own["storage"], "direct": direct}}
        return {**_PLUGIN, "class_name": "DualBladeL2Adapter", "adapter_params": params}
    if name == "raw-block":
        return {"type": "raw_block", "device_path": args.block, "slot_bytes": size + 4096}
    odirect = name == "fs-odirect"
    return {"type": "fs", "base_path": str(folder / "fs"), "use_odirect": odirect}


def _run_adapter(
    name: str, args: argparse.Namespace, root: Path, limit: int | None, capacity: int
) -> dict[str, Any]:
    size = args.data_size_kb << 10
    folder = root / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    spec = _spec(name, folder, args, size, capacity)
    out = folder / "bench.json"
    command = [
        sys.executable,
        "-c",
        "from lmcache.cli.main import main; main()",
        "bench",
        "l2",
        "--l2-adapter",
        json.dumps(spec),
        *("--num-keys", str(args.num_keys), "--in-flight", str(args.in_flight)),
        *("--data-size-kb", str(args.data_size_kb), "--l1-align-bytes", "4096"),
        *("--rounds", str(args.rounds), "--warmup-rounds", str(args.warmup_rounds)),
        *("--no-skip-verify", "--format", "json", "--output", str(out)),
    ]
    dropped = _drop_caches()
    _say(f"{name}: caches {'dropped' if dropped else 'NOT dropped (not root)'}; running")
    group = _cgroup(limit) if limit else None
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONWARNINGS": "ignore"}
    start = time.monotonic()
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=env,
            preexec_fn=(lambda: _join(group)) if group else None,
            check=False,
        )
    finally:
        peak = _peak(group) if group else None
        if group:
            _remove(group)
    result: dict[str, Any] = {
        "adapter": name,
        "spec": spec,
        "exit_code": done.returncode,
        "seconds": round(time.monotonic() - start, 1),
        "cgroup_peak_bytes": peak,
        "verified": done.returncode == 0 and "data verified OK" in done.stdout,
    }
    if out.exists():
        metrics = json.loads(out.read_text())["metrics"]
        for op in (v for k, v in metrics.items() if k.startswith("op_")):
            key = str(op["operation"]).lower()
            result[f"{key}_mbps"] = op.get("throughput_avg_mbps")
            result[f"{key}_ok"] = f"{op.get('total_success')}/{op.get('total_keys')}"
    stats = folder / "adapter-stats.json"
    if stats.exists():
        adapter = json.loads(stats.read_text())
        store = adapter.get("store", {})
        result["dualblade"] = {
            "placed": adapter.get("placed"),
            "read_bytes": store.get("read_bytes"),
            "page_cache_hit_rate": store.get("page_cache_hit_rate"),
            "evictions": adapter.get("evictions"),
            "ledger": store.get("ledger"),
            "load_failures": adapter.get("load_failures"),
            "store_failures": adapter.get("store_failures"),
        }
    reference = folder / _REFERENCE
    if reference.exists():
        result["fio_own_extents"] = json.loads(reference.read_text())
        _say(f"{name}: fio on its own direct extents: {result['fio_own_extents']}")
    if done.returncode != 0:
        lines = (done.stdout + "\n" + done.stderr).splitlines()
        said = [line for line in lines if "Failed" in line or "Error" in line] or lines[-5:]
        result["error"] = "\n".join(said[-5:])[-2000:]
    _say(f"{name}: load {result.get('load_mbps')} MB/s, verified {result['verified']}")
    shutil.rmtree(folder, ignore_errors=True)  # free the disk for the next adapter
    return result


def _device_bytes(path: str) -> int:
    with open(path, "rb") as device:
        return device.seek(0, os.SEEK_END) // (1 << 20) * (1 << 20)


def _device_lba(path: str) -> int:
    """The block device's logical block size from sysfs (a partition's is its disk's)."""
    block = Path("/sys/class/block") / Path(os.path.realpath(path)).name
    for queue in (block / "queue", block / ".." / "queue"):
        with contextlib.suppress(OSError, ValueError):
            return int((queue / "logical_block_size").read_text())
    return 512


# -- the host: caches, cgroups, fio ----------------------------------------------------------------
def _drop_caches() -> bool:
    """``sync`` and drop the page cache (root); False where that is not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _cgroup(limit: int) -> Path:
    """A fresh memory cgroup limited to ``limit`` bytes (v1's memory tree, else v2's root).

    Raises:
        DualbladeError: no memory cgroup can be made here (not root, no controller).
    """
    name = f"dualblade-lmcache-{uuid.uuid4().hex[:8]}"
    v1 = _CGROUP_V1.is_dir()
    group = (_CGROUP_V1 if v1 else _CGROUP_ROOT) / name
    try:
        group.mkdir()
        (group / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(limit))
    except OSError as error:
        raise DualbladeError(
            f"cannot make a memory cgroup at {group}: {error.strerror}; run as root, or give "
            "--memory-limit none to run without a limit"
        ) from None
    return group


def _join(group: Path) -> None:
    (group / "cgroup.procs").write_text(str(os.getpid()))


def _peak(group: Path) -> int | None:
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        try:
            return int((group / name).read_text())
        except (OSError, ValueError):
            continue
    return None


def _remove(group: Path) -> None:
    for _ in range(50):  # the child's pages may take a moment to leave the group
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
