"""The store's threads carry their names into the kernel, where tools outside Python read them."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from dualblade.io_engine import IOEngine, name_os_thread, named_thread
from dualblade.io_engine.thread_names import KERNEL_NAME_BYTES, kernel_thread_name

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="thread names in the kernel are Linux's"
)


def _kernel_names() -> list[str]:
    return [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]


def _comm(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_thread_names_itself_cut_to_what_the_kernel_keeps() -> None:
    seen: list[tuple[bool, str]] = []

    def run() -> None:
        named = name_os_thread("dualblade-a-long-thread-name")
        seen.append((named, _comm(threading.get_native_id())))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(True, "dualblade-a-long-thread-name"[:KERNEL_NAME_BYTES])]
    # the caller's own name is untouched
    assert _comm(threading.get_native_id()) != seen[0][1]


def test_a_long_name_is_cut_at_a_characters_end() -> None:
    assert kernel_thread_name("ring") == b"ring"
    cut = kernel_thread_name("é" * 20)  # two bytes each: 15 bytes would split the eighth
    assert cut == ("é" * 7).encode()
    assert len(cut) == KERNEL_NAME_BYTES - 1


def test_the_ring_thread_is_named_in_the_kernel() -> None:
    before = _kernel_names()
    with IOEngine(queue_depth=4, compat="off", name="db-test-ring"):
        assert "db-test-ring" in _kernel_names()
    assert "db-test-ring" not in before


def test_a_named_thread_runs_its_target_under_its_name_in_both_places() -> None:
    seen: list[tuple[str, str]] = []
    thread = named_thread(
        lambda: seen.append((threading.current_thread().name, _comm(threading.get_native_id()))),
        "db-named",
    )
    assert thread.daemon
    thread.start()
    thread.join()
    assert seen == [("db-named", "db-named")]
