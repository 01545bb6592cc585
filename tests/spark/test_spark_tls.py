"""Spark through a cluster with mutual TLS and logins: the `caFile`/`certFile`/`keyFile` and
`userid`/`password` options reach the planner, the executors' Python workers and the
streaming runners (a real SparkSession), and the user's grants decide what it may do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from api_clients.connection import Session
from deploy.local_cluster import LocalCluster
from tests.spark.conftest import sites_of

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

SCHEMA = pa.schema([("id", pa.int64()), ("value", pa.float64())])
ADMIN_PASSWORD = "spark-test-admin-password"


@pytest.fixture(scope="module")
def tls_cluster(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("spark-tls") / "cluster")
    cluster.enable_tls(client_auth=True)
    cluster.enable_authentication(ADMIN_PASSWORD)
    cluster.start()
    yield cluster
    cluster.stop()


def test_batch_and_stream_over_mutual_tls(
    spark: Any, tls_cluster: LocalCluster, tmp_path: Path
) -> None:
    tls = tls_cluster.client_tls
    assert tls is not None
    sites = sites_of(tls_cluster)
    tls_cluster.create_table("secure", SCHEMA)
    tls_cluster.create_table("secure_copy", SCHEMA)
    with Session(sites.split(","), userid="admin", password=ADMIN_PASSWORD, tls=tls) as admin:
        admin.createUser("etl", "etl-password")
        admin.grant("etl", "TABLE_READ", "secure")
        admin.grant("etl", "TABLE_WRITE", ["secure", "secure_copy"])
    login = {"userid": "etl", "password": "etl-password"}
    files = {"caFile": tls.ca_file, "certFile": tls.cert_file, "keyFile": tls.key_file, **login}
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
        ).options(**login).load().count()
    # Without a login, or without the grant, too: nothing is read or written.
    tls_files = {key: value for key, value in files.items() if key not in login}
    with pytest.raises(Exception, match=r"(?i)needs a login"):
        spark.read.format("hastream").option("sites", sites).option("table", "secure").options(
            **tls_files
        ).load().count()
    with pytest.raises(Exception, match=r"(?i)lacks TABLE_READ"):
        spark.read.format("hastream").option("sites", sites).option("table", "secure_copy").options(
            **files
        ).load().count()
