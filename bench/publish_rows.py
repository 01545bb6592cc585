"""The publish benchmarks' rows and CPU meter (bench.vs_nats, bench.checkouts_ab).

A row is 11 columns: a 20-character ascii id and 10 int32 values (60 bytes packed). One row
is what a Python program has at hand, its values; N rows come from a pool made once with
numpy. Nothing here needs the NATS client, so the hastream-only benchmarks run without
bench/requirements.txt's NATS packages.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pyarrow as pa

from bench import common

ID_CHARS: Final = 20
INT_COLUMNS: Final = 10
ROW_BYTES: Final = ID_CHARS + 4 * INT_COLUMNS  # 60: what a NATS message carries per row
SCHEMA: Final = pa.schema(
    [("id", pa.string()), *[(f"v{k}", pa.int32()) for k in range(1, INT_COLUMNS + 1)]]
)
POOL_ROWS: Final = 20_000  # a multiple of every batch size: slices never wrap
_INTS: Final = struct.Struct(f"<{INT_COLUMNS}i")


# --- rows ---------------------------------------------------------------------------------


def row_values(number: int) -> tuple[str, list[int]]:
    """Row `number` from Python values: its 20-character id and 10 int32 values."""
    return f"{number:0{ID_CHARS}d}", [(number * k) & 0x7FFFFFFF for k in range(1, 11)]


def one_row_bytes(number: int) -> bytes:
    """NATS, 1-row shapes: the row packed from Python values (20 ascii bytes + 10 x int32)."""
    row_id, values = row_values(number)
    return row_id.encode() + _INTS.pack(*values)


def one_row(number: int) -> list[tuple[object, ...]]:
    """hastream, 1-row shapes: the same row's values as a row tuple (the client's rows form:
    a list of tuples)."""
    row_id, values = row_values(number)
    return [(row_id, *values)]


@dataclass(frozen=True)
class RowPool:
    """`POOL_ROWS` rows made once with numpy, the same values as `row_values`; batches are
    slices of it, converted inside the timed loop: column arrays -> pyarrow.Table
    (hastream), a row-major structured array -> bytes (NATS). `arrow` holds the same rows
    as one pyarrow.Table, for `hastream_builder(..., rows_from="arrow")`: a slice of it per
    call, as NATS gets a slice of `packed`."""

    ids: np.ndarray[Any, Any]  # S20: ascii ids (pyarrow takes bytes as utf-8 strings)
    ints: tuple[np.ndarray[Any, Any], ...]  # one contiguous int32 array per column
    packed: np.ndarray[Any, Any]  # structured, 60 bytes a row, the NATS layout
    arrow: pa.Table  # the same rows, columnar: the hastream client's input form

    @staticmethod
    def make(rows: int = POOL_ROWS) -> RowPool:
        numbers = np.arange(rows, dtype=np.int64)
        ids = np.char.zfill(numbers.astype(f"U{ID_CHARS}"), ID_CHARS).astype(f"S{ID_CHARS}")
        ints = tuple(
            ((numbers * k) & 0x7FFFFFFF).astype(np.int32) for k in range(1, INT_COLUMNS + 1)
        )
        packed = np.zeros(rows, dtype=[("id", f"S{ID_CHARS}"), ("v", "<i4", (INT_COLUMNS,))])
        packed["id"] = ids
        packed["v"] = np.stack(ints, axis=1)
        assert packed.dtype.itemsize == ROW_BYTES
        return RowPool(ids, ints, packed, _arrow_table(ids, ints))

    def first_row(self, number: int, rows: int) -> int:
        return (number * rows) % len(self.ids)

    def table(self, number: int, rows: int) -> pa.Table:
        first = self.first_row(number, rows)
        end = first + rows
        return _arrow_table(self.ids[first:end], [column[first:end] for column in self.ints])

    def table_slice(self, number: int, rows: int) -> pa.Table:
        """The rows of `table` as a slice of the pool's own Table (no conversion: zero-copy)."""
        return self.arrow.slice(self.first_row(number, rows), rows)

    def message(self, number: int, rows: int) -> bytes:
        first = self.first_row(number, rows)
        return self.packed[first : first + rows].tobytes()


def _arrow_table(ids: np.ndarray[Any, Any], ints: Sequence[np.ndarray[Any, Any]]) -> pa.Table:
    """Numpy columns (ascii ids, int32 values) as a pyarrow.Table of `SCHEMA`."""
    arrays = [pa.array(ids, type=pa.string()), *[pa.array(column) for column in ints]]
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


def nats_builder(pool: RowPool, rows: int) -> Callable[[int], bytes]:
    return one_row_bytes if rows == 1 else lambda number: pool.message(number, rows)


# How the hastream side gets N rows per call (`hastream_builder`), and what each means.
# numpy is the conversion a program holding numpy data makes (~55 us per 1,000 rows in a
# loop, ~110 us between publish calls, where the NATS side copies a slice of pre-packed
# bytes in ~2-5 us); arrow gives each side its client's input form ready, as NATS gets it.
ROWS_FROM: Final = {
    "numpy": "a pyarrow.Table built from numpy columns in the loop",
    "arrow": "a slice of a pyarrow.Table made once",
}


def hastream_builder(pool: RowPool, rows: int, rows_from: str = "numpy") -> Callable[[int], object]:
    """One row: its values as a row tuple. N rows: a pyarrow.Table, built from numpy
    columns or sliced from the pool's Table (`ROWS_FROM`)."""
    if rows_from not in ROWS_FROM:
        raise ValueError(f"rows_from {rows_from!r}: one of {', '.join(ROWS_FROM)}")
    if rows == 1:
        return one_row
    if rows_from == "arrow":
        return lambda number: pool.table_slice(number, rows)
    return lambda number: pool.table(number, rows)


# --- CPU ----------------------------------------------------------------------------------


def servers_cpu_s(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):  # exited: the cell reports its errors
            total += common.cpu_seconds(pid)
    return total


@contextlib.contextmanager
def cpu_meter(pids: Sequence[int]) -> Iterator[list[float]]:
    """Yields a list that holds (server CPU s, client CPU s) of the block once it ends."""
    spent: list[float] = []
    server_before, client_before = servers_cpu_s(pids), time.process_time()
    yield spent
    spent += [servers_cpu_s(pids) - server_before, time.process_time() - client_before]
