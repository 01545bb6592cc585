"""Spark through a cluster with mutual TLS: the `caFile`/`certFile`/`keyFile` options reach
the planner, the executors' Python workers and the streaming runners (a real SparkSession)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from deploy.local_cluster import LocalCluster
from tests.spark.conftest import sites_of

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

SCHEMA = pa.schema([("id", pa.int64()), ("value", pa.float64())])


@pytest.fixture(scope="module")
def tls_cluster(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("spark-tls") / "cluster")
    cluster.enable_tls(client_auth=True)
    cluster.start()
    yield cluster
    cluster.stop()


def test_batch_and_stream_over_mutual_tls(
    spark: Any, tls_cluster: LocalCluster, tmp_path: Path
) -> None:
    tls = tls_cluster.client_tls
    assert tls is not None
    files = {"caFile": tls.ca_file, "certFile": tls.cert_file, "keyFile": tls.key_file}
    sites = sites_of(tls_cluster)
    tls_cluster.create_table("secure", SCHEMA)
    tls_cluster.create_table("secure_copy", SCHEMA)
    frame = spark.range(5000).selectExpr("id", "id * 0.5 AS value")
    frame.write.format("hastream").option("sites", sites).option("table", "secure").options(
        **files
    ).mode("append").save()
    read = (
        spark.read.format("hastream")
        .option("sites", sites)
        .option("table", "secure")
        .options(**files)
        .load()
    )
    assert read.count() == 5000
    query = (
        spark.readStream.format("hastream")
        .option("sites", sites)
        .option("table", "secure")
        .option("startingOffsets", "earliest")
        .options(**files)
        .load()
        .writeStream.format("hastream")
        .option("sites", sites)
        .option("table", "secure_copy")
        .options(**files)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(timeout=180)
    assert query.exception() is None
    assert tls_cluster.row_count(tls_cluster.leader(), "secure_copy") == 5000
    # Without the files, the same read is refused, and says why.
    with pytest.raises(Exception, match=r"(?i)tls"):
        spark.read.format("hastream").option("sites", sites).option("table", "secure").option(
            "timeoutSec", "3"
        ).load().count()
