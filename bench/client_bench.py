"""Client overhead per batch: the Python client against the raw gRPC call, same cluster.

    python -m bench.client_bench                       # 1,000,000 rows, 10,000 per batch, 5 rounds
    python -m bench.client_bench --batch-rows 1000 10000 --rounds 7 --json out.json

Starts a local three-node cluster (deploy/local_cluster.py), then, per round and per batch
size, publishes 1,000,000 rows of an 11-column table each of these ways, each into a fresh
HA table, one `Publish` per batch:

- raw:        the bare gRPC stub with Arrow IPC payloads built before the clock starts (the
              floor: no conversion, no validation, no idempotency token, no retry logic);
- raw_arrow:  the bare stub, the IPC payload encoded from the pyarrow Table in the loop;
- raw_pandas: the bare stub, the DataFrame converted by hand in the loop
              (`pa.Table.from_pandas(frame, schema, preserve_index=False, nthreads=1)` + IPC);
- arrow:      `Publisher.append(pyarrow.Table)`;
- pandas:     `Publisher.append(pandas.DataFrame)`;
- writer:     `MultithreadedTableWriter.insertArrow` (one thread, durable buffer on: an
              fdatasync per batch), timed until `waitForThreadCompletion` returns.

Every synchronous mode runs interleaved with the others batch by batch, in a fresh random
order per batch, so the load of a shared machine hits them alike. Printed: medians over the
rounds of (all rows / time inside the calls) and (batch rows / median call), with each
client mode's share of `raw` and of the raw call given the same input (`raw_arrow`,
`raw_pandas`): the client's own overhead.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import grpc
import numpy as np
import pyarrow as pa

from api_clients import MultithreadedTableWriter, Publisher, Session
from deploy.local_cluster import LocalCluster, ipc_stream
from proto import hastream_pb2 as pb

ROWS_DEFAULT: Final = 1_000_000
SCHEMA: Final = pa.schema(
    [
        ("id", pa.int64()),
        ("ts", pa.timestamp("ms")),
        ("sym", pa.string()),
        ("price", pa.float64()),
        ("volume", pa.int64()),
        ("bid", pa.float64()),
        ("ask", pa.float64()),
        ("bid_size", pa.int32()),
        ("ask_size", pa.int32()),
        ("exchange", pa.int32()),
        ("flag", pa.bool_()),
    ]
)
_SYMBOLS: Final = np.array(["AAPL", "MSFT", "GOOG", "AMZN", "META", "NVDA", "TSLA", "IBM"])
MODES: Final = ("raw", "raw_arrow", "raw_pandas", "arrow", "pandas", "writer")
SYNC_MODES: Final = ["raw", "raw_arrow", "raw_pandas", "arrow", "pandas"]
# The raw call given the same input as a client mode.
SAME_INPUT: Final = {"arrow": "raw_arrow", "pandas": "raw_pandas", "writer": "raw_arrow"}
_RAW_RETRY_CODES: Final = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,  # NotLeader
)


def make_table(rows: int) -> pa.Table:
    """`rows` rows of 11 columns, built column-wise with numpy."""
    ids = np.arange(rows, dtype=np.int64)
    generator = np.random.default_rng(7)
    return pa.table(
        {
            "id": ids,
            "ts": pa.array(1_750_000_000_000 + ids, pa.timestamp("ms")),
            "sym": pa.array(_SYMBOLS[ids % len(_SYMBOLS)]),
            "price": generator.uniform(10, 500, rows),
            "volume": generator.integers(1, 10_000, rows),
            "bid": generator.uniform(10, 500, rows),
            "ask": generator.uniform(10, 500, rows),
            "bid_size": generator.integers(1, 1_000, rows, dtype=np.int32),
            "ask_size": generator.integers(1, 1_000, rows, dtype=np.int32),
            "exchange": generator.integers(0, 20, rows, dtype=np.int32),
            "flag": ids % 3 == 0,
        },
        schema=SCHEMA,
    )


class Bench:
    def __init__(self, cluster: LocalCluster, rows: int, work_dir: Path) -> None:
        self.cluster = cluster
        self.rows = rows
        self.work_dir = work_dir
        self.sites = [f"127.0.0.1:{node.port}" for node in cluster.nodes.values()]
        self.session = Session(self.sites, deadline_s=120)
        self.table = make_table(rows)
        self.tables: list[str] = []

    def drop_tables(self) -> None:
        """Drops the tables of the previous round, so the data files stay small."""
        while self.tables:
            self.session.dropStreamTable(self.tables.pop(0), force=True)

    def fresh_table(self) -> str:
        """A new HA table (group 2), created through the client."""
        name = f"bench_{len(self.tables)}_{time.monotonic_ns()}"
        self.session.haStreamTable(2, SCHEMA, name, cacheLimit=100_000)
        self.tables.append(name)
        return name

    def check(self, table: str, mode: str) -> None:
        """Every row arrived once. The raw mode may hold more: its naive retry after an
        outcome-unknown failure (LeadershipLost) re-appends; the client's token does not."""
        leader = self.cluster.leader(timeout_s=180)
        count = self.cluster.row_count(leader, table)
        if mode.startswith("raw") and count > self.rows:
            print(f"{mode}: {count - self.rows} rows duplicated by its retries")
            return
        assert count == self.rows, f"{mode} {table}: {count} rows instead of {self.rows}"

    def paired(
        self, modes: list[str], batch_rows: int, round_number: int
    ) -> dict[str, list[float]]:
        """The synchronous modes interleaved batch by batch (each into its own table), so
        every mode sees the same background load. Returns each call's seconds, per mode."""
        slices = [self.table.slice(first, batch_rows) for first in range(0, self.rows, batch_rows)]
        tables = {mode: self.fresh_table() for mode in modes}
        calls = {mode: self._call(mode, tables[mode], slices) for mode in modes}
        seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        # A fresh random order for every batch: no mode always follows the same other mode.
        shuffle = random.Random(round_number).shuffle
        for index in range(len(slices)):
            order = list(modes)
            shuffle(order)
            for mode in order:
                started = time.perf_counter()
                calls[mode](index)
                seconds[mode].append(time.perf_counter() - started)
        for mode in modes:
            self.check(tables[mode], mode)
        return seconds

    def _call(self, mode: str, table: str, slices: list[pa.Table]) -> Callable[[int], object]:
        if mode.startswith("raw"):
            stubs = [self.cluster.stub(self.cluster.leader(timeout_s=180))]
            if mode == "raw_arrow":
                return lambda index: self.publish_raw(stubs, table, ipc_stream(slices[index]))
            if mode == "raw_pandas":
                frames = [part.to_pandas() for part in slices]

                def by_hand(index: int) -> None:
                    converted = pa.Table.from_pandas(
                        frames[index], schema=SCHEMA, preserve_index=False, nthreads=1
                    )
                    self.publish_raw(stubs, table, ipc_stream(converted))

                return by_hand
            payloads = [ipc_stream(part) for part in slices]  # Built before the clock.
            return lambda index: self.publish_raw(stubs, table, payloads[index])
        publisher = Publisher(self.session, table)
        publisher.schema()  # Fetched once, before the clock, as the raw path knows it too.
        if mode == "pandas":
            frames = [part.to_pandas() for part in slices]  # The user's input, as given.
            return lambda index: publisher.append(frames[index])
        return lambda index: publisher.append(slices[index])

    def publish_raw(self, stubs: list[Any], table: str, payload: bytes) -> None:
        """One raw Publish to the leader; a leader change during the benchmark is followed
        (it should not happen; the retry only keeps a long run from failing)."""
        for _ in range(100):
            try:
                stubs[0].Publish(pb.PublishRequest(table=table, payload=payload), timeout=30)
                return
            except grpc.RpcError as error:
                if error.code() not in _RAW_RETRY_CODES:
                    raise
                print(f"raw publish retried: {error.code()}")
                stubs[0] = self.cluster.stub(self.cluster.leader(timeout_s=180))
        raise RuntimeError("raw publish kept failing")

    def writer(self, batch_rows: int) -> float:
        """MultithreadedTableWriter with its durable buffer: rows/s from the first insert
        to waitForThreadCompletion."""
        table = self.fresh_table()
        slices = [self.table.slice(first, batch_rows) for first in range(0, self.rows, batch_rows)]
        writer = MultithreadedTableWriter(
            self.session,
            table,
            batchSize=batch_rows,
            throttle=0.05,
            durableBufferDir=self.work_dir / f"buffer-{table}",
        )
        started = time.perf_counter()
        for part in slices:
            writer.insertArrow(part)
        writer.waitForThreadCompletion(timeout_s=600)
        elapsed_s = time.perf_counter() - started
        self.check(table, "writer")
        return self.rows / elapsed_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=ROWS_DEFAULT)
    parser.add_argument("--batch-rows", type=int, nargs="+", default=[10_000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--work-dir", type=Path, help="keep the cluster's files and logs here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="client-bench-") as temporary:
        work = str(args.work_dir or temporary)
        # A longer election timeout than the tests': CPU contention must not cause elections.
        cluster = LocalCluster(
            Path(work) / "cluster", purge_interval_s=10.0, election_timeout_s=3.0
        )
        cluster.start()
        try:
            bench = Bench(cluster, args.rows, Path(work))
            bench.paired(SYNC_MODES, args.batch_rows[0], 0)  # Warm-up: channels, caches.
            bench.drop_tables()
            results = {
                batch_rows: measure(bench, args.modes, batch_rows, args.rounds)
                for batch_rows in args.batch_rows
            }
        finally:
            cluster.stop()
    report(results, args)
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2))


def measure(bench: Bench, modes: list[str], batch_rows: int, rounds: int) -> dict[str, Any]:
    """Per mode and round: `total` rows/s (all rows / time inside the calls) and `typical`
    rows/s (batch rows / the median call), robust to the stalls of a shared machine."""
    samples: dict[str, dict[str, list[float]]] = {m: {"total": [], "typical": []} for m in modes}
    sync_modes = [mode for mode in SYNC_MODES if mode in modes]
    for number in range(rounds):
        bench.drop_tables()
        seconds = bench.paired(sync_modes, batch_rows, number) if sync_modes else {}
        for mode, calls in seconds.items():
            samples[mode]["total"].append(bench.rows / sum(calls))
            samples[mode]["typical"].append(batch_rows / statistics.median(calls))
        if "writer" in modes:
            rate = bench.writer(batch_rows)
            samples["writer"]["total"].append(rate)
            samples["writer"]["typical"].append(rate)
        print(
            f"batch_rows={batch_rows} round={number} "
            + " ".join(
                f"{mode}={values['total'][-1]:,.0f}/{values['typical'][-1]:,.0f}"
                for mode, values in samples.items()
            ),
            flush=True,
        )
    return {
        mode: {
            "total_rows_per_s": statistics.median(values["total"]),
            "typical_rows_per_s": statistics.median(values["typical"]),
            "samples": values,
        }
        for mode, values in samples.items()
    }


def report(results: dict[int, dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    print(f"rows={args.rows:,} rounds={args.rounds}; medians over the rounds")
    print("(share of raw / share of the raw call given the same input)")
    titles = {
        "total_rows_per_s": "all rows / time inside the calls",
        "typical_rows_per_s": "batch rows / median call",
    }
    for key, title in titles.items():
        print(f"\nrows/s, {title}:")
        print("| batch rows | " + " | ".join(args.modes) + " |")
        print("|" + "---|" * (len(args.modes) + 1))
        for batch_rows, modes in results.items():
            cells = [_cell(modes, mode, key) for mode in args.modes]
            print(f"| {batch_rows:,} | " + " | ".join(cells) + " |")


def _cell(modes: dict[str, Any], mode: str, key: str) -> str:
    rate = modes[mode][key]
    shares = []
    for reference in ("raw", SAME_INPUT.get(mode)):
        if reference and reference in modes and reference != mode:
            shares.append(f"{rate / modes[reference][key]:.0%}")
    return f"{rate:,.0f}" + (f" ({' / '.join(shares)})" if shares else "")


if __name__ == "__main__":
    main()
