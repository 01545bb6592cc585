"""Spark's own floor for a Python sink: a data source whose writers only count their rows.

`bench.spark_bench` writes the same frame (and the same parquet stream) into this sink
beside `hastream`, so the time Spark itself takes to hand 1M rows to Python workers as
Arrow batches (JVM -> socket -> pyarrow, task scheduling, the commit protocol) is measured
in the same run, on the same cores: what is left of a `hastream` write above it is the
cluster's and the publishing task's. The commit checks that every row arrived (the
`rows` option), so a broken run cannot pass for a fast one.

    spark.dataSource.register(CountingSink)
    frame.write.format("countrows").option("rows", n).mode("append").save()
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    DataSourceStreamWriter,
    DataSourceWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

NAME = "countrows"


@dataclass(frozen=True, slots=True)
class Counted(WriterCommitMessage):
    rows: int


def _check(expected: int, messages: list[WriterCommitMessage | None]) -> None:
    rows = sum(message.rows for message in messages if isinstance(message, Counted))
    if rows != expected:
        raise ValueError(f"the counting sink got {rows} rows, expected {expected}")


class _Counting:
    """What both writers do in a task: count the rows, nothing else."""

    def __init__(self, expected: int) -> None:
        self._expected = expected

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Counted:
        return Counted(sum(batch.num_rows for batch in iterator))


class _BatchWriter(_Counting, DataSourceArrowWriter):
    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _check(self._expected, messages)


class _StreamWriter(_Counting, DataSourceStreamArrowWriter):
    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _check(self._expected, messages)  # the benchmark's streams are one micro-batch


class CountingSink(DataSource):
    @classmethod
    def name(cls) -> str:
        return NAME

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return _BatchWriter(int(self.options["rows"]))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return _StreamWriter(int(self.options["rows"]))
