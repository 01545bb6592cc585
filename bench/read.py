"""Read throughput: 1,000,000 rows from offset 0, past cacheLimit, by Subscribe and by Read.

    python -m bench.read [--rows 1000000] [--columns 11] [--repeat 3]

A three-node local cluster, one HA table with cacheLimit 10,000 rows, filled with `--rows`
rows (batches of 10,000; 11 columns by default). Then, `--repeat` times each:
- Subscribe RPC on the leader from offset 0 (a new action name each time), until the last
  row has arrived;
- Read RPC [0, rows) on the leader, and on a follower.
Raw gRPC stubs; every message's Arrow IPC payload is decoded into a pyarrow Table (what a
consumer has to do anyway), no per-row Python. Rows older than the newest cacheLimit rows
come from the data files (pread of each record, CRC check, IPC decode, re-encode for the
wire); the files were just written, so the OS page cache likely holds them (the disk itself
is not what is measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import grpc
import pyarrow as pa

from bench import common
from deploy.local_cluster import LocalCluster
from proto import hastream_pb2 as pb
from proto import hastream_pb2_grpc

TABLE = "read_ticks"
CACHE_LIMIT = 10_000
FILL_BATCH_ROWS = 10_000


def _stub(cluster: LocalCluster, alias: str) -> hastream_pb2_grpc.StreamTableStub:
    channel = grpc.insecure_channel(
        f"127.0.0.1:{cluster.nodes[alias].port}",
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )
    return hastream_pb2_grpc.StreamTableStub(channel)


def fill(cluster: LocalCluster, leader: str, rows: int, columns: int) -> None:
    schema = common.schema_for(columns)
    pool = common.payloads(schema, FILL_BATCH_ROWS, 4)
    stub = cluster.stub(leader)
    for number in range(rows // FILL_BATCH_ROWS):
        stub.Publish(pb.PublishRequest(table=TABLE, payload=pool[number % 4]), timeout=60)


def consume(stream: grpc.Call, rows: int) -> tuple[float, int, int]:
    """(seconds, rows, payload bytes) until `rows` rows have arrived, decoding each message."""
    started = time.perf_counter()
    received = 0
    payload_bytes = 0
    for message in stream:
        if message.row_count == 0:
            continue  # a heartbeat
        table = pa.ipc.open_stream(message.payload).read_all()
        received += table.num_rows
        payload_bytes += len(message.payload)
        if received >= rows:
            break
    elapsed = time.perf_counter() - started
    stream.cancel()
    return elapsed, received, payload_bytes


def measure(cluster: LocalCluster, leader: str, follower: str, rows: int, repeat: int) -> dict:
    results: dict[str, list[tuple[float, int, int]]] = {
        "Subscribe (leader)": [],
        "Read (leader)": [],
        "Read (follower)": [],
    }
    for number in range(repeat):
        stub = _stub(cluster, leader)
        results["Subscribe (leader)"].append(
            consume(
                stub.Subscribe(
                    pb.SubscribeRequest(table=TABLE, action_name=f"bench{number}", offset=0),
                    timeout=600,
                ),
                rows,
            )
        )
        for label, alias in (("Read (leader)", leader), ("Read (follower)", follower)):
            results[label].append(
                consume(
                    _stub(cluster, alias).Read(
                        pb.ReadRequest(table=TABLE, offset_from=0, offset_to=rows), timeout=600
                    ),
                    rows,
                )
            )
        print(
            f"repeat {number + 1}: "
            + ", ".join(
                f"{label} {runs[-1][1] / runs[-1][0]:,.0f} rows/s"
                for label, runs in results.items()
            ),
            flush=True,
        )
    summary = {}
    for label, runs in results.items():
        summary[label] = {
            "rows_per_s": common.median([received / seconds for seconds, received, _ in runs]),
            "mb_per_s": common.median([size / seconds / 1e6 for seconds, _, size in runs]),
            "seconds": common.median([seconds for seconds, _, _ in runs]),
            "rows": runs[0][1],
            "runs": len(runs),
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.read",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--columns", type=int, default=11, choices=(11, 211))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    with common.bench_cluster(purge_interval_s=60.0, election_timeout_s=1.5) as cluster:
        leader = common.create_table(
            cluster,
            None,
            TABLE,
            common.schema_for(args.columns),
            group=common.HA_GROUP,
            cache_limit=CACHE_LIMIT,
        )
        fill(cluster, leader, args.rows, args.columns)
        follower = next(alias for alias in cluster.nodes if alias != leader)
        summary = measure(cluster, leader, follower, args.rows, args.repeat)
    load = common.load_average()
    lines = [
        "# Read throughput: rows from offset 0, past cacheLimit",
        "",
        f"Run {started} (code {common.code_version()}): "
        f"`python -m bench.read {' '.join(sys.argv[1:] if argv is None else argv)}`"
        f". {args.rows:,} rows of {args.columns} columns in an HA table with cacheLimit "
        f"{CACHE_LIMIT:,} (so {1 - CACHE_LIMIT / args.rows:.0%} of the rows come from the data "
        f"files, through the OS page cache); raw gRPC stubs, every message decoded with "
        f"pyarrow; medians of {args.repeat} runs; load average {load:.1f} (2 cores, shared).",
        "",
        "| RPC | rows/s | MB/s (Arrow IPC) | seconds for all rows |",
        "|---|---:|---:|---:|",
    ]
    for label, values in summary.items():
        lines.append(
            f"| {label} | {values['rows_per_s']:,.0f} | {values['mb_per_s']:,.1f} "
            f"| {values['seconds']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "read.md").write_text(text)
    (args.out / "read.json").write_text(json.dumps({"started": started, **summary}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
