"""A/B of a client-side change: one cluster, the publishing client of two checkouts in turns.

    python -m bench.client_ab --a <checkout> --b <checkout> --shape wait:1 [--rounds 8]
        [--seconds 3] [--client threaded|asyncio]

bench.checkouts_ab compares two checkouts' nodes under this checkout's client; this compares
two checkouts' clients (api_clients) on one local three-node cluster of this checkout's
nodes. Each round publishes one cell into a fresh table from a child process running the
other checkout's code (`PYTHONPATH=<checkout>`), A and B in turns (the order alternates), so
drifting load hits both alike. A cell is bench.checkouts_ab's shape: `wait:N` is
`Publisher.append` of N rows waited for, `async:N` is `append_async` with 64 in flight; one
row is a row tuple, N rows a pyarrow Table of bench.vs_nats's 11 columns, built inside the
loop. The child uses only what every checkout has (`Session`, `Publisher`,
bench.publish_rows), so an older checkout can be either arm. With `--client asyncio` the
child appends with `api_clients.aio.AioSession.append` instead, waited for (`wait:N` only:
the asyncio client has no pipelining).

Prints each round and the medians of rows/s, the client process's CPU per append (all its
threads: building the rows, the call, the client's own threads) and, for `wait:N`, the p50
of the append call; then the ratio B/A of the medians and the median of the rounds' own
ratios (each pair ran back to back).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench import common
from bench.checkouts_ab import Shape
from bench.publish_rows import SCHEMA

# The child: one cell with the checkout's client, its figures as one JSON line.
_ARGUMENTS: Final = """
import json, sys, time
from bench.publish_rows import RowPool, hastream_builder
sites, table = sys.argv[1].split(","), sys.argv[2]
wait, rows, seconds = sys.argv[3] == "wait", int(sys.argv[4]), float(sys.argv[5])
"""
_THREADED: Final = """
from api_clients import Publisher, Session
session = Session(sites)
publisher = Publisher(session, table) if wait else Publisher(session, table, max_in_flight=64)
build = hastream_builder(RowPool.make(), rows)
publisher.append(build(0))
futures, latencies, appends = [], [], 0
cpu_started, started = time.process_time(), time.perf_counter()
while time.perf_counter() - started < seconds:
    data = build(appends)
    if wait:
        sent = time.perf_counter()
        publisher.append(data)
        latencies.append(time.perf_counter() - sent)
    else:
        futures.append(publisher.append_async(data))
    appends += 1
for future in futures:
    future.result()
wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
session.close()
"""
_ASYNCIO: Final = """
import asyncio
from api_clients import aio

async def cell():
    session = aio.AioSession(sites)
    build = hastream_builder(RowPool.make(), rows)
    await session.append(table, build(0))
    latencies, appends = [], 0
    cpu_started, started = time.process_time(), time.perf_counter()
    while time.perf_counter() - started < seconds:
        data = build(appends)
        sent = time.perf_counter()
        await session.append(table, data)
        latencies.append(time.perf_counter() - sent)
        appends += 1
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    await session.close()
    return latencies, appends, wall_s, cpu_s

latencies, appends, wall_s, cpu_s = asyncio.run(cell())
"""
_FIGURES: Final = """
latencies.sort()
print(json.dumps({
    "rows_per_s": appends * rows / wall_s,
    "cpu_us_per_append": cpu_s / appends * 1e6,
    "p50_ms": latencies[len(latencies) // 2] * 1e3 if latencies else None,
}))
"""
CLIENTS: Final = {
    "threaded": _ARGUMENTS + _THREADED + _FIGURES,
    "asyncio": _ARGUMENTS + _ASYNCIO + _FIGURES,
}


@dataclass(frozen=True)
class Cell:
    rows_per_s: float
    cpu_us_per_append: float
    p50_ms: float | None


def run_cell(
    checkout: Path,
    sites: list[str],
    table: str,
    shape: Shape,
    seconds: float,
    client: str = "threaded",
) -> Cell:
    """One cell published by `checkout`'s `client` (a key of CLIENTS) in a child process."""
    argv = [",".join(sites), table, "wait" if shape.wait else "async", str(shape.rows)]
    done = subprocess.run(
        [sys.executable, "-c", CLIENTS[client], *argv, str(seconds)],
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(checkout)},
        capture_output=True,
        text=True,
        timeout=seconds + 120,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the client of {checkout} failed:\n{done.stderr[-3000:]}")
    return Cell(**json.loads(lines[-1]))


def summary(a: list[Cell], b: list[Cell]) -> list[str]:
    """The medians of each arm, their ratio B/A, and the median of the rounds' ratios."""
    lines = []
    for name in ("rows_per_s", "cpu_us_per_append", "p50_ms"):
        values_a = [getattr(cell, name) for cell in a if getattr(cell, name) is not None]
        values_b = [getattr(cell, name) for cell in b if getattr(cell, name) is not None]
        if not values_a or not values_b:
            continue
        median_a, median_b = statistics.median(values_a), statistics.median(values_b)
        paired = statistics.median(y / x for x, y in zip(values_a, values_b, strict=False) if x)
        lines.append(
            f"{name}: A {median_a:,.2f}, B {median_b:,.2f}, B/A x{median_b / median_a:.3f} "
            f"(round by round x{paired:.3f})"
        )
    return lines


def _checkout(text: str) -> Path:
    path = Path(text).resolve()
    if not (path / "api_clients" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text}: not a checkout (no api_clients/)")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.client_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--a", type=_checkout, required=True)
    parser.add_argument("--b", type=_checkout, required=True)
    parser.add_argument("--shape", type=Shape.parse, default=Shape(wait=True, rows=1))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--client", choices=sorted(CLIENTS), default="threaded")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        parser.error("--rounds >= 1 and --seconds > 0")
    if args.client == "asyncio" and not args.shape.wait:
        parser.error("the asyncio client has no pipelining: --shape wait:N")
    cells: dict[str, list[Cell]] = {"A": [], "B": []}
    with common.bench_cluster(purge_interval_s=60, election_timeout_s=1.5) as cluster:
        sites = [node.site for node in cluster.nodes.values()]
        for number in range(args.rounds):
            for arm in ("A", "B") if number % 2 == 0 else ("B", "A"):
                table = f"client_ab_{number}_{arm}"
                cluster.create_table(table, SCHEMA, group=common.HA_GROUP)
                checkout = args.a if arm == "A" else args.b
                cell = run_cell(checkout, sites, table, args.shape, args.seconds, args.client)
                cells[arm].append(cell)
                p50 = "" if cell.p50_ms is None else f", p50 {cell.p50_ms:.2f} ms"
                print(
                    f"round {number} {arm}: {cell.rows_per_s:,.0f} rows/s, client CPU "
                    f"{cell.cpu_us_per_append:,.0f} us per append{p50}",
                    flush=True,
                )
    for line in summary(cells["A"], cells["B"]):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
