"""Fixtures of the Spark tests: one local SparkSession and one three-node cluster for the
whole run (both are slow to start), warmed up once so per-test times stay stable.

The SparkSession is created before this process opens any gRPC channel, and the Python
workers' environment (PYSPARK_PYTHON, PYTHONPATH) is set before the JVM starts.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from deploy.local_cluster import LocalCluster

WARMUP_SCHEMA = pa.schema([("id", pa.int64()), ("value", pa.float64())])


def sites_of(cluster: LocalCluster) -> str:
    return ",".join(f"127.0.0.1:{node.port}:{alias}" for alias, node in cluster.nodes.items())


# Package scope: the JVM and the cluster go when the last Spark test is done, not when the
# worker ends (under -n 2 the Spark tests run first on their worker, then other tests).
@pytest.fixture(scope="package")
def spark() -> Iterator[Any]:
    if shutil.which("java") is None:
        pytest.skip("java is not installed")
    from spark_publisher.local import local_spark

    # 2g: with 1g, collecting a cached million-row frame (the tests' expected data) once
    # lost a task result from the block manager under memory pressure (TaskResultLost).
    session = local_spark("hastream-tests", cores=2, memory="2g")
    yield session
    session.stop()


@pytest.fixture(scope="package")
def spark_cluster(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A three-node cluster (group 2), warmed up through every Spark path once."""
    cluster = LocalCluster(tmp_path_factory.mktemp("spark") / "cluster")
    cluster.start()
    try:
        cluster.leader()
        _warm_up(spark, cluster, tmp_path_factory.mktemp("warmup"))
        yield cluster
    finally:
        cluster.stop()


def _warm_up(spark: Any, cluster: LocalCluster, tmp: Path) -> None:
    """Starts Spark's Python daemons (create, plan, write, commit, stream runners) once."""
    cluster.create_table("warmup", WARMUP_SCHEMA)
    sites = sites_of(cluster)
    frame = spark.range(1000).selectExpr("id", "id * 0.5 AS value")
    frame.write.format("hastream").option("sites", sites).option("table", "warmup").mode(
        "append"
    ).save()
    read = spark.read.format("hastream").option("sites", sites).option("table", "warmup").load()
    assert read.count() == 1000
    query = (
        spark.readStream.format("hastream")
        .option("sites", sites)
        .option("table", "warmup")
        .option("startingOffsets", "earliest")
        .load()
        .writeStream.format("hastream")
        .option("sites", sites)
        .option("table", "warmup")
        .option("checkpointLocation", str(tmp / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(timeout=120)
    assert cluster.row_count(cluster.leader(), "warmup") == 2000
