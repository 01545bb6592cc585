"""Ingest time: what the client accepts as a point in time, and the metadata columns.

Every stored row carries the time the leader stamped its batch when it proposed it (ms since
the epoch, UTC; the rows of one publish share it). A table answers "the first row stamped at
or after t" (`Session.offsetForTime`, Kafka's offsetsForTimes), which is how a subscription
or a Spark query starts by time. With `includeMetadata` a read adds each row's offset and
stamp as two columns, like the offset and timestamp of a Kafka record.
"""

from __future__ import annotations

import datetime
from typing import Final

import numpy as np
import pandas as pd
import pyarrow as pa

from hastream.errors import InvalidArgument

OFFSET_COLUMN: Final = "_offset"
INGEST_TIME_COLUMN: Final = "_ingest_time"
METADATA_FIELDS: Final = (
    pa.field(OFFSET_COLUMN, pa.int64(), nullable=False),
    pa.field(INGEST_TIME_COLUMN, pa.timestamp("ms", tz="UTC"), nullable=False),
)


def epoch_ms(when: object, argument: str) -> int:
    """`when` as ms since the epoch: an int is taken as ms already; a datetime, pandas
    Timestamp or numpy datetime64 is converted (a naive one is UTC, as the stamps are).
    Anything else is refused (InvalidArgument naming `argument`)."""
    if isinstance(when, bool) or when is None:
        raise InvalidArgument(argument, f"expected a time, got {when!r}")
    if isinstance(when, int | np.integer):
        return int(when)
    if isinstance(when, datetime.datetime | pd.Timestamp | np.datetime64):
        stamp = pd.Timestamp(when)
        if stamp is pd.NaT:
            raise InvalidArgument(argument, "expected a time, got NaT")
        if stamp.tzinfo is None:
            stamp = stamp.tz_localize("UTC")
        return int(stamp.value // 1_000_000)
    raise InvalidArgument(
        argument,
        f"expected ms since the epoch (int) or a datetime, got {type(when).__name__}",
    )


def with_metadata(
    rows: pa.Table, first_offset: int, slice_offsets: list[int], slice_stamps: list[int]
) -> pa.Table:
    """`rows` (offsets from `first_offset` on) with `_offset` and `_ingest_time` appended:
    the rows from slice_offsets[i] up to the next were stamped slice_stamps[i]."""
    for name in (OFFSET_COLUMN, INGEST_TIME_COLUMN):
        if name in rows.column_names:
            raise InvalidArgument("includeMetadata", f"the table has a column named {name}")
    count = rows.num_rows
    if len(slice_offsets) != len(slice_stamps) or (count and not slice_offsets):
        raise InvalidArgument("slice_offsets", "the node sent no ingest times with the rows")
    bounds = np.array([*slice_offsets, first_offset + count], dtype=np.int64) - first_offset
    lengths = np.diff(bounds)
    if bounds[0] != 0 or (lengths < 0).any():
        raise InvalidArgument("slice_offsets", f"not within the rows sent: {slice_offsets}")
    offsets = pa.array(np.arange(first_offset, first_offset + count, dtype=np.int64))
    stamps = np.repeat(np.array(slice_stamps, dtype=np.int64), lengths)
    times = pa.array(stamps, type=pa.int64()).cast(METADATA_FIELDS[1].type)
    return rows.append_column(METADATA_FIELDS[0], offsets).append_column(METADATA_FIELDS[1], times)
