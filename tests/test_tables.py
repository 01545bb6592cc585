"""TableStore: the data files of one table as the node serves them."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from raftstore.state_machine import TableMeta
from raftstore.tables import TableStore

SCHEMA = pa.schema([("id", pa.int64())])


def _meta() -> TableMeta:
    return TableMeta(
        table="t",
        schema=SCHEMA,
        schema_ipc=SCHEMA.serialize().to_pybytes(),
        cache_limit=10,
        key_column=None,
        retention_minutes=0,
        created_lsn=1,
        non_nullable=(),
        stream_prefix=b"",
    )


def test_records_asked_from_inside_a_record_begin_exactly_there(tmp_path: Path) -> None:
    # A repairing replica asks from its own row count, which need not be one of this
    # replica's record boundaries: the first record is cut, the rest are sent as stored.
    store = TableStore(_meta(), tmp_path / "t.1")
    store.append(5, 0, pa.record_batch([pa.array(range(0, 10))], schema=SCHEMA), 1)
    store.append(6, 10, pa.record_batch([pa.array(range(10, 15))], schema=SCHEMA), 2)
    records = list(store.records(7, 15))
    assert [(r.first_offset, r.row_count, r.lsn) for r in records] == [(7, 3, 5), (10, 5, 6)]
    first = pa.ipc.read_record_batch(pa.py_buffer(records[0].payload), SCHEMA)
    assert first.column(0).to_pylist() == [7, 8, 9]
    store.close()
