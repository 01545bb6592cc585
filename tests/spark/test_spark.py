"""The `hastream` data source with a real local SparkSession and a real three-node cluster."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from api_clients import Publisher, Session, TopicNotFound
from deploy.local_cluster import REPO, LocalCluster, wait_until
from tests.spark.conftest import sites_of

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

WIDE_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("sym", pa.string()),
        ("qty", pa.int32()),
        ("volume", pa.int64()),
        ("price", pa.float64()),
        ("bid", pa.float64()),
        ("uid", pa.string()),
        ("active", pa.bool_()),
        ("ts", pa.timestamp("ms")),
        ("day", pa.date32()),
        ("note", pa.string()),
    ]
)
READING_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("ts", pa.timestamp("ms")),
        ("device", pa.int32()),
        ("value", pa.float64()),
    ]
)


def session_of(cluster: LocalCluster) -> Session:
    return Session(sites_of(cluster).split(","))


def reading_rows(first: int, count: int) -> pa.Table:
    ids = pa.array(range(first, first + count), pa.int64())
    return pa.table(
        {
            "id": ids,
            "ts": pa.array(
                [1_700_000_000_000 + i for i in range(first, first + count)], pa.int64()
            ).cast(pa.timestamp("ms")),
            "device": pa.array([i % 10 for i in range(first, first + count)], pa.int32()),
            "value": pa.array([i * 0.25 for i in range(first, first + count)], pa.float64()),
        },
        schema=READING_SCHEMA,
    )


def wide_frame(spark: Any, rows: int) -> Any:
    """`rows` deterministic rows of WIDE_SCHEMA's 11 columns, built in the JVM."""
    return spark.range(rows, numPartitions=2).selectExpr(
        "id",
        "concat('SYM', cast(id % 500 AS string)) AS sym",
        "cast(id % 1000 AS int) AS qty",
        "id * 7 AS volume",
        "id * 0.01D AS price",
        "id * 0.01D - 0.005D AS bid",
        "md5(cast(id AS string)) AS uid",
        "id % 2 = 0 AS active",
        "timestamp_millis(1700000000000 + id) AS ts",
        "date_add(DATE'2024-01-01', cast(id % 365 AS int)) AS day",
        "lpad(cast(id AS string), 20, 'x') AS note",
    )


def test_batch_write_of_a_million_rows_reads_back_equal(
    spark: Any, spark_cluster: LocalCluster
) -> None:
    spark_cluster.create_table("wide", WIDE_SCHEMA, key_column="id")
    sites = sites_of(spark_cluster)
    rows = 1_000_000
    frame = wide_frame(spark, rows).cache()
    expected = frame.toArrow().sort_by("id")

    frame.write.format("hastream").option("sites", sites).option("table", "wide").mode(
        "append"
    ).save()

    read = spark.read.format("hastream").option("sites", sites).option("table", "wide").load()
    got = read.toArrow().sort_by("id")
    assert got.num_rows == rows
    assert got.column_names == expected.column_names
    for name in expected.column_names:
        assert got.column(name).equals(expected.column(name)), name
    # The plain client sees the same rows, in the table's own types.
    client_rows = session_of(spark_cluster).read("wide", 0, rows).sort_by("id")
    assert client_rows.schema.equals(WIDE_SCHEMA)
    assert client_rows.column("id").to_pylist() == list(range(rows))
    first_ms = 1_700_000_000_000
    assert client_rows.column("ts").cast(pa.int64()).to_pylist() == list(
        range(first_ms, first_ms + rows)
    )
    frame.unpersist()


def test_streaming_publish_and_subscribe_survive_a_leader_kill(
    spark: Any, spark_cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster = spark_cluster
    table, files, rows_per_file = "readings", 60, 1000
    total = files * rows_per_file
    cluster.create_table(table, READING_SCHEMA)  # No key column: duplicates would show.
    sites = sites_of(cluster)
    source_dir = tmp_path / "input"
    source_dir.mkdir()
    for number in range(files):
        rows = reading_rows(number * rows_per_file, rows_per_file)
        pq.write_table(
            rows.cast(rows.schema.set(1, pa.field("ts", pa.timestamp("ms", "UTC")))),
            source_dir / f"part-{number:04d}.parquet",
        )

    from spark_publisher import HAStreamOffsetListener

    received: list[pa.Array] = []
    lock = threading.Lock()

    def collect(batch: Any, batch_id: int) -> None:
        ids = batch.select("id").toArrow().column("id").combine_chunks()
        with lock:
            received.append(ids)

    listener = HAStreamOffsetListener(sites, table, "sub", query_name="sub")
    spark.streams.addListener(listener)
    subscriber = (
        spark.readStream.format("hastream")
        .option("sites", sites)
        .option("table", table)
        .option("action", "sub")
        .option("startingOffsets", "earliest")
        .load()
        .writeStream.queryName("sub")
        .foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "sub-checkpoint"))
        .trigger(processingTime="250 milliseconds")
        .start()
    )
    input_schema = spark.read.parquet(str(source_dir)).schema
    publisher = (
        spark.readStream.schema(input_schema)
        .option("maxFilesPerTrigger", 2)
        .parquet(str(source_dir))
        .writeStream.format("hastream")
        .option("sites", sites)
        .option("table", table)
        .option("checkpointLocation", str(tmp_path / "pub-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    killed: str | None = None
    try:
        wait_until(
            lambda: cluster.row_count(cluster.leader(), table) >= 5 * rows_per_file,
            timeout_s=180,
            message="publisher under way",
        )
        killed = cluster.leader()
        assert cluster.row_count(killed, table) < total, "publisher finished before the kill"
        cluster.kill(killed)
        new_leader = cluster.leader(timeout_s=60)
        assert new_leader != killed

        publisher.awaitTermination(timeout=300)
        assert publisher.exception() is None
        assert not publisher.isActive
        cluster.start_node(killed)

        def distinct_received() -> int:
            with lock:
                parts = list(received)
            if not parts:
                return 0
            return len(pa.chunked_array(parts, pa.int64()).unique())

        wait_until(lambda: distinct_received() == total, timeout_s=180, message="all rows received")
        wait_until(
            lambda: session_of(cluster).getTopicProcessedOffset(f"{table}/sub") == total - 1,
            timeout_s=60,
            message="subscriber offset persisted",
        )
    finally:
        subscriber.stop()
        publisher.stop()
        spark.streams.removeListener(listener)
        if killed is not None and killed not in cluster.alive():
            cluster.start_node(killed)

    assert subscriber.exception() is None
    # The table holds every published row exactly once (no key column to hide duplicates).
    stored = session_of(cluster).read(table, 0).column("id").to_pylist()
    assert sorted(stored) == list(range(total))
    with lock:
        ids = pa.chunked_array(received, pa.int64()).to_pylist()
    assert sorted(set(ids)) == list(range(total))
    assert listener.persisted == total - 1
    assert listener.rows_behind_latest == 0


def _start_query_process(
    sites: str,
    table: str,
    checkpoint: Path,
    out: Path,
    log: Path,
    *,
    rows_per_batch: int,
    available_now: bool,
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "tests.spark.query_process",
        "--sites",
        sites,
        "--table",
        table,
        "--checkpoint",
        str(checkpoint),
        "--out",
        str(out),
        "--max-rows",
        str(rows_per_batch),
    ]
    if available_now:
        command.append("--available-now")
    with log.open("ab") as log_file:
        return subprocess.Popen(
            command,
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            start_new_session=True,  # Its JVM and Python workers share its process group.
        )


def _committed_batches(checkpoint: Path) -> int:
    commits = checkpoint / "commits"
    if not commits.is_dir():
        return 0
    return sum(1 for entry in commits.iterdir() if entry.name.isdigit())


def test_killed_driver_resumes_from_its_checkpoint_with_no_gap(
    spark: Any, spark_cluster: LocalCluster, tmp_path: Path
) -> None:
    table, total, rows_per_batch = "resume", 40_000, 4000
    spark_cluster.create_table(table, READING_SCHEMA)
    sites = sites_of(spark_cluster)
    Publisher(session_of(spark_cluster), table).append(reading_rows(0, total))
    checkpoint, out, log = tmp_path / "checkpoint", tmp_path / "out", tmp_path / "query.log"

    first = _start_query_process(
        sites, table, checkpoint, out, log, rows_per_batch=rows_per_batch, available_now=False
    )
    try:
        wait_until(
            lambda: _committed_batches(checkpoint) >= 2 or first.poll() is not None,
            timeout_s=240,
            message="first run committed 2 micro-batches",
        )
        assert first.poll() is None, log.read_text()
    finally:
        _kill_group(first)
    wait_until(lambda: not _group_alive(first.pid), timeout_s=30, message="query process gone")
    committed_at_kill = _committed_batches(checkpoint)
    assert committed_at_kill < total // rows_per_batch, "the first run finished before the kill"

    second = _start_query_process(
        sites, table, checkpoint, out, log, rows_per_batch=rows_per_batch, available_now=True
    )
    try:
        assert second.wait(timeout=300) == 0, log.read_text()
    finally:
        _kill_group(second)
    ids = spark.read.parquet(str(out)).select("id").toArrow().column("id").to_pylist()
    assert sorted(ids) == list(range(total))  # No gap and, through the file sink, no repeat.
    assert session_of(spark_cluster).getTopicProcessedOffset(f"{table}/resume") == total - 1


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """kill -9 of the query process's group: the driver, its JVM and its Python workers."""
    with contextlib.suppress(ProcessLookupError):  # The whole group may be gone already.
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"table": "warmup"}, "hastream option sites=missing"),
        ({"sites": "@", "table": "nope"}, "table not found: 'nope'"),
        (
            {"sites": "@", "table": "warmup", "startingOffsets": "yesterday"},
            "startingOffsets='yesterday'",
        ),
        (
            {"sites": "@", "table": "warmup", "startingOffset": "earliest"},
            "did you mean startingOffsets",
        ),
        ({"sites": "localhost:notaport", "table": "warmup"}, "is not host:port"),
    ],
)
def test_bad_read_options_fail_fast_with_a_clear_message(
    spark: Any, spark_cluster: LocalCluster, options: dict[str, str], message: str
) -> None:
    options = {
        key: sites_of(spark_cluster) if value == "@" else value for key, value in options.items()
    }
    started = time.monotonic()
    with pytest.raises(Exception, match=message):
        spark.read.format("hastream").options(**options).load().collect()
    assert time.monotonic() - started < 60


def test_write_of_mismatched_columns_fails_before_any_row_is_sent(
    spark: Any, spark_cluster: LocalCluster
) -> None:
    sites = sites_of(spark_cluster)
    before = spark_cluster.row_count(spark_cluster.leader(), "warmup")
    frame = spark.range(10).selectExpr("id", "id * 0.5 AS price")
    with pytest.raises(Exception, match=r"missing \['value'\], extra \['price'\]"):
        frame.write.format("hastream").option("sites", sites).option("table", "warmup").mode(
            "append"
        ).save()
    with pytest.raises(Exception, match="append-only"):
        frame.write.format("hastream").option("sites", sites).option("table", "warmup").mode(
            "overwrite"
        ).save()
    assert spark_cluster.row_count(spark_cluster.leader(), "warmup") == before


def test_persisted_starting_offset_resumes_after_the_stored_offset(
    spark: Any, spark_cluster: LocalCluster, tmp_path: Path
) -> None:
    sites = sites_of(spark_cluster)
    table = "persisted"
    spark_cluster.create_table(table, READING_SCHEMA)
    client = session_of(spark_cluster)
    Publisher(client, table).append(reading_rows(0, 3000))
    with pytest.raises(TopicNotFound):
        client.getTopicProcessedOffset(f"{table}/p")
    from proto import hastream_pb2

    client.call(
        "CommitOffset",
        hastream_pb2.CommitOffsetRequest(table=table, action_name="p", offset=1999),
        table=table,
    )
    received: list[int] = []

    def collect(batch: Any, batch_id: int) -> None:
        received.extend(batch.select("id").toArrow().column("id").to_pylist())

    query = (
        spark.readStream.format("hastream")
        .option("sites", sites)
        .option("table", table)
        .option("action", "p")
        .option("startingOffsets", "persisted")
        .load()
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(timeout=120)
    assert query.exception() is None
    assert sorted(received) == list(range(2000, 3000))


def test_rerun_of_a_batch_write_with_the_same_token_appends_nothing(
    spark: Any, spark_cluster: LocalCluster
) -> None:
    from tests.spark.conftest import WARMUP_SCHEMA

    table = "rerun"
    spark_cluster.create_table(table, WARMUP_SCHEMA)  # No key column: only producer dedup.
    sites = sites_of(spark_cluster)
    frame = spark.range(30_000, numPartitions=2).selectExpr("id", "id * 0.5D AS value")

    def write(token: str) -> None:
        (
            frame.write.format("hastream")
            .option("sites", sites)
            .option("table", table)
            .option("batchRows", 7000)
            .option("idempotencyToken", token)
            .mode("append")
            .save()
        )

    def rows() -> int:
        # Read on the leader: it has applied every acknowledged write (a follower may lag).
        return spark_cluster.row_count(spark_cluster.leader(), table)

    write("job-1")
    assert rows() == 30_000
    write("job-1")  # A re-run: every request is answered from the producer window.
    assert rows() == 30_000
    write("job-2")  # Another job appends its own rows.
    assert rows() == 60_000


def test_a_stream_in_complete_mode_is_refused_naming_the_output_mode(
    spark: Any, spark_cluster: LocalCluster, tmp_path: Path
) -> None:
    sites = sites_of(spark_cluster)
    before = spark_cluster.row_count(spark_cluster.leader(), "warmup")
    counts = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", 10)
        .load()
        .selectExpr("value % 3 AS id")
        .groupBy("id")
        .count()
        .selectExpr("id", "CAST(count AS DOUBLE) AS value")
    )

    def run_in_complete_mode() -> None:
        query = (
            counts.writeStream.format("hastream")
            .option("sites", sites)
            .option("table", "warmup")
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .outputMode("complete")
            .start()
        )
        try:
            query.awaitTermination(timeout=120)
        finally:
            query.stop()

    with pytest.raises(Exception, match=r"outputMode\('append'\)"):
        run_in_complete_mode()
    assert spark_cluster.row_count(spark_cluster.leader(), "warmup") == before


def _tick_after(ms: int) -> int:
    """A wall-clock ms strictly after `ms` (polled)."""
    wait_until(lambda: time.time_ns() // 1_000_000 > ms, timeout_s=5, message="the clock")
    return time.time_ns() // 1_000_000


def test_reads_start_and_end_by_ingest_time_with_metadata_columns(
    spark: Any, spark_cluster: LocalCluster, tmp_path: Path
) -> None:
    sites = sites_of(spark_cluster)
    table = "by_time"
    spark_cluster.create_table(table, READING_SCHEMA)
    publisher = Publisher(session_of(spark_cluster), table)
    times = []
    for batch in range(3):  # rows [1000 * batch, 1000 * (batch + 1)), a clock tick apart
        times.append(_tick_after(time.time_ns() // 1_000_000))
        publisher.append(reading_rows(1000 * batch, 1000))

    def reader(**options: str) -> Any:
        read = spark.read.format("hastream").option("sites", sites).option("table", table)
        for name, value in options.items():
            read = read.option(name, value)
        return read.load()

    middle = reader(
        startingTimestamp=str(times[1]), endingTimestamp=str(times[2]), includeMetadata="true"
    ).toArrow()
    assert middle.column_names == ["id", "ts", "device", "value", "_offset", "_ingest_time"]
    assert sorted(middle.column("id").to_pylist()) == list(range(1000, 2000))
    assert sorted(middle.column("_offset").to_pylist()) == list(range(1000, 2000))
    stamps = {t.timestamp() * 1000 for t in middle.column("_ingest_time").to_pylist()}
    assert len(stamps) == 1, "one publish, one stamp"
    assert times[1] <= stamps.pop() <= times[2]

    late = str(_tick_after(time.time_ns() // 1_000_000) + 60_000)
    with pytest.raises(Exception, match="no row of 'by_time' is stamped at or after"):
        reader(startingTimestamp=late).count()
    assert reader(startingTimestamp=late, startingOffsetsByTimestampStrategy="latest").count() == 0

    received: list[int] = []
    query = (
        spark.readStream.format("hastream")
        .option("sites", sites)
        .option("table", table)
        .option("startingOffsetsByTimestamp", f'{{"{table}": {{"0": {times[2]}}}}}')
        .load()
        .writeStream.foreachBatch(
            lambda batch, _: received.extend(batch.toArrow().column("id").to_pylist())
        )
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(timeout=120)
    assert query.exception() is None
    assert sorted(received) == list(range(2000, 3000))


def test_min_rows_per_trigger_waits_for_rows_until_the_max_delay(
    spark: Any, spark_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Kafka's minOffsetsPerTrigger and maxTriggerDelay: 100 rows wait (no micro-batch) until
    the delay has passed since the query started; 600 rows go at once."""
    sites = sites_of(spark_cluster)
    table = "min_rows"
    spark_cluster.create_table(table, READING_SCHEMA)
    publisher = Publisher(session_of(spark_cluster), table)
    batches: list[tuple[float, int]] = []
    delay_s = 4.0

    def collect(batch: Any, batch_id: int) -> None:
        rows = batch.count()
        if rows:
            batches.append((time.monotonic(), rows))

    query = (
        spark.readStream.format("hastream")
        .option("sites", sites)
        .option("table", table)
        .option("startingOffsets", "earliest")
        .option("minOffsetsPerTrigger", "500")
        .option("maxTriggerDelay", f"{delay_s}s")
        .load()
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        started = time.monotonic()
        publisher.append(reading_rows(0, 100))
        wait_until(lambda: len(batches) >= 1, timeout_s=60, message="the delayed batch")
        assert batches[0][1] == 100
        assert batches[0][0] - started >= delay_s - 0.5, "fewer rows wait for the delay"
        sent = time.monotonic()
        publisher.append(reading_rows(100, 600))
        wait_until(lambda: len(batches) >= 2, timeout_s=60, message="the full batch")
        assert batches[1][1] == 600
        assert batches[1][0] - sent < delay_s, "enough rows go at once"
    finally:
        query.stop()
    assert query.exception() is None


PADDED_SCHEMA = pa.schema([("id", pa.int64()), ("pad", pa.string())])
PAD = "x" * 1000  # ~1 KB a row: a 64 MiB data segment fills with ~65,000 rows


def _segment_files(cluster: LocalCluster, alias: str, table: str) -> list[Path]:
    persistence = cluster.root / alias / "persistence"
    return sorted(
        path
        for path in persistence.rglob("seg-*.dat")
        if path.parent.name.split(".")[0] == table and not path.parent.parent.name.startswith(".")
    )


def test_fail_on_data_loss_false_skips_rows_retention_removed(spark: Any, tmp_path: Path) -> None:
    """Rows a query has not read are gone (what retention does: every replica's oldest sealed
    segment deleted): by default the read fails naming the lost range; with
    failOnDataLoss=false it warns and goes on from the earliest retained row."""
    cluster = LocalCluster(tmp_path / "cluster").start()
    try:
        cluster.create_table("lossy", PADDED_SCHEMA)
        publisher = Publisher(session_of(cluster), "lossy")
        total = 0
        while len(_segment_files(cluster, "node1", "lossy")) < 2:
            ids = range(total, total + 5000)
            publisher.append(pa.table({"id": list(ids), "pad": [PAD] * 5000}, PADDED_SCHEMA))
            total += 5000
            assert total < 1_000_000, "no second data segment"
        wait_until(
            lambda: all(cluster.row_count(alias, "lossy") == total for alias in cluster.nodes),
            timeout_s=60,
            message="every replica has the rows",
        )
        cluster.stop()
        retained = set()
        for alias in cluster.nodes:
            first, second, *_ = _segment_files(cluster, alias, "lossy")
            first.unlink()
            retained.add(int(second.name.removeprefix("seg-").removesuffix(".dat")))
        (retained_from,) = retained
        cluster.start()
        sites = sites_of(cluster)

        def read(**options: str) -> Any:
            reader = spark.read.format("hastream").option("sites", sites)
            reader = reader.option("table", "lossy").option("startingOffsets", "0")
            for name, value in options.items():
                reader = reader.option(name, value)
            return reader.load().select("id")

        with pytest.raises(Exception, match=f"no longer retains rows \\[0, {retained_from}\\)"):
            read().count()
        ids = read(failOnDataLoss="false").toArrow().column("id").to_pylist()
        assert sorted(ids) == list(range(retained_from, total))
    finally:
        cluster.stop()


def test_progress_names_the_table_and_a_checkpoint_of_another_table_is_refused(
    spark: Any, spark_cluster: LocalCluster, tmp_path: Path
) -> None:
    sites = sites_of(spark_cluster)
    for table in ("named_a", "named_b"):
        spark_cluster.create_table(table, READING_SCHEMA)
        Publisher(session_of(spark_cluster), table).append(reading_rows(0, 100))

    def run(table: str) -> Any:
        query = (
            spark.readStream.format("hastream")
            .option("sites", sites)
            .option("table", table)
            .option("startingOffsets", "earliest")
            .load()
            .writeStream.foreachBatch(lambda batch, _: None)
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(timeout=120)
        return query

    first = run("named_a")
    assert first.exception() is None
    source = first.lastProgress["sources"][0]
    assert json.loads(source["endOffset"]) == {"table": "named_a", "offset": 100}
    assert json.loads(source["latestOffset"]) == {"table": "named_a", "offset": 100}
    with pytest.raises(Exception, match="the checkpoint holds offsets of table 'named_a'"):
        run("named_b")  # the same checkpointLocation, another table


def test_a_publishing_task_learns_the_leader_once_then_asks_it_for_the_table(
    spark_cluster: LocalCluster,
) -> None:
    """Each Spark task that publishes first needs the table's schema; a reused Python worker
    keeps its session, so only its first task looks the group's leader up."""
    from spark_publisher import clients
    from spark_publisher.cluster import publish_schema
    from spark_publisher.options import parse
    from tests.spark.conftest import WARMUP_SCHEMA

    # A timeout no other test uses: a session of its own in this process's cache.
    options = parse({"sites": sites_of(spark_cluster), "table": "warmup", "timeoutSec": "37"})
    session = clients.session(options.sites, options.timeout_s, options.tls, options.login)
    assert session.group_leader(2) is None

    assert publish_schema(options).equals(WARMUP_SCHEMA)
    leader = spark_cluster.nodes[spark_cluster.leader()]
    assert session.group_leader(2) == f"127.0.0.1:{leader.port}"
    # Asked again (the next task in the same worker): the same answer, from the leader.
    assert publish_schema(options).equals(WARMUP_SCHEMA)
    assert session.route(table="warmup") == f"127.0.0.1:{leader.port}"
