"""What TLS and logins cost: the same publishes into a plaintext cluster and into a cluster
with mutual TLS and `authentication=on`, side by side in one run.

    python -m bench.secure [--batch 1 100 1000 10000] [--repeat 3] [--duration 2]

Starts two local three-node clusters (real node processes, journals fsynced on one disk):
one as `deploy.local` runs it (plaintext, no logins), one with mutual TLS on the client
port (a development CA) and logins on, where a user with only TABLE_WRITE on the table
publishes. Both stay up for the whole run; their cells alternate (the order flips from
repeat to repeat), so each secure/plain ratio is measured under the same background load.
A cell publishes pre-built 11-column Arrow batches through the public client
(`Publisher.append`, one batch waited for at a time, HA group 2) for `--duration` seconds.

Writes bench/results/secure.{md,json} and prints the table: rows/s and ack p50 per cell,
medians over the repeats, and the secure/plain ratio of the medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from api_clients.connection import Session
from api_clients.publisher import Publisher
from bench import common
from deploy.local_cluster import LocalCluster

COLUMNS = 11
ADMIN_PASSWORD = "bench-admin-password"
USER, PASSWORD = "publisher", "bench-publisher-password"


@dataclass
class Cell:
    mode: str  # "plain" | "secure"
    batch_rows: int
    repeat: int
    rows: int
    wall_s: float
    rows_per_s: float
    ack_p50_ms: float


@contextmanager
def _cluster(secure: bool) -> Iterator[tuple[LocalCluster, Session]]:
    root = Path(tempfile.mkdtemp(prefix=f"hastream-bench-{'secure' if secure else 'plain'}-"))
    cluster = LocalCluster(root, purge_interval_s=300.0)
    if secure:
        cluster.enable_tls(client_auth=True)
        cluster.enable_authentication(ADMIN_PASSWORD)
    sites = [node.site for node in cluster.nodes.values()]
    try:
        cluster.start()
        cluster.leader(common.HA_GROUP)
        if not secure:
            yield cluster, Session(sites, deadline_s=60)
            return
        with Session(
            sites, userid="admin", password=ADMIN_PASSWORD, tls=cluster.client_tls
        ) as admin:
            admin.createUser(USER, PASSWORD)
            admin.grant(USER, "TABLE_WRITE", "*")
        yield (
            cluster,
            Session(sites, userid=USER, password=PASSWORD, tls=cluster.client_tls, deadline_s=60),
        )
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _cell(
    cluster: LocalCluster,
    session: Session,
    mode: str,
    batch_rows: int,
    repeat: int,
    duration_s: float,
) -> Cell:
    table = f"secure_bench_{mode}_{batch_rows}_{repeat}"
    schema = common.schema_for(COLUMNS)
    cluster.create_table(table, schema, group=common.HA_GROUP)
    batches = [common.make_table(schema, batch_rows, number * batch_rows) for number in range(8)]
    publisher = Publisher(session, table)
    publisher.append(batches[0])  # warm-up: schema, channel, login
    latencies: list[float] = []
    rows = 0
    started = time.perf_counter()
    deadline = started + duration_s
    number = 0
    while time.perf_counter() < deadline:
        sent = time.perf_counter()
        publisher.append(batches[number % len(batches)])
        latencies.append(time.perf_counter() - sent)
        rows += batch_rows
        number += 1
    wall_s = time.perf_counter() - started
    publisher.close()
    return Cell(
        mode=mode,
        batch_rows=batch_rows,
        repeat=repeat,
        rows=rows,
        wall_s=wall_s,
        rows_per_s=rows / wall_s,
        ack_p50_ms=common.percentile(latencies, 0.5) * 1000,
    )


def _markdown(cells: list[Cell], meta: dict[str, object]) -> str:
    lines = [
        "# TLS + logins vs plaintext (bench/secure.py)",
        "",
        f"`{meta['command']}`, {meta['started']}, {meta['elapsed_s']:.0f} s; medians of "
        f"{meta['repeats']} interleaved repeats; 11 columns, one batch waited for at a time.",
        "",
        "| batch rows | plain rows/s | secure rows/s | ratio | plain p50 ms | secure p50 ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in sorted({cell.batch_rows for cell in cells}):

        def median(mode: str, field: str, batch: int = batch) -> float:
            values = [
                getattr(cell, field)
                for cell in cells
                if cell.mode == mode and cell.batch_rows == batch
            ]
            return common.median(values)

        plain, secure = median("plain", "rows_per_s"), median("secure", "rows_per_s")
        lines.append(
            f"| {batch:,} | {plain:,.0f} | {secure:,.0f} | {secure / plain:.2f} | "
            f"{median('plain', 'ack_p50_ms'):.2f} | {median('secure', 'ack_p50_ms'):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 100, 1000, 10_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per cell")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    started = time.time()
    cells: list[Cell] = []
    with ExitStack() as stack:
        clusters = {
            "plain": stack.enter_context(_cluster(secure=False)),
            "secure": stack.enter_context(_cluster(secure=True)),
        }
        for repeat in range(args.repeat):
            for batch in args.batch:
                order = ["plain", "secure"] if (repeat + batch) % 2 == 0 else ["secure", "plain"]
                for mode in order:
                    cluster, session = clusters[mode]
                    cell = _cell(cluster, session, mode, batch, repeat, args.duration)
                    print(
                        f"{mode:6} batch={batch:>6} repeat={repeat}: {cell.rows_per_s:,.0f} "
                        f"rows/s, ack p50 {cell.ack_p50_ms:.2f} ms",
                        flush=True,
                    )
                    cells.append(cell)
        for _, session in clusters.values():
            session.close()
    meta: dict[str, object] = {
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "elapsed_s": time.time() - started,
        "command": "python -m bench.secure " + " ".join(sys.argv[1:] if argv is None else argv),
        "repeats": args.repeat,
        "machine": common.machine(),
    }
    text = _markdown(cells, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "secure.md").write_text(text)
    (args.out / "secure.json").write_text(
        json.dumps({"meta": meta, "cells": [asdict(cell) for cell in cells]}, indent=1)
    )
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
