"""Memory discovery against recorded trees (v1 hybrid, v2 service, v2 container), synthetic edge
cases, and real cgroup v1 groups that the tests create as root."""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from dualblade.pipeline import (
    MemoryDiscoveryError,
    discover_memory,
    find_memory_cgroup,
    read_cgroup_v1,
    read_meminfo,
)

DATA = Path(__file__).parent / "data"
V1_MOUNT = Path("/sys/fs/cgroup/memory")


def test_recorded_v2_service():
    root = DATA / "cgroup2-service"
    location = find_memory_cgroup(root)
    assert location is not None
    assert (location.version, location.path) == (2, "/system.slice/dualblade-bench.service")
    assert location.directory == root / "sys/fs/cgroup/system.slice/dualblade-bench.service"
    snapshot = discover_memory(root)
    cgroup = snapshot.cgroup
    assert cgroup is not None
    assert cgroup.limit_bytes == 6 << 30
    assert cgroup.usage_bytes == 1 << 30
    # file LRU pages minus the file pages mapped into processes (their code: not budgetable):
    # 10 MiB mapped, of which 8 MiB is shared memory, which is not on the file LRU
    assert cgroup.file_bytes == 216006656 + 429916160 - (10485760 - 8388608)
    # the reclaimable slab (the page cache's metadata, mostly) is not in use either
    assert cgroup.reclaimable_kernel_bytes == 9437184
    assert cgroup.non_file_bytes == (1 << 30) - 645922816 + (10485760 - 8388608) - 9437184
    assert snapshot.host.total_bytes == 16318504 * 1024
    assert snapshot.host.available_bytes == 12871244 * 1024
    assert snapshot.host.file_bytes == (2818048 + 4194304) * 1024


def test_recorded_v2_container_high_is_tighter():
    snapshot = discover_memory(DATA / "cgroup2-container")
    assert snapshot.cgroup is not None
    assert snapshot.cgroup.path == "/"
    assert snapshot.cgroup.limit_bytes == 3 << 30  # memory.high 3 GiB under memory.max 4 GiB
    assert snapshot.cgroup.file_bytes == 805306368 + 536870912 - (10485760 - 8388608)


def test_recorded_v1_hybrid_prefers_the_v1_memory_controller():
    root = DATA / "cgroup1-hybrid"
    location = find_memory_cgroup(root)
    assert location is not None
    assert location.version == 1
    assert location.path == "/process_api/e136038c93ca89651d87eadad92afa01"
    cgroup = discover_memory(root).cgroup
    assert cgroup is not None
    assert cgroup.limit_bytes is None  # 9223372036854771712 means unlimited
    assert cgroup.usage_bytes == 151908352
    assert cgroup.file_bytes == 95236096 + 51511296 - 106496


def _tree(tmp_path, cgroup_line, mountinfo, files):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup_line)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    shutil.copy(DATA / "cgroup2-service/proc/meminfo", tmp_path / "proc/meminfo")
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


V2_MOUNT = "26 22 0:24 / /sys/fs/cgroup rw,relatime shared:4 - cgroup2 cgroup2 rw\n"
STAT = "anon 100\nfile 50\nactive_file 20\ninactive_file 30\n"


def test_v2_parent_limit_binds_the_child(tmp_path):
    root = _tree(
        tmp_path,
        "0::/a/b\n",
        V2_MOUNT,
        {
            "sys/fs/cgroup/a/memory.max": "1073741824\n",
            "sys/fs/cgroup/a/b/memory.max": "max\n",
            "sys/fs/cgroup/a/b/memory.high": "max\n",
            "sys/fs/cgroup/a/b/memory.current": "150\n",
            "sys/fs/cgroup/a/b/memory.stat": STAT,
        },
    )
    cgroup = discover_memory(root).cgroup
    assert cgroup is not None
    assert (cgroup.limit_bytes, cgroup.usage_bytes, cgroup.file_bytes) == (1 << 30, 150, 50)


def test_v2_root_cgroup_has_no_accounting(tmp_path):
    root = _tree(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cgroup.controllers": "memory\n"})
    assert find_memory_cgroup(root) is None
    assert discover_memory(root).cgroup is None


def test_no_cgroup_mounts(tmp_path):
    root = _tree(tmp_path, "0::/x\n", "27 1 254:0 / / rw - ext4 /dev/vda rw\n", {})
    assert discover_memory(root).cgroup is None


def test_v2_namespace_outside_mount_root_uses_the_mount(tmp_path):
    mount = "26 22 0:24 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    root = _tree(
        tmp_path,
        "0::/elsewhere\n",
        mount,
        {
            "sys/fs/cgroup/memory.max": "2147483648\n",
            "sys/fs/cgroup/memory.current": "150\n",
            "sys/fs/cgroup/memory.stat": STAT,
        },
    )
    cgroup = discover_memory(root).cgroup
    assert cgroup is not None
    assert cgroup.limit_bytes == 2 << 30


def test_unreadable_cgroup_falls_back_to_host(tmp_path):
    root = _tree(
        tmp_path,
        "0::/a\n",
        V2_MOUNT,
        {"sys/fs/cgroup/a/memory.current": "150\n", "sys/fs/cgroup/a/memory.stat": "garbage\n"},
    )
    with capture_logs() as logs:
        snapshot = discover_memory(root)
    assert snapshot.cgroup is None
    assert snapshot.host.total_bytes > 0
    assert [(e["event"], e["log_level"], e["path"]) for e in logs] == [
        ("cgroup_unreadable", "warning", "/a")
    ]


def test_missing_meminfo_is_an_error(tmp_path):
    with pytest.raises(MemoryDiscoveryError, match="meminfo"):
        read_meminfo(tmp_path)
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 10 kB\n")
    with pytest.raises(MemoryDiscoveryError, match="MemAvailable"):
        read_meminfo(tmp_path)


def test_this_machine():
    snapshot = discover_memory()
    assert snapshot.host.total_bytes >= snapshot.host.available_bytes > 0


# ---- real cgroup v1 groups -------------------------------------------------------------------


def _v1_parent() -> Path:
    if os.geteuid() != 0:
        pytest.skip("creating memory cgroups needs root")
    if not (V1_MOUNT / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    location = find_memory_cgroup()
    if location is None or location.version != 1:
        pytest.skip("this process is not in a cgroup v1 memory group")
    return location.directory


@pytest.fixture
def v1_groups():
    """A parent group limited to 256 MiB with an unlimited child; removed afterwards."""
    parent = _v1_parent() / f"dualblade-test-{uuid.uuid4().hex[:8]}"
    child = parent / "child"
    parent.mkdir()
    try:
        (parent / "memory.limit_in_bytes").write_text(str(256 << 20))
        child.mkdir()
        yield parent, child
    finally:
        for group in (child, parent):
            if group.exists():
                group.rmdir()


@pytest.mark.root
def test_real_v1_limits(v1_groups):
    parent, child = v1_groups
    own = read_cgroup_v1(parent)
    assert own.version == 1
    assert own.limit_bytes == 256 << 20
    inherited = read_cgroup_v1(child)
    assert inherited.limit_bytes == 256 << 20, "the parent's limit binds the child"
    (child / "memory.limit_in_bytes").write_text(str(64 << 20))
    assert read_cgroup_v1(child).limit_bytes == 64 << 20


_PROBE = """
import json, os, sys
from pathlib import Path
Path(sys.argv[1], "cgroup.procs").write_text(str(os.getpid()))
from dualblade.pipeline import discover_memory
before = discover_memory().cgroup
with open(sys.argv[2], "wb") as f:
    f.write(os.urandom(1 << 20) * 32)
after = discover_memory().cgroup
print(json.dumps({"path": after.path, "limit": after.limit_bytes,
                  "file_before": before.file_bytes, "file_after": after.file_bytes,
                  "non_file_after": after.non_file_bytes, "usage_after": after.usage_bytes}))
"""


@pytest.mark.root
def test_real_v1_discovery_inside_the_group(v1_groups, tmp_path):
    _parent, child = v1_groups
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, str(child), str(tmp_path / "blob")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    found = json.loads(result.stdout)
    assert found["path"].endswith(f"{_parent.name}/child")
    assert found["limit"] == 256 << 20
    # 32 MiB written through the page cache is charged to the group as file pages, not as use.
    assert found["file_after"] - found["file_before"] >= 30 << 20
    assert found["non_file_after"] < found["usage_after"] - (30 << 20)


def test_v1_counts_the_whole_subtree(tmp_path):
    """A v1 group's usage includes its children, so its page cache must too (``total_*``)."""
    group = tmp_path / "g"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text("1073741824\n")
    (group / "memory.usage_in_bytes").write_text("500\n")
    (group / "memory.stat").write_text(
        "active_file 1\ninactive_file 2\nhierarchical_memory_limit 536870912\n"
        "total_active_file 100\ntotal_inactive_file 200\n"
    )
    cgroup = read_cgroup_v1(group, "/g")
    assert (cgroup.limit_bytes, cgroup.file_bytes, cgroup.non_file_bytes) == (512 << 20, 300, 200)


def test_mapped_shared_memory_is_not_taken_off_the_file_lru(tmp_path):
    """A process's shared buffers are mapped shmem: in ``mapped_file`` but not on the file LRU.
    Only mapped pages beyond the shared memory come off what the budget may count as cache."""
    from dualblade.pipeline.memory import read_cgroup_v1

    mib = 1 << 20
    (tmp_path / "memory.limit_in_bytes").write_text(str(1 << 30))
    (tmp_path / "memory.usage_in_bytes").write_text(str(700 * mib))
    stat = {"active_file": 300 * mib, "inactive_file": 100 * mib, "mapped_file": 260 * mib}
    stat["shmem"] = 256 * mib  # the store's I/O buffers, were they shared mappings
    (tmp_path / "memory.stat").write_text("".join(f"{k} {v}\n" for k, v in stat.items()))
    cgroup = read_cgroup_v1(tmp_path)
    assert cgroup.file_bytes == 400 * mib - 4 * mib
