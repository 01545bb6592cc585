"""Spark <-> HA stream table throughput, beside the plain Python client on the same cluster.

    python -m bench.spark_bench [--rows 1000000] [--repeat 2]

On a fresh local three-node cluster (group 2) and a local[2] SparkSession it measures, for
`--rows` rows of 11 columns (long, string, int, long, double, double, uuid-like string,
bool, timestamp, date, 20-char string) written to HA tables keyed by `id`:
- `df.write.format("hastream")` (DataSourceArrowWriter, 2 tasks), batchRows 10000 and 50000;
- `df.writeStream.format("hastream")` of the same rows read back from 2 parquet files
  (`availableNow`, one micro-batch), batchRows 10000;
- the plain client: `Publisher.append` of the same Arrow rows, 10000 rows per request, with
  1 and 2 publisher threads;
- Spark's own floor: the same `df.write` and `df.writeStream` into a Python sink whose
  writers only count their rows (bench/spark_floor.py): what Spark takes to hand the rows
  to its Python workers, on the same cores, in the same rounds;
The write cells run interleaved, round by round (`--repeat` rounds), after `--warmup`
untimed rounds of them (default 1: the first Spark write of a session starts its Python
workers and warms the JVM, 2-4 times a steady write's seconds), and the Spark writes
are also given as a share of the 1-thread Publisher: the median of the per-round ratios.
- `spark.readStream.format("hastream")` with `availableNow` (micro-batches of 200000 rows)
  into the `noop` sink, and a batch `spark.read` into `noop`;
- the plain client: `Session.read` of the whole range, and a `subscribe` from offset 0.
Each figure is the best of `--repeat` runs (fresh tables for writes). Prints a Markdown
table; the machine's load average is printed too, since other work shares the cores. Writes
it, with the date, the command and the machine, to `--markdown` (default
bench/results/spark-bench.md) and every run's seconds to `--json` (bench/results/spark-bench.json).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from api_clients import Publisher, Session, TableExists
from bench import common
from deploy.local_cluster import LocalCluster, wait_until

SCHEMA = pa.schema(
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
COLUMNS = (
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
CLIENT_BATCH_ROWS = 10_000
PUBLISHER = "client Publisher.append, 10000-row requests, 1 thread"
FLOOR_WRITE = "Spark's floor: df.write into a Python sink that only counts"
FLOOR_STREAM_WRITE = "Spark's floor: df.writeStream from parquet into a sink that only counts"
RESULTS_STEM = common.RESULTS_DIR / "spark-bench"


@dataclass(frozen=True)
class Row:
    """One line of the table: a path's best time and, for the writes, its median share of
    the 1-thread Publisher's rows/s (the per-round ratios); every run's seconds."""

    name: str
    seconds: float
    share: str
    runs: list[float]
    warmup_runs: list[float] = dataclasses.field(default_factory=list)  # untimed rounds


def timed_runs(repeat: int, run: Callable[[int], float]) -> list[float]:
    """The seconds of `repeat` timed runs; `run(attempt)` returns its seconds."""
    return [run(attempt) for attempt in range(repeat)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.spark_bench")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds of the writes")
    parser.add_argument("--markdown", type=Path, default=RESULTS_STEM.with_suffix(".md"))
    parser.add_argument("--json", type=Path, default=RESULTS_STEM.with_suffix(".json"))
    args = parser.parse_args(argv)
    command = "python -m bench.spark_bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    meta: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "rows": args.rows,
        "repeat": args.repeat,
        "warmup": args.warmup,
        "machine": common.machine(),
        "loadavg_start": list(os.getloadavg()),
    }
    from spark_publisher.local import local_spark

    spark = local_spark("hastream-bench", cores=2, memory="2g")
    root = Path(tempfile.mkdtemp(prefix="spark-bench-"))
    cluster = LocalCluster(root / "cluster")
    try:
        cluster.start()
        cluster.leader()
        results = run_all(spark, cluster, root, args.rows, args.repeat, args.warmup)
    finally:
        spark.stop()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)  # Gigabytes of Raft log and data files.
    meta["loadavg_end"] = list(os.getloadavg())
    text = report(results, args.rows, meta)
    print()
    print(text, end="")
    args.markdown.write_text(text)
    record = {**meta, "results": [dataclasses.asdict(row) for row in results]}
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.markdown} and {args.json}")


def report(results: list[Row], rows: int, meta: dict[str, Any]) -> str:
    """The results as Markdown: what ran where, then the table."""
    machine = meta["machine"]
    start, end = (
        " ".join(f"{v:.2f}" for v in meta[key]) for key in ("loadavg_start", "loadavg_end")
    )
    lines = [
        "# Spark and the plain client on one local cluster",
        "",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- rows: {rows:,} of 11 columns; best of {meta['repeat']} runs each",
        f"- warm-up: {meta['warmup']} untimed round(s) of every write first (Spark's Python"
        " workers start, the JVM warms up); their seconds are in the JSON (`warmup_runs`)",
        f"- load average (1, 5, 15 min): start {start}; end {end}",
        f"- machine: {machine['cpus']} CPUs, {machine['cpu_model']}, Python {machine['python']},"
        f" pyarrow {machine['pyarrow']}, code {machine['code']}",
        "",
        "| path | seconds (best) | rows/s (best) | of the 1-thread Publisher (median) |",
        "|---|---:|---:|---:|",
    ]
    for row in results:
        lines.append(
            f"| {row.name} | {row.seconds:.2f} | {rows / row.seconds:,.0f} | {row.share} |"
        )
    return "\n".join(lines) + "\n"


def run_all(
    spark: Any, cluster: LocalCluster, root: Path, rows: int, repeat: int, warmup: int
) -> list[Row]:
    from bench import spark_floor  # imports pyspark, as the Spark session does

    spark.dataSource.register(spark_floor.CountingSink)
    sites = ",".join(f"127.0.0.1:{node.port}" for node in cluster.nodes.values())
    client = Session(sites.split(","))
    frame = spark.range(rows, numPartitions=2).selectExpr(*COLUMNS).cache()
    frame.count()
    arrow_rows = frame.toArrow().cast(SCHEMA)
    tables = iter(range(10_000))
    parquet_dir = root / "parquet"
    frame.write.parquet(str(parquet_dir))  # the streaming write's source: 2 files

    def new_table() -> str:
        name = f"bench{next(tables)}"
        # TableExists: our own first attempt, whose answer a leader change lost.
        with contextlib.suppress(TableExists):
            client.haStreamTable(2, SCHEMA, name, cacheLimit=100_000, keyColumn="id")
        # Wait until every node has applied the creation, that is, has caught up with the
        # previous run's writes: a node that has not answers TableNotFound (not NotLeader)
        # to a publish, and leaders change under this load. It also keeps one run's
        # follower catch-up out of the next run's time.
        settle_started = time.perf_counter()
        wait_until(
            lambda: all(cluster.row_count(alias, name) == 0 for alias in cluster.alive()),
            timeout_s=600,
            interval_s=0.2,
            message=f"{name} created on every node",
        )
        print(f"{name}: followers settled in {time.perf_counter() - settle_started:.1f}s")
        client.getStreamingLeader(2)  # Publishes from this process go straight to the leader.
        return name

    def timed(action: Callable[[], object]) -> float:
        started = time.perf_counter()
        action()
        return time.perf_counter() - started

    def spark_write(batch_rows: int) -> Callable[[int], float]:
        def run(attempt: int) -> float:
            name = new_table()
            writer = (
                frame.write.format("hastream")
                .option("sites", sites)
                .option("table", name)
                .option("batchRows", batch_rows)
                .mode("append")
            )
            seconds = timed(writer.save)
            assert client.getTableInfo(name).row_count == rows or fresh_count(client, name) == rows
            return seconds

        return run

    def stream_into(sink: str, options: dict[str, str], checkpoint: str) -> float:
        query = (
            spark.readStream.schema(frame.schema)
            .parquet(str(parquet_dir))
            .writeStream.format(sink)
            .options(**options)
            .option("checkpointLocation", str(root / f"write-checkpoint-{checkpoint}"))
            .trigger(availableNow=True)
        )

        def go() -> None:
            started = query.start()
            started.awaitTermination()
            assert started.exception() is None, started.exception()

        return timed(go)

    def spark_stream_write(attempt: int) -> float:
        name = new_table()
        seconds = stream_into("hastream", {"sites": sites, "table": name}, name)
        assert fresh_count(client, name) == rows
        return seconds

    def floor_write(attempt: int) -> float:
        writer = frame.write.format(spark_floor.NAME).option("rows", rows).mode("append")
        return timed(writer.save)  # the sink's commit fails unless every row arrived

    def floor_stream_write(attempt: int) -> float:
        return stream_into(spark_floor.NAME, {"rows": str(rows)}, f"floor{attempt}")

    def client_write(threads: int) -> Callable[[int], float]:
        def run(attempt: int) -> float:
            name = new_table()
            share = -(-rows // threads)

            errors: list[BaseException] = []

            def publish(part: int) -> None:
                try:
                    publisher = Publisher(client, name)
                    piece = arrow_rows.slice(part * share, share)
                    for start in range(0, piece.num_rows, CLIENT_BATCH_ROWS):
                        publisher.append(piece.slice(start, CLIENT_BATCH_ROWS))
                except BaseException as error:
                    errors.append(error)
                    raise

            workers = [threading.Thread(target=publish, args=(part,)) for part in range(threads)]

            def go() -> None:
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join()

            seconds = timed(go)
            assert not errors, errors
            assert fresh_count(client, name) == rows
            return seconds

        return run

    writes: dict[str, Callable[[int], float]] = {
        PUBLISHER: client_write(1),
        "df.write hastream, batchRows 10000": spark_write(10_000),
        "df.writeStream hastream from parquet, availableNow, batchRows 10000": (spark_stream_write),
        "df.write hastream, batchRows 50000": spark_write(50_000),
        "client Publisher.append, 10000-row requests, 2 threads": client_write(2),
        FLOOR_WRITE: floor_write,
        FLOOR_STREAM_WRITE: floor_stream_write,
    }
    rounds: dict[str, list[float]] = {name: [] for name in writes}
    # Interleaved, so drifting load hits every cell alike; the first `warmup` rounds are
    # untimed (attempts below 0).
    for attempt in range(-warmup, repeat):
        for name, run in writes.items():
            rounds[name].append(run(attempt))
    seconds = {name: runs[warmup:] for name, runs in rounds.items()}
    results: list[Row] = []
    for name, runs in seconds.items():
        ratios = sorted(base / own for base, own in zip(seconds[PUBLISHER], runs, strict=True))
        share = "" if name == PUBLISHER else f"{ratios[len(ratios) // 2]:.0%}"
        results.append(Row(name, min(runs), share, runs, rounds[name][:warmup]))
    source = new_table()
    Publisher(client, source).append(arrow_rows)
    assert fresh_count(client, source) == rows

    def stream_read(attempt: int) -> float:
        query = (
            spark.readStream.format("hastream")
            .option("sites", sites)
            .option("table", source)
            .option("startingOffsets", "earliest")
            .option("maxRowsPerTrigger", 200_000)
            .load()
            .writeStream.format("noop")
            .option("checkpointLocation", str(root / f"checkpoint-{attempt}"))
            .trigger(availableNow=True)
        )

        def go() -> None:
            started = query.start()
            started.awaitTermination()
            assert sum(p["numInputRows"] for p in started.recentProgress) == rows

        return timed(go)

    def batch_read(attempt: int) -> float:
        reader = spark.read.format("hastream").option("sites", sites).option("table", source)
        return timed(lambda: reader.load().write.format("noop").mode("overwrite").save())

    def client_read(attempt: int) -> float:
        return timed(lambda: client.read(source, 0, rows))

    def client_subscribe(attempt: int) -> float:
        done = threading.Event()
        seen = [0]

        def handler(message: pa.Table, first_offset: int) -> None:
            seen[0] += message.num_rows
            if seen[0] >= rows:
                done.set()

        def go() -> None:
            client.subscribe(source, handler, offset=0, actionName=f"bench{attempt}",
                             persistOffset=False)  # fmt: skip
            assert done.wait(300)
            client.unsubscribe(source, f"bench{attempt}")

        return timed(go)

    reads: dict[str, Callable[[int], float]] = {
        "readStream hastream, availableNow, 200000 rows/trigger, noop sink": stream_read,
        "spark.read hastream, noop sink": batch_read,
        "client Session.read of the whole range": client_read,
        "client subscribe from offset 0": client_subscribe,
    }
    for name, read in reads.items():
        runs = timed_runs(repeat, read)
        results.append(Row(name, min(runs), "", runs))
    frame.unpersist()
    return results


def fresh_count(client: Any, table: str) -> int:
    client.getStreamingLeader(2)
    return int(client.getTableInfo(table).row_count)


if __name__ == "__main__":
    main()
