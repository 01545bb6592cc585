"""raftstore/allocator.py: a node process bounds glibc's malloc arenas (its RSS under
multi-threaded multi-MiB buffers; measured in docs/benchmark.md)."""

from __future__ import annotations

import platform

import pytest

from raftstore import allocator

pytestmark = pytest.mark.unit


def test_the_node_bounds_its_malloc_arenas_where_the_c_library_is_glibc() -> None:
    assert allocator.bound_arenas() == (platform.libc_ver()[0] == "glibc")
