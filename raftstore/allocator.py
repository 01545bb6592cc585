"""The C allocator's settings for a node process (glibc), made before any thread starts.

glibc gives each thread that allocates concurrently an arena of its own, up to eight per
core, and returns little of an arena's freed memory to the system. A node's gRPC, Raft and
writer threads each handle multi-MiB buffers (requests, entries, peer frames), so every
arena grows to its own peak: a leader publishing 211-column 10,000-row batches from four
threads reached 800-990 MiB of RSS, and stayed there, against ~590 MiB with at most two
arenas (the DolphinDB grid's peak: 968 -> 667 MiB), at the same rows/s and node CPU
(docs/benchmark.md, "Node memory"). Python holds the GIL for most allocations, so fewer
arenas cost no contention to speak of (one arena was no lower).

Freed memory stays resident too: glibc gives pages back to the system only from the top of
the main heap, so a few live buffers above hundreds of MiB of freed ones hold them all. A
node therefore hands the free pages of every arena back every 5 s (`trim_until`, glibc's
`malloc_trim`, on the node's "malloc-trim" thread): the busiest node's peak RSS over the
DolphinDB grid 625-725 MiB -> 563-572 MiB, at the same rows/s and node CPU per row. Every
second was as low (516-566 MiB) but cost 15% more node CPU per row at 211 columns x 10,000
rows: the pages handed back are faulted in again by the next big buffers
(docs/benchmark.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform
import threading

from raftstore import limits

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library, where it is glibc (None elsewhere: nothing to tune)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def bound_arenas(count: int = limits.MALLOC_ARENAS_MAX) -> bool:
    """At most `count` malloc arenas in this process (glibc's mallopt); False where the C
    library is not glibc (nothing to do) or refuses."""
    libc = _glibc()
    if libc is None:
        return False
    if libc.mallopt(_M_ARENA_MAX, count) != 1:
        log.warning("mallopt(M_ARENA_MAX, %d) refused; malloc arenas are unbounded", count)
        return False
    return True


def trim() -> bool:
    """Hands the free pages of every malloc arena back to the system now (glibc's
    `malloc_trim(0)`; ctypes releases the GIL for the call). False where the C library is
    not glibc, or nothing could be released."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1


def trim_until(stop: threading.Event, interval_s: float = limits.MALLOC_TRIM_INTERVAL_S) -> None:
    """Trims every `interval_s` until `stop` is set (a node thread's loop). Returns at once
    where the C library is not glibc."""
    if _glibc() is None:
        return
    while not stop.wait(timeout=interval_s):
        trim()
