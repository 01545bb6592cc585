"""A streaming subscriber in its own Python driver process, so a test can kill -9 it.

    python -m tests.spark.query_process --sites ... --table t --checkpoint DIR --out DIR
        [--available-now] [--max-rows N]

Reads the table from the earliest row (or from its checkpoint) and writes each micro-batch
to a parquet file sink (exactly-once through its own metadata log). With --available-now
it stops when the rows present at start are processed, waits for the offset listener to
persist the last row, prints `PERSISTED <offset>` and exits 0; otherwise it runs until
killed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sites", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--action", default="resume")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-rows", type=int, default=5000)
    parser.add_argument("--available-now", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()

    from deploy.local_cluster import wait_until
    from spark_publisher import HAStreamOffsetListener
    from spark_publisher.local import local_spark

    spark = local_spark("hastream-query-process", cores=2, memory="1g")
    name = f"{args.table}-{args.action}"
    listener = HAStreamOffsetListener(args.sites, args.table, args.action, query_name=name)
    spark.streams.addListener(listener)
    stream = (
        spark.readStream.format("hastream")
        .option("sites", args.sites)
        .option("table", args.table)
        .option("action", args.action)
        .option("startingOffsets", "earliest")
        .option("maxRowsPerTrigger", str(args.max_rows))
        .load()
    )
    writer = (
        stream.writeStream.format("parquet")
        .queryName(name)
        .option("path", args.out)
        .option("checkpointLocation", args.checkpoint)
    )
    if args.available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime="200 milliseconds")
    query = writer.start()
    print(f"STARTED after {time.monotonic() - started:.1f}s", flush=True)
    query.awaitTermination()
    if query.exception() is not None:
        print(f"FAILED {query.exception()}", flush=True)
        return 1
    end = json.loads(query.lastProgress["sources"][0]["endOffset"])["offset"]
    # The listener runs on Spark's listener bus thread; the test checks what it persisted.
    with contextlib.suppress(AssertionError):
        wait_until(lambda: listener.persisted == end - 1, timeout_s=60, message="offset persisted")
    print(
        f"PERSISTED {listener.persisted} END {end} after {time.monotonic() - started:.1f}s",
        flush=True,
    )
    spark.stop()
    return 0 if listener.persisted == end - 1 else 1


if __name__ == "__main__":
    sys.exit(main())
