"""Memory cgroups: which file gets the limit in each hierarchy, and clear errors without one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dualblade.bench.cgroups import (
    CgroupError,
    can_create_memory_cgroups,
    create_memory_cgroup,
    detect_version,
)


def test_no_controller_is_a_clear_error(tmp_path: Path) -> None:
    assert detect_version(tmp_path) is None
    with pytest.raises(CgroupError, match="no memory cgroup controller"):
        create_memory_cgroup("x", 1 << 30, root=tmp_path)
    assert can_create_memory_cgroups(tmp_path) is not None


def test_v1_limit_goes_to_limit_in_bytes(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    group = create_memory_cgroup("run", 123 << 20, root=tmp_path)
    assert group.version == "v1"
    assert (tmp_path / "memory" / "run" / "memory.limit_in_bytes").read_text() == str(123 << 20)


def test_v2_limit_goes_to_memory_max_under_a_delegating_parent(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("memory pids\n")
    group = create_memory_cgroup("run", 5 << 30, root=tmp_path)
    assert group.version == "v2"
    assert (tmp_path / "run" / "memory.max").read_text() == str(5 << 30)


def test_v2_without_memory_delegated_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    (tmp_path / "cgroup.subtree_control").write_text("pids\n")
    with pytest.raises(CgroupError, match="delegate"):
        create_memory_cgroup("run", 1 << 30, root=tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="checks the message a non-root user gets")
def test_real_hierarchy_refuses_non_root_with_the_reason() -> None:
    reason = can_create_memory_cgroups()
    if reason is None:
        pytest.skip("this user may create memory cgroups (delegated)")
    assert "root" in reason or "delegate" in reason or "controller" in reason


@pytest.mark.root
def test_real_group_limits_a_process(tmp_path: Path) -> None:
    """A real group: a child that joins it and allocates past the limit is OOM-killed."""
    import subprocess
    import sys

    reason = can_create_memory_cgroups()
    if reason is not None:
        pytest.skip(reason)
    group = create_memory_cgroup(f"dualblade-test-{os.getpid()}", 64 << 20)
    try:
        script = (
            "import sys; open(sys.argv[1], 'w').write(str(__import__('os').getpid())); "
            "blocks = [bytearray(1 << 20) for _ in range(256)]"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, str(group.path / "cgroup.procs")], check=False
        )
        assert done.returncode != 0  # killed: 256 MiB do not fit in 64
    finally:
        group.remove()
