"""The memory a record batch keeps alive, counted cheaply (for the bounds on what a node
holds: the row caches' budget, the leader's kept payload checks)."""

from __future__ import annotations

import pyarrow as pa

# What a cached batch holds beyond its buffers: Arrow's C++ arrays and their wrappers, about
# 400 bytes per column whatever the rows (pyarrow 26: a 1-row batch of 211 columns holds
# ~70-90 KB of memory for 1.3 KB of buffers). Counted, or a wide table published row by row
# would cache ~60 times what the node-wide bound says (tests/test_tables.py measures it).
BATCH_OVERHEAD_BYTES = 1024
COLUMN_OVERHEAD_BYTES = 448


def cached_bytes(batch: pa.RecordBatch) -> int:
    """The memory a cached `batch` keeps alive (a cheap, conservative count)."""
    return encoded_cached_bytes(batch.get_total_buffer_size(), batch.num_columns)


def encoded_cached_bytes(buffer_bytes: int, columns: int) -> int:
    """`cached_bytes` of a batch of `columns` columns whose buffers take `buffer_bytes`; for
    a batch cached as its IPC message and decoded on its first read, the message's bytes
    (its buffers view the message, which holds them and their metadata)."""
    return buffer_bytes + BATCH_OVERHEAD_BYTES + COLUMN_OVERHEAD_BYTES * columns
