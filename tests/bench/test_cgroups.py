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
    remove_stale_groups,
    run_group_name,
)


def dead_pid() -> int:
    """The pid of a process that has ended (reused within the test only by bad luck)."""
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


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


def test_stale_groups_of_gone_processes_are_removed_and_no_others(tmp_path: Path) -> None:
    """A fake v1 hierarchy: only the empty groups that this package names, made by a process
    that is gone, are removed."""
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    gone, alive = dead_pid(), os.getpid()
    names = {
        f"dualblade-run-{gone}-bench-000": True,  # a sweep's run, its sweep gone
        f"dualblade-run-{gone}-serving-03-dual": True,
        f"dualblade-probe-{gone}": True,
        f"dualblade-run-{alive}-bench-001": False,  # a sweep still running
        f"dualblade-probe-{alive}": False,
        f"dualblade-test-{gone}": False,  # not a name the package gives
        f"other-run-{gone}-bench-000": False,
        "dualblade-run-x-bench-000": False,
        f"dualblade-run-{gone}": False,  # no label
    }
    for name in names:
        (memory / name).mkdir()
    busy = (
        memory / f"dualblade-run-{gone}-bench-002"
    )  # the kernel refuses rmdir while a process is in
    busy.mkdir()
    (busy / "cgroup.procs").write_text("4242\n")
    removed = remove_stale_groups(tmp_path)
    assert sorted(path.name for path in removed) == sorted(n for n, stale in names.items() if stale)
    assert all((memory / n).is_dir() != stale for n, stale in names.items())
    assert busy.is_dir()


def test_stale_groups_without_a_hierarchy_is_nothing_to_do(tmp_path: Path) -> None:
    assert remove_stale_groups(tmp_path) == []


@pytest.mark.root
def test_real_stale_groups_go_unless_a_process_is_inside() -> None:
    """Real groups named as a killed sweep leaves them: the empty one goes, the one whose
    worker outlived the sweep stays (the kernel refuses its rmdir) until that worker ends."""
    import subprocess

    reason = can_create_memory_cgroups()
    if reason is not None:
        pytest.skip(reason)
    gone = dead_pid()
    empty = create_memory_cgroup(f"dualblade-run-{gone}-bench-000", 64 << 20)
    busy = create_memory_cgroup(f"dualblade-run-{gone}-bench-001", 64 << 20)
    worker = subprocess.Popen(["sleep", "60"])
    try:
        busy.join(worker.pid)
        removed = remove_stale_groups()
        assert empty.path in removed
        assert not empty.path.exists()
        assert busy.path not in removed
        assert busy.path.is_dir()
    finally:
        worker.kill()
        worker.wait()
        empty.remove()
        busy.remove()
    assert not busy.path.exists()


def test_a_group_is_removed_when_its_block_ends_however_it_ends(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    name = run_group_name("bench-000")
    assert name == f"dualblade-run-{os.getpid()}-bench-000"

    def stopped_inside() -> None:
        with create_memory_cgroup(name, 1 << 30, root=tmp_path) as group:
            assert group.path.is_dir()
            (group.path / "memory.limit_in_bytes").unlink()  # the fake group's own file
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stopped_inside()
    assert not (tmp_path / "memory" / name).exists()
