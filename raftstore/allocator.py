"""The C allocator's settings for a node process (glibc), made before any thread starts.

glibc gives each thread that allocates concurrently an arena of its own, up to eight per
core, and returns little of an arena's freed memory to the system. A node's gRPC, Raft and
writer threads each handle multi-MiB buffers (requests, entries, peer frames), so every
arena grows to its own peak: a leader publishing 211-column 10,000-row batches from four
threads reached 800-990 MiB of RSS, and stayed there, against ~590 MiB with at most two
arenas (the DolphinDB grid's peak: 968 -> 667 MiB), at the same rows/s and node CPU
(docs/benchmark.md, "Node memory"). Python holds the GIL for most allocations, so fewer
arenas cost no contention to speak of (one arena was no lower).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

from raftstore import limits

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def bound_arenas(count: int = limits.MALLOC_ARENAS_MAX) -> bool:
    """At most `count` malloc arenas in this process (glibc's mallopt); False where the C
    library is not glibc (nothing to do) or refuses."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.mallopt(_M_ARENA_MAX, count) != 1:
        log.warning("mallopt(M_ARENA_MAX, %d) refused; malloc arenas are unbounded", count)
        return False
    return True
