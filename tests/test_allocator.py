"""raftstore/allocator.py: a node process bounds glibc's malloc arenas and hands freed heap
pages back (its RSS under multi-threaded multi-MiB buffers; measured in docs/benchmark.md)."""

from __future__ import annotations

import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from raftstore import allocator

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.unit


def test_the_node_bounds_its_malloc_arenas_where_the_c_library_is_glibc() -> None:
    assert allocator.bound_arenas() == (platform.libc_ver()[0] == "glibc")


# Runs in a process of its own: frees ~200 MiB of heap blocks below one kept block (so
# the heap's top cannot shrink by itself), then runs the node's trim loop and prints its
# resident KiB before and once the loop has given the freed pages back (or 10 s passed).
_FREED_UNDER_A_KEPT_BLOCK = """
import threading
from deploy.local_cluster import wait_until
from raftstore import allocator

def resident_kib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

allocator.bound_arenas()
blocks = [bytearray(100 * 1024) for _ in range(2000)]  # under the mmap threshold: heap
kept = blocks[-1]
del blocks
before = resident_kib()
stop = threading.Event()
threading.Thread(target=allocator.trim_until, args=(stop, 0.05), daemon=True).start()
try:
    wait_until(lambda: resident_kib() <= before - 100 * 1024, timeout_s=10, interval_s=0.05)
except AssertionError:
    pass  # the test below says by how much the trim fell short
stop.set()
print(before, resident_kib())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_trim_loop_gives_freed_heap_memory_back_to_the_system() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FREED_UNDER_A_KEPT_BLOCK],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=True,
    )
    before_kib, after_kib = map(int, done.stdout.split())
    assert before_kib > 200 * 1024, "the freed blocks were resident before the trim"
    assert after_kib < before_kib - 100 * 1024, (before_kib, after_kib)


def test_the_trim_loop_ends_when_told_to_stop() -> None:
    stop = threading.Event()
    stop.set()
    allocator.trim_until(stop, interval_s=3600)  # returns at once, nothing left running
