"""PySpark side of the HA stream table cluster: the `hastream` Python Data Source.

    import spark_publisher
    spark_publisher.register(spark)                      # once per SparkSession

    df.write.format("hastream").option("sites", "h1:8901,h2:8902").option("table", "t") \\
        .mode("append").save()
    spark.readStream.format("hastream").option("sites", ...).option("table", "t") \\
        .option("action", "agg").option("startingOffsets", "persisted").load()

See docs/spark.md for the options and the delivery semantics. This package talks to the
cluster only through `api_clients`.
"""

from __future__ import annotations

from typing import Any

from spark_publisher.listener import HAStreamOffsetListener
from spark_publisher.options import HAStreamOptions, OptionError, parse
from spark_publisher.sink import PublishReport
from spark_publisher.source import NAME, DataLossError, HAStreamDataSource

# pyspark finds a top-level `pyspark_<name>` module's `DefaultSource` by itself.
DefaultSource = HAStreamDataSource

__all__ = [
    "NAME",
    "DataLossError",
    "DefaultSource",
    "HAStreamDataSource",
    "HAStreamOffsetListener",
    "HAStreamOptions",
    "OptionError",
    "PublishReport",
    "parse",
    "publish",
    "register",
]


def register(spark: Any) -> None:
    """Registers `format("hastream")` with `spark` (a SparkSession). Idempotent."""
    spark.dataSource.register(HAStreamDataSource)


def publish(
    df: Any, *, sites: str, table: str, idempotency_token: str | None = None, **options: str
) -> None:
    """Appends `df` to `table`: the `df.write.format("hastream")` call, for `foreachBatch`
    users. Pass `idempotency_token` (for example f"{query_name}:{batch_id}") to make a
    replayed micro-batch deduplicated by the cluster."""
    writer = df.write.format(NAME).option("sites", sites).option("table", table)
    if idempotency_token is not None:
        writer = writer.option("idempotencyToken", idempotency_token)
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.mode("append").save()
