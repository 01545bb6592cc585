"""The main job: a local three-node cluster fed and read by Spark, with a leader kill.

    python -m deploy.main_job [--seconds 60] [--rows-per-batch 40000] [--trigger-ms 2000]
                              [--keep] [--insecure]

1. Starts a local SparkSession and an ephemeral three-node cluster under
   `.run/main_job/<time>/` under the current directory (never inside an installed
   package: run it from the checkout, or from any directory after a pip install;
   deploy.local_cluster), and creates the HA device table
   `haDevSt` (keyed by `id`) in Raft group 2.
2. Publisher: a Spark structured-streaming query turns a `rate-micro-batch` stream into
   device readings (JVM expressions, Arrow to the sink) and writes them with
   `writeStream.format("hastream")`.
3. Subscriber: a second query reads `spark.readStream.format("hastream")` and, per
   micro-batch, writes a per-device aggregate to parquet and records every row id.
4. Midway it kills -9 the leader of the table's group, later restarts it; both queries carry
   on by themselves.
Secure by default: the nodes serve TLS (a development CA generated under the run
directory) and require logins (user `admin`, its password generated into a 0600 file whose
path is printed); the clients and both Spark queries connect with the CA and log in.
`--insecure` runs plaintext without logins.
5. It stops the publisher, waits for the subscriber to catch up and for its offset to be
   persisted, prints a report, and exits 1 if any row was lost or duplicated.
A progress line is printed every two seconds. The cluster is torn down at the end, also
on error or Ctrl-C; its data directories are deleted unless --keep.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa

from deploy.local_cluster import LocalCluster
from hastream.tls import ClientTls

log = logging.getLogger("deploy.main_job")

TABLE: Final = "haDevSt"
GROUP: Final = 2
ACTION: Final = "deviceAgg"
DEVICES: Final = 1000
PROGRESS_INTERVAL_S: Final = 2.0
POLL_INTERVAL_S: Final = 0.5
# The writer keeps up when its median interval rate reaches this share of the offered rate.
KEPT_UP_SHARE: Final = 0.95
CATCH_UP_TIMEOUT_S: Final = 180.0
OFFSET_TIMEOUT_S: Final = 60.0
SCHEMA: Final = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        ("deviceId", pa.int32()),
        ("ts", pa.timestamp("ms")),
        ("temperature", pa.float64()),
        ("humidity", pa.float64()),
        ("pressure", pa.float64()),
        ("voltage", pa.float64()),
        ("battery", pa.int32()),
        ("status", pa.string()),
        ("site", pa.string()),
    ]
)
# Readings as JVM expressions of the rate source's `value` and `timestamp`: deterministic
# per row, so a replayed micro-batch republishes identical rows.
READING_COLUMNS: Final = (
    "value AS id",
    f"CAST(value % {DEVICES} AS INT) AS deviceId",
    "timestamp AS ts",
    "20.0D + (value % 97) / 10.0D AS temperature",
    "40.0D + (value % 61) / 2.0D AS humidity",
    "1000.0D + (value % 29) / 4.0D AS pressure",
    "3.3D - (value % 11) / 100.0D AS voltage",
    "CAST(100 - value % 100 AS INT) AS battery",
    "CASE WHEN value % 500 = 0 THEN 'alarm' ELSE 'ok' END AS status",
    "concat('site-', CAST(value % 7 AS STRING)) AS site",
)


class Delivered:
    """Row ids the subscriber processed, counted per id (numpy, no per-row Python)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = np.zeros(1 << 20, dtype=np.uint16)
        self._batches: set[int] = set()

    def add(self, batch_id: int, ids: np.ndarray) -> bool:
        """Records a micro-batch once (a replayed batch id is ignored); False if replayed."""
        with self._lock:
            if batch_id in self._batches:
                return False
            self._batches.add(batch_id)
            if ids.size:
                needed = int(ids.max()) + 1
                if needed > self._counts.size:
                    grown = np.zeros(max(needed, 2 * self._counts.size), dtype=np.uint16)
                    grown[: self._counts.size] = self._counts
                    self._counts = grown
                np.add.at(self._counts, ids, 1)
            return True

    def counts(self) -> np.ndarray:
        with self._lock:
            return self._counts.copy()

    def distinct(self) -> int:
        with self._lock:
            return int(np.count_nonzero(self._counts))


@dataclass
class Watch:
    """What the progress thread saw: leader per poll and its changes."""

    leader: str = "?"
    changes: list[tuple[float, str, str]] = field(default_factory=list)
    published: int = 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.main_job", description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="publishing time")
    # 20,000 rows/s offered in 2 s micro-batches. Spark's own cost per micro-batch is
    # fixed (~0.5 s for a Python sink that writes nothing, on a slow 2-core machine beside
    # the nodes and the reading query), so a 500 ms trigger measured Spark's per-batch
    # overhead rather than the sink: it fell to 37% there (97% at 2 s, docs/spark.md).
    parser.add_argument("--rows-per-batch", type=int, default=40_000)
    parser.add_argument("--trigger-ms", type=int, default=2_000)
    parser.add_argument("--keep", action="store_true", help="keep the cluster's data dirs")
    parser.add_argument(
        "--insecure", action="store_true", help="plaintext, no logins (default: TLS + logins)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _raise_interrupt)

    here = Path.cwd()
    run_dir = here / ".run" / "main_job" / datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    say(f"run directory {_shown(run_dir)}")
    say("starting Spark (local[2]) ...")
    from spark_publisher.local import local_spark

    # Spark first: its JVM is forked before this process opens any gRPC channel.
    spark = local_spark("hastream-main-job", cores=2, memory="1g")
    cluster = LocalCluster(run_dir / "cluster", groups=(GROUP,))
    try:
        return run(spark, cluster, run_dir, args)
    finally:
        for query in spark.streams.active:
            query.stop()
        spark.stop()
        cluster.stop()
        if not args.keep:
            for alias in cluster.nodes:
                shutil.rmtree(run_dir / "cluster" / alias, ignore_errors=True)
        say("cluster stopped")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def say(text: str) -> None:
    print(text, flush=True)


@dataclass(frozen=True)
class Security:
    """How the clients reach the cluster: TLS trust and a login, or neither (--insecure)."""

    tls: ClientTls | None = None
    login: tuple[str, str] | None = None

    @property
    def spark_options(self) -> dict[str, str]:
        options = {} if self.tls is None else {"caFile": str(self.tls.ca_file)}
        if self.login is not None:
            options.update(userid=self.login[0], password=self.login[1])
        return options

    def session(self, sites: list[str], deadline_s: float) -> Any:
        from api_clients import Session

        userid, password = self.login if self.login is not None else (None, None)
        session = Session(
            sites, deadline_s=deadline_s, tls=self.tls, userid=userid, password=password
        )
        return session


def secure(cluster: LocalCluster, insecure: bool) -> Security:
    """Before the nodes start: TLS with a development CA and logins with a generated admin
    password (printed: where it is, never what it is), unless `insecure`."""
    if insecure:
        say("security: off (--insecure): plaintext, no logins")
        return Security()
    ca = cluster.enable_tls()
    password_file = cluster.enable_authentication(secrets.token_urlsafe(18))
    say(
        f"security: TLS (development CA {_shown(ca.ca_file)}), logins on: user admin, "
        f"password in {_shown(password_file)} (mode 0600)"
    )
    tls = ClientTls(ca_file=str(ca.ca_file))
    return Security(tls=tls, login=("admin", password_file.read_text().strip()))


def _shown(path: Path) -> str:
    here = Path.cwd()
    return str(path.relative_to(here)) if path.is_relative_to(here) else str(path)


def run(spark: Any, cluster: LocalCluster, run_dir: Path, args: argparse.Namespace) -> int:
    from spark_publisher import HAStreamOffsetListener

    security = secure(cluster, args.insecure)
    say("starting a three-node cluster ...")
    cluster.start()
    first_leader = cluster.leader(GROUP)
    sites = ",".join(f"127.0.0.1:{node.port}:{alias}" for alias, node in cluster.nodes.items())
    client = security.session(sites.split(","), deadline_s=10.0)
    client.haStreamTable(GROUP, SCHEMA, TABLE, cacheLimit=200_000, keyColumn="id")
    say(f"cluster up: leader {first_leader}; table {TABLE} created; sites {sites}")

    delivered = Delivered()
    listener = HAStreamOffsetListener(
        sites,
        TABLE,
        ACTION,
        query_name="subscriber",
        **security.spark_options,  # type: ignore[arg-type]  # str options, not the ints
    )
    spark.streams.addListener(listener)
    options = security.spark_options
    subscriber = start_subscriber(spark, sites, run_dir, delivered, options)
    publisher = start_publisher(spark, sites, run_dir, args, options)
    started = time.monotonic()
    watch = Watch(leader=first_leader)
    monitor = Monitor(cluster, security.session(client.sites, 1.0), delivered, watch, started)
    monitor.start()
    try:
        killed = drive_failover(cluster, publisher, subscriber, watch, started, args.seconds)
        publisher = finish_publisher(spark, publisher, sites, run_dir, args, options)
        publish_s = time.monotonic() - started
        failed = query_failure(publisher) or query_failure(subscriber)
        if failed:
            say(f"FAILED: {failed}")
            return 1
        table_rows = fresh_row_count(client)
        say(f"publisher stopped after {publish_s:.1f}s: {table_rows:,} rows in {TABLE}")
        wait_for(
            lambda: delivered.distinct() >= table_rows or query_failure(subscriber),
            CATCH_UP_TIMEOUT_S,
        )
        receive_s = time.monotonic() - started
        wait_for(lambda: listener.persisted == table_rows - 1, OFFSET_TIMEOUT_S)
    finally:
        monitor.stop()
    subscriber.stop()
    return report(
        spark, client, delivered, watch, listener, run_dir,
        killed=killed, publish_s=publish_s, receive_s=receive_s,
        offered_per_s=args.rows_per_batch * 1000 / args.trigger_ms, rates=monitor.rates,
        subscriber_error=query_failure(subscriber),
    )  # fmt: skip


def start_publisher(
    spark: Any,
    sites: str,
    run_dir: Path,
    args: argparse.Namespace,
    options: dict[str, str],
    *,
    available_now: bool = False,
) -> Any:
    readings = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", args.rows_per_batch)
        .option("numPartitions", 2)
        .load()
        .selectExpr(*READING_COLUMNS)
    )
    writer = (
        readings.writeStream.format("hastream")
        .queryName("publisher")
        .option("sites", sites)
        .option("table", TABLE)
        .options(**options)
        .option("checkpointLocation", str(run_dir / "checkpoints" / "publisher"))
    )
    if available_now:
        return writer.trigger(availableNow=True).start()
    return writer.trigger(processingTime=f"{args.trigger_ms} milliseconds").start()


def finish_publisher(
    spark: Any,
    publisher: Any,
    sites: str,
    run_dir: Path,
    args: argparse.Namespace,
    options: dict[str, str],
) -> Any:
    """Stops the publisher and ends its stream cleanly. `stop()` may cut a micro-batch short
    with part of its rows already appended; a restart on the same checkpoint with
    `availableNow` replays that micro-batch (its rows already in the table are answered
    from the cluster's producer window, not appended again) and then stops."""
    # Spark logs the cut-short micro-batch's abort with stack traces at ERROR: expected here.
    spark.sparkContext.setLogLevel("OFF")
    try:
        publisher.stop()
    finally:
        spark.sparkContext.setLogLevel("ERROR")
    say("publisher stopped; replaying its last micro-batch to completion (availableNow) ...")
    finisher = start_publisher(spark, sites, run_dir, args, options, available_now=True)
    finisher.awaitTermination(timeout=CATCH_UP_TIMEOUT_S)
    return finisher


def start_subscriber(
    spark: Any, sites: str, run_dir: Path, delivered: Delivered, options: dict[str, str]
) -> Any:
    from pyspark.sql import functions as F

    aggregate_dir = str(run_dir / "device_agg")

    def process(batch: Any, batch_id: int) -> None:
        batch.persist()
        try:
            ids = batch.select("id").toArrow().column("id").to_numpy()
            if not delivered.add(batch_id, ids):
                return
            per_device = batch.groupBy("deviceId").agg(
                F.count("*").alias("readings"),
                F.sum("temperature").alias("temperatureSum"),
                F.min("temperature").alias("temperatureMin"),
                F.max("temperature").alias("temperatureMax"),
                F.avg("humidity").alias("humidityAvg"),
                F.sum(F.when(F.col("status") == "alarm", 1).otherwise(0)).alias("alarms"),
            )
            per_device.withColumn("batchId", F.lit(batch_id)).write.mode("append").parquet(
                aggregate_dir
            )
        finally:
            batch.unpersist()

    return (
        spark.readStream.format("hastream")
        .option("sites", sites)
        .option("table", TABLE)
        .option("action", ACTION)
        .option("startingOffsets", "earliest")
        .option("maxRowsPerTrigger", 100_000)
        .options(**options)
        .load()
        .writeStream.queryName("subscriber")
        .foreachBatch(process)
        .option("checkpointLocation", str(run_dir / "checkpoints" / "subscriber"))
        .trigger(processingTime="500 milliseconds")
        .start()
    )


def drive_failover(
    cluster: LocalCluster,
    publisher: Any,
    subscriber: Any,
    watch: Watch,
    started: float,
    seconds: float,
) -> str:
    """Kills the group's leader at 40% of the run and restarts it at 70%."""

    def at(fraction: float) -> None:
        wait_for(
            lambda: (
                time.monotonic() - started >= seconds * fraction
                or query_failure(publisher)
                or query_failure(subscriber)
            ),
            seconds + 60,
        )

    at(0.4)
    victim = cluster.leader(GROUP)
    cluster.kill(victim)
    say(f"*** killed the leader {victim} (kill -9) at {time.monotonic() - started:.1f}s")
    at(0.7)
    cluster.start_node(victim)
    say(f"*** restarted {victim} at {time.monotonic() - started:.1f}s")
    at(1.0)
    return victim


def query_failure(query: Any) -> str | None:
    error = query.exception()
    if error is not None:
        return str(error).splitlines()[0]
    return None


def wait_for(predicate: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(POLL_INTERVAL_S / 5)


def fresh_row_count(client: Any) -> int:
    """The table's row count as the group's leader sees it."""
    client.getStreamingLeader(GROUP)  # Routes the next table call to the leader.
    return int(client.getTableInfo(TABLE).row_count)


class Monitor(threading.Thread):
    """Prints a progress line every PROGRESS_INTERVAL_S and watches the group's leader."""

    def __init__(
        self,
        cluster: LocalCluster,
        client: Any,
        delivered: Delivered,
        watch: Watch,
        started: float,
    ) -> None:
        super().__init__(name="progress", daemon=True)
        # Its own short-deadline session (`client`): a poll must not hang through an
        # election.
        self._client = client
        self._cluster = cluster
        self._delivered = delivered
        self._watch = watch
        self._start_time = started
        self._stopping = threading.Event()
        self.rates: list[float] = []  # rows/s of each progress interval once rows flow

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=10)

    def run(self) -> None:
        last_print = 0.0
        last_rows = 0
        while not self._stopping.wait(POLL_INTERVAL_S):  # The monitor's loop, until stop().
            elapsed = time.monotonic() - self._start_time
            self._poll_leader(elapsed)
            if elapsed - last_print < PROGRESS_INTERVAL_S:
                continue
            rows = self._rows()
            rate = (rows - last_rows) / max(elapsed - last_print, 1e-9) if rows >= 0 else 0
            if last_rows > 0 and rows >= 0:  # the first interval holds the queries' start
                self.rates.append(rate)
            received = self._delivered.distinct()
            # Spark plans and starts both queries before the first micro-batch: say so, rather
            # than print "published 0" lines that look like a stall.
            starting = "  (Spark queries starting)" if rows <= 0 and received == 0 else ""
            say(
                f"[{elapsed:6.1f}s] published {max(rows, 0):>10,} ({rate:>8,.0f}/s)  "
                f"received {received:>10,}  lag {max(rows - received, 0):>8,}  "
                f"leader {self._watch.leader:<8} changes {len(self._watch.changes)}{starting}"
            )
            last_print, last_rows = elapsed, max(rows, last_rows)

    def _poll_leader(self, elapsed: float) -> None:
        try:
            address = self._client.getStreamingLeader(GROUP)
        except Exception:  # Any node may be down mid-drill; the next poll tries again.
            return
        if not address:
            return  # An election is running.
        alias = address.rsplit(":", 1)[-1]
        previous = self._watch.leader
        if alias != previous and previous != "?":
            self._watch.changes.append((elapsed, previous, alias))
            say(f"*** leader change {previous} -> {alias} at {elapsed:.1f}s")
        self._watch.leader = alias

    def _rows(self) -> int:
        try:
            rows = int(self._client.getTableInfo(TABLE).row_count)
        except Exception:  # Unavailable during the drill: show the last value.
            return self._watch.published
        self._watch.published = max(self._watch.published, rows)
        return self._watch.published


def report(
    spark: Any,
    client: Any,
    delivered: Delivered,
    watch: Watch,
    listener: Any,
    run_dir: Path,
    *,
    killed: str,
    publish_s: float,
    receive_s: float,
    offered_per_s: float,
    rates: list[float],
    subscriber_error: str | None,
) -> int:
    table_ids = client.read(TABLE, 0).column("id").to_numpy()
    published = int(table_ids.size)
    table_duplicates = published - int(np.unique(table_ids).size)
    counts = delivered.counts()
    in_table = np.zeros(max(counts.size, int(table_ids.max()) + 1), dtype=bool)
    in_table[table_ids] = True
    received = int(np.count_nonzero(counts))
    padded = np.zeros(in_table.size, dtype=np.uint16)
    padded[: counts.size] = counts
    lost_ids = np.flatnonzero(in_table & (padded == 0))
    # Gaps in the published ids: the rate source numbers rows 0, 1, 2... without holes.
    gaps = int(table_ids.max()) + 1 - int(np.unique(table_ids).size)
    delivered_twice = int(np.count_nonzero(padded > 1))
    phantom = int(np.count_nonzero(~in_table & (padded > 0)))
    lost = int(lost_ids.size) + gaps
    duplicates = table_duplicates + delivered_twice + phantom
    devices = spark.read.parquet(str(run_dir / "device_agg"))
    device_count, aggregated = devices.selectExpr(
        "count(DISTINCT deviceId)", "sum(readings)"
    ).first()
    changes = ", ".join(f"{old} -> {new} at {at:.1f}s" for at, old, new in watch.changes)
    ok = lost == 0 and duplicates == 0 and subscriber_error is None
    lines = [
        "",
        "=== hastream main job report ===",
        f"cluster             3 nodes, raft group {GROUP}, table {TABLE} "
        f"({len(SCHEMA)} columns, key id)",
        f"leader killed       {killed} (kill -9, restarted later)",
        f"leader changes seen {len(watch.changes)} ({changes or 'none'})",
        f"rows published      {published:,} in {publish_s:.1f}s "
        f"({published / publish_s:,.0f} rows/s through df.writeStream; offered "
        f"{offered_per_s:,.0f}/s)",
        _keeping_up(rates, offered_per_s),
        f"rows received       {received:,} by readStream, caught up at {receive_s:.1f}s "
        f"({received / receive_s:,.0f} rows/s)",
        f"lost                {lost} (unreceived {lost_ids.size}, id gaps {gaps})",
        f"duplicates          {duplicates} (in the table {table_duplicates}, "
        f"delivered twice {delivered_twice}, unknown ids {phantom})",
        f"subscriber offset   {listener.persisted} persisted in the cluster "
        f"(last row {published - 1})",
        f"device aggregate    {device_count} devices, {aggregated:,} readings -> "
        f"{_shown(run_dir / 'device_agg')}",
        f"RESULT              {'OK' if ok else 'FAILED'}",
    ]
    if subscriber_error:
        lines.insert(-1, f"subscriber error    {subscriber_error}")
    say("\n".join(lines))
    return 0 if ok else 1


def _keeping_up(rates: list[float], offered_per_s: float) -> str:
    """Whether df.writeStream kept up with its source: the median rate of the progress
    intervals (robust to the few the leader kill slows) against the offered rate."""
    if not rates:
        return "keeping up          unknown (no full progress interval)"
    steady = sorted(rates)[len(rates) // 2]
    share = steady / offered_per_s
    verdict = "yes" if share >= KEPT_UP_SHARE else "NO"
    return (
        f"keeping up          {verdict}: median {steady:,.0f} rows/s over {len(rates)} "
        f"{PROGRESS_INTERVAL_S:g} s intervals = {share:.0%} of the offered {offered_per_s:,.0f}/s"
    )


if __name__ == "__main__":
    sys.exit(main())
