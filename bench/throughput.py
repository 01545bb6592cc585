"""HA vs non-HA write throughput, DolphinDB's grid, side by side in one run.

    python -m bench.throughput [--quick] [--repeat N] [--out bench/results]

Starts a local three-node cluster (deploy/local_cluster.py: real node processes, real
gRPC, journals fsynced on one disk). For every cell of the grid threads x batch rows x
columns it creates a fresh HA table (Raft group 2, on the leader) and a fresh non-HA table
(node-local group 0, on the same leader node: DolphinDB also wrote both tables on one
server and one disk), publishes to each for a bounded time and row count, then drops them.
The two modes of a cell run back to back, in alternating order from cell to cell, so each
HA/non-HA ratio is measured under the same background load.

Publishing sends PublishRequests built before the clock starts (Arrow IPC payloads: no
per-row Python), one blocking call per batch, one connection per thread: over the node's
publish port (`--transport port`, the default: api_clients/publish_port.py's framed
exchange, what a Publisher's waited append uses) or raw gRPC stubs (`--transport grpc`,
`StreamTable.Publish`, one channel, one HTTP/2 connection, per thread). The time of each
call is the acknowledgement latency (committed on a fsynced majority and applied on the
leader).

Pipelined cells (`--pipeline N`, window N per thread; in the quick grid N = 64 for batches
<= 1,000) publish the same pre-built payloads through the client's `PublishPipeline`
(api_clients/pipeline.py: one PublishStream per thread, its own Session and channel, up to
N requests in flight). Their latency is per request, from submit (which waits while the
window is full, so it is about when the request is sent) to its acknowledgement.

Measured per cell and mode: rows/s, MB/s of Arrow payload, p50/p99 ack latency, CPU of each
node process and of this client process (utime+stime delta from /proc/<pid>/stat, in
cores), peak RSS of each node (VmHWM), Raft entries per second and publishes per entry
(group commit), and the load average (other work on the machine).

Writes bench/results/throughput.{md,json,png} and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import grpc

from api_clients.connection import Session
from api_clients.pipeline import PublishPipeline
from api_clients.publish_port import PublishPorts
from bench import common
from bench.dolphindb import DOLPHINDB
from deploy.local_cluster import LocalCluster, wait_until
from hastream.errors import RaftStoreError
from proto import hastream_pb2 as pb
from proto import hastream_pb2_grpc

log = logging.getLogger("bench.throughput")

MODES: Final = ("ha", "local")
MODE_LABEL: Final = {"ha": "HA", "local": "non-HA"}
# "pipeline": windows per thread, 0 = unary Publish; pipelined cells only for batches up to
# "pipeline_batch_max" rows.
FULL_GRID: Final = {
    "threads": (1, 4),
    "batch": (1, 100, 1_000, 10_000),
    "columns": (11, 211),
    "pipeline": (0,),
    "pipeline_batch_max": (10_000,),
}
QUICK_GRID: Final = {
    "threads": (1, 4),
    "batch": (1, 1_000, 10_000),
    "columns": (11,),
    "pipeline": (0, 64),
    "pipeline_batch_max": (1_000,),
}
ROWS_MAX: Final = 50_000_000
ERRORS_MAX: Final = 20
RETRIES: Final = 1  # a cell with errors or an election is run once more
PAYLOAD_POOL_BYTES: Final = 64 << 20

# The targets.
TARGET_1T_10K_ROWS_S: Final = 1_000_000
TARGET_RATIO_BATCH_1000: Final = 0.90
TARGET_4T_BATCH1_ROWS_S: Final = 4_000


@dataclass
class CellResult:
    mode: str
    threads: int
    batch_rows: int
    columns: int
    repeat: int
    leader: str
    pipeline: int = 0  # requests in flight per thread (PublishStream); 0: unary Publish
    rows: int = 0
    requests: int = 0
    errors: int = 0
    error_codes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    rows_per_s: float = 0.0
    payload_mb_per_s: float = 0.0
    latency_p50_ms: float = math.nan
    latency_p99_ms: float = math.nan
    latency_max_ms: float = math.nan
    cpu_cores: dict[str, float] = field(default_factory=dict)
    rss_peak_mib: dict[str, float] = field(default_factory=dict)
    rss_now_mib: dict[str, float] = field(default_factory=dict)
    entries_per_s: float = 0.0
    publishes_per_entry: float = 0.0
    journal_syncs_per_s: float = 0.0
    load_before: float = 0.0
    load_after: float = 0.0
    term_changed: bool = False  # a Raft election happened during the cell
    node_cpu_ms_per_10k_rows: float = math.nan  # CPU of the three node processes, summed


@dataclass(frozen=True)
class Settings:
    duration_s: float
    cell_bytes_max: int
    repeats: int
    grid: dict[str, tuple[int, ...]]
    purge_interval_s: float
    election_timeout_s: float
    transport: str = "port"  # unary cells: "port" (the publish port) or "grpc"


# --- one cell -------------------------------------------------------------------------------


def _channel(cluster: LocalCluster, alias: str) -> grpc.Channel:
    # A channel of its own per thread: its own HTTP/2 connection, like separate clients.
    return grpc.insecure_channel(
        f"127.0.0.1:{cluster.nodes[alias].port}",
        options=[
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )


def _group_counters(cluster: LocalCluster, alias: str, group: int) -> tuple[int, int, int]:
    """(entries proposed, journal fdatasyncs) of `group` on `alias`, and the HA term."""
    status = cluster.group_status(alias, group)
    term = int(cluster.group_status(alias, common.HA_GROUP)["term"])
    entries = int(status["entries_proposed"])
    return entries, int(status["journal_syncs"]), term


def _quiesce(cluster: LocalCluster, timeout_s: float = 60) -> None:
    """Wait until every node has applied everything committed (followers catch up before
    the next cell starts, so one cell's backlog is not charged to the next)."""

    def settled() -> bool:
        applied = {alias: cluster.group_status(alias, common.HA_GROUP) for alias in cluster.alive()}
        commits = {status["commit_index"] for status in applied.values()}
        return len(commits) == 1 and all(
            status["last_applied"] >= status["commit_index"] for status in applied.values()
        )

    try:
        wait_until(settled, timeout_s=timeout_s, interval_s=0.1, message="replicas settled")
    except AssertionError as error:
        print(f"  warning: {error}", flush=True)


class NodeExited(RuntimeError):
    pass


def _check_nodes_alive(cluster: LocalCluster) -> None:
    """A node that died under load is a finding, not noise: stop and show its log."""
    dead = [alias for alias in cluster.nodes if alias not in cluster.alive()]
    if not dead:
        return
    details = []
    for alias in dead:
        process = cluster.nodes[alias].process
        code = None if process is None else process.poll()
        details.append(f"{alias} exited with {code}; log tail:\n{cluster.log_tail(alias, 60)}")
    raise NodeExited("node(s) died during the benchmark:\n" + "\n".join(details))


Publish = Callable[[pb.PublishRequest], pb.PublishResponse]


def _port_publish(cluster: LocalCluster, alias: str) -> tuple[Publish, PublishPorts]:
    """A blocking publish over `alias`'s publish port, on a connection of its own."""
    site = f"127.0.0.1:{cluster.nodes[alias].port}"
    ports = PublishPorts()
    ports.learn(site, int(cluster.status(alias)["publish_port"]["port"]))
    return functools.partial(_publish_over, ports, site), ports


def _publish_over(ports: PublishPorts, site: str, request: pb.PublishRequest) -> pb.PublishResponse:
    return ports.publish(site, request, "", 60.0)


class _Worker(threading.Thread):
    def __init__(
        self,
        publish: Publish,
        requests: list[pb.PublishRequest],
        requests_max: int,
        start: threading.Barrier,
        deadline: list[float],
    ) -> None:
        super().__init__(daemon=True)
        self.publish = publish
        self.requests = requests
        self.requests_max = requests_max
        self.start_barrier = start
        self.deadline = deadline
        self.latencies: list[float] = []
        self.rows = 0
        self.errors: list[str] = []
        self.finished_at = 0.0

    def run(self) -> None:
        publish = self.publish
        requests = self.requests
        pool = len(requests)
        latencies = self.latencies
        clock = time.perf_counter
        try:
            for request in requests[:2]:  # warm-up: connection, table, caches
                publish(request)
        except (grpc.RpcError, RaftStoreError) as error:
            self.errors.append(f"warm-up: {_error_name(error)}")
        self.start_barrier.wait()  # everyone warmed up: the main thread samples counters
        self.start_barrier.wait()  # the clock starts
        deadline = self.deadline[0]
        number = 0
        while number < self.requests_max:
            request = requests[number % pool]
            started = clock()
            try:
                reply = publish(request)
            except (grpc.RpcError, RaftStoreError) as error:
                self.errors.append(_error_name(error))
                if len(self.errors) >= ERRORS_MAX:
                    break
                continue
            finished = clock()
            latencies.append(finished - started)
            self.rows += reply.row_count
            number += 1
            if finished >= deadline:
                break
        self.finished_at = clock()


def _error_name(error: grpc.RpcError | RaftStoreError) -> str:
    return str(error.code()) if isinstance(error, grpc.RpcError) else type(error).__name__


class _PipelinedWorker(threading.Thread):
    """`_Worker`'s pipelined twin: the same pre-built payloads through the client's
    PublishPipeline, `window` requests in flight, over a Session and channel of its own."""

    def __init__(
        self,
        site: str,
        table: str,
        payloads: list[bytes],
        batch_rows: int,
        window: int,
        requests_max: int,
        start: threading.Barrier,
        deadline: list[float],
    ) -> None:
        super().__init__(daemon=True)
        self.session = Session(
            [site], channel_options=[("grpc.use_local_subchannel_pool", 1)], deadline_s=60
        )
        self.pipeline = PublishPipeline(self.session, table, max_in_flight=window)
        self.payloads = payloads
        self.batch_rows = batch_rows
        self.requests_max = requests_max
        self.start_barrier = start
        self.deadline = deadline
        self.latencies: list[float] = []
        self.rows = 0
        self.errors: list[str] = []
        self.finished_at = 0.0

    def _done(self, submitted: float, future: Future[Any]) -> None:
        # Runs on the pipeline's driver thread, one at a time.
        error = future.exception()
        if error is not None:
            self.errors.append(type(error).__name__)
            return
        self.latencies.append(time.perf_counter() - submitted)
        self.rows += future.result().row_count

    def run(self) -> None:
        payloads = self.payloads
        pool = len(payloads)
        clock = time.perf_counter
        try:
            for payload in payloads[:2]:  # warm-up: stream, producer known, caches
                self.pipeline.submit(payload, self.batch_rows).result(timeout=60)
        except Exception as error:
            self.errors.append(f"warm-up: {type(error).__name__}")
        self.latencies.clear()
        self.rows = 0
        self.start_barrier.wait()  # everyone warmed up: the main thread samples counters
        self.start_barrier.wait()  # the clock starts
        deadline = self.deadline[0]
        for number in range(self.requests_max):
            submitted = clock()
            future = self.pipeline.submit(payloads[number % pool], self.batch_rows)
            future.add_done_callback(functools.partial(self._done, submitted))
            if submitted >= deadline or len(self.errors) >= ERRORS_MAX:
                break
        self.pipeline.flush(timeout_s=60)
        self.finished_at = clock()
        self.pipeline.close(timeout_s=5)
        self.session.close()


def run_cell(
    cluster: LocalCluster,
    mode: str,
    threads: int,
    batch_rows: int,
    columns: int,
    repeat: int,
    settings: Settings,
    pool: list[bytes],
    pipeline: int = 0,
) -> CellResult:
    leader = cluster.leader(common.HA_GROUP)
    group = common.HA_GROUP if mode == "ha" else common.LOCAL_GROUP
    table = f"bench_{mode}_c{columns}_b{batch_rows}_t{threads}_p{pipeline}_r{repeat}"
    schema = common.schema_for(columns)
    leader = common.create_table(cluster, leader, table, schema, group=group)
    result = CellResult(mode, threads, batch_rows, columns, repeat, leader, pipeline)
    row_bytes = len(pool[0]) / batch_rows
    rows_max = min(ROWS_MAX, max(batch_rows * threads, int(settings.cell_bytes_max / row_bytes)))
    requests_max = max(1, math.ceil(rows_max / batch_rows / threads))
    over_port = settings.transport == "port" and not pipeline
    channels = [] if pipeline or over_port else [_channel(cluster, leader) for _ in range(threads)]
    ports: list[PublishPorts] = []
    site = f"127.0.0.1:{cluster.nodes[leader].port}"
    try:
        barrier = threading.Barrier(threads + 1)
        deadline = [math.inf]
        workers: list[_Worker | _PipelinedWorker] = []
        for number in range(threads):
            # Each thread starts at its own place in the pool of distinct payloads.
            shifted = pool[number % len(pool) :] + pool[: number % len(pool)]
            if pipeline:
                workers.append(
                    _PipelinedWorker(
                        site,
                        table,
                        shifted,
                        batch_rows,
                        pipeline,
                        requests_max,
                        barrier,
                        deadline,
                    )
                )
                continue
            requests = [pb.PublishRequest(table=table, payload=payload) for payload in shifted]
            if over_port:
                publish, port = _port_publish(cluster, leader)
                ports.append(port)
            else:
                publish = hastream_pb2_grpc.StreamTableStub(channels[number]).Publish
                publish = functools.partial(publish, timeout=60)
            workers.append(_Worker(publish, requests, requests_max, barrier, deadline))
        for worker in workers:
            worker.start()
        pids = common.node_pids(cluster)
        barrier.wait()  # the workers have warmed up
        entries_before, syncs_before, term_before = _group_counters(cluster, leader, group)
        result.load_before = common.load_average()
        cpu_before = common.CpuSample.take(pids)
        started = time.perf_counter()
        deadline[0] = started + settings.duration_s
        barrier.wait()
        for worker in workers:
            worker.join()
        wall_s = max(worker.finished_at for worker in workers) - started
        cpu_after = common.CpuSample.take(pids)
        result.load_after = common.load_average()
        entries_after, syncs_after, term_after = _group_counters(cluster, leader, group)
    finally:
        for port in ports:
            port.close()
        for channel in channels:
            channel.close()
    latencies = [value for worker in workers for value in worker.latencies]
    result.rows = sum(worker.rows for worker in workers)
    result.requests = len(latencies)
    result.error_codes = sorted({code for worker in workers for code in worker.errors})
    result.errors = sum(len(worker.errors) for worker in workers)
    result.wall_s = wall_s
    result.term_changed = term_after != term_before
    result.rows_per_s = result.rows / wall_s
    result.payload_mb_per_s = result.requests * len(pool[0]) / wall_s / 1e6
    result.latency_p50_ms = common.percentile(latencies, 0.50) * 1000
    result.latency_p99_ms = common.percentile(latencies, 0.99) * 1000
    result.latency_max_ms = max(latencies, default=math.nan) * 1000
    result.cpu_cores = cpu_after.cores_since(cpu_before, wall_s)
    node_cores = sum(cores for alias, cores in result.cpu_cores.items() if alias != "client")
    result.node_cpu_ms_per_10k_rows = node_cores * wall_s * 1000 / max(result.rows, 1) * 10_000
    entries = max(1, entries_after - entries_before)
    result.entries_per_s = entries / wall_s
    result.publishes_per_entry = result.requests / entries
    result.journal_syncs_per_s = (syncs_after - syncs_before) / wall_s
    _check_nodes_alive(cluster)
    for alias, pid in pids.items():
        memory = common.memory_kib(pid)
        result.rss_peak_mib[alias] = memory.get("VmHWM", 0) / 1024
        result.rss_now_mib[alias] = memory.get("VmRSS", 0) / 1024
    common.drop_table(cluster, leader, table, group=group)
    _quiesce(cluster)
    return result


# --- the grid -------------------------------------------------------------------------------


def grid_cells(grid: dict[str, tuple[int, ...]]) -> list[tuple[int, int, int, int]]:
    """(columns, threads, batch, pipeline window) in DolphinDB's table order, each cell's
    pipelined variants right after its unary one."""
    batch_max = grid.get("pipeline_batch_max", (math.inf,))[0]
    return [
        (columns, threads, batch, window)
        for columns, threads, batch in itertools.product(
            grid["columns"], grid["threads"], grid["batch"]
        )
        for window in grid.get("pipeline", (0,))
        if window == 0 or batch <= batch_max
    ]


def run_grid(cluster: LocalCluster, settings: Settings) -> list[CellResult]:
    results: list[CellResult] = []
    cells = grid_cells(settings.grid)
    pools: dict[tuple[int, int], list[bytes]] = {}
    for columns, _, batch_rows, _ in cells:
        if (columns, batch_rows) not in pools:
            schema = common.schema_for(columns)
            one = common.payloads(schema, batch_rows, 1)
            count = max(1, min(16, PAYLOAD_POOL_BYTES // len(one[0])))
            pools[columns, batch_rows] = one + common.payloads(
                schema, batch_rows, count - 1, first_id=batch_rows
            )
    order = 0
    for repeat in range(settings.repeats):
        for columns, threads, batch_rows, window in cells:
            modes = MODES if order % 2 == 0 else MODES[::-1]
            order += 1
            for mode in modes:
                for attempt in range(1 + RETRIES):
                    result = run_cell(
                        cluster,
                        mode,
                        threads,
                        batch_rows,
                        columns,
                        repeat,
                        settings,
                        pools[columns, batch_rows],
                        window,
                    )
                    print(_progress_line(result), flush=True)
                    if not (result.errors or result.term_changed):
                        break
                    if attempt < RETRIES:
                        print("  (errors or an election during the cell: run it again)")
                results.append(result)
    return results


def _progress_line(result: CellResult) -> str:
    cpu = " ".join(f"{alias}={cores:.2f}" for alias, cores in result.cpu_cores.items())
    errors = f" errors={result.errors}{result.error_codes}" if result.errors else ""
    if result.term_changed:
        errors += " ELECTION during the cell"
    return (
        f"[r{result.repeat}] {MODE_LABEL[result.mode]:>6} threads={result.threads} "
        f"batch={result.batch_rows:>5} cols={result.columns:>3} "
        f"{_window(result.pipeline):>9}: "
        f"{result.rows_per_s:>12,.0f} rows/s  p50={result.latency_p50_ms:.1f}ms "
        f"p99={result.latency_p99_ms:.1f}ms  pub/entry={result.publishes_per_entry:.1f} "
        f"cpu[{cpu}] load={result.load_before:.1f}{errors}"
    )


# --- summary --------------------------------------------------------------------------------


@dataclass
class Summary:
    """Medians over the repeats of one cell."""

    columns: int
    threads: int
    batch_rows: int
    ha: dict[str, Any]
    local: dict[str, Any]
    ratio: float
    ratio_min: float
    ratio_max: float
    repeats: int
    pipeline: int = 0  # requests in flight per thread; 0: unary


def _window(pipeline: int) -> str:
    return f"pipe {pipeline}" if pipeline else "unary"


def _median_of(results: list[CellResult], name: str) -> float:
    return common.median([float(getattr(result, name)) for result in results])


def _median_cores(results: list[CellResult]) -> dict[str, float]:
    """Median cores by role: the leader ("leader"), the busier and the idler follower
    ("follower1", "follower2"), the client. By role, not alias: leadership may move."""
    by_role: dict[str, list[float]] = {}
    for result in results:
        followers = sorted(
            (
                cores
                for alias, cores in result.cpu_cores.items()
                if alias not in ("client", result.leader)
            ),
            reverse=True,
        )
        roles = {
            "leader": result.cpu_cores.get(result.leader, math.nan),
            "client": result.cpu_cores["client"],
        }
        roles.update({f"follower{number}": cores for number, cores in enumerate(followers, 1)})
        for role, cores in roles.items():
            by_role.setdefault(role, []).append(cores)
    return {role: common.median(values) for role, values in by_role.items()}


def _mode_summary(results: list[CellResult]) -> dict[str, Any]:
    rates = [result.rows_per_s for result in results]
    return {
        "rows_per_s": common.median(rates),
        "rows_per_s_min": min(rates),
        "rows_per_s_max": max(rates),
        "latency_p50_ms": _median_of(results, "latency_p50_ms"),
        "latency_p99_ms": _median_of(results, "latency_p99_ms"),
        "payload_mb_per_s": _median_of(results, "payload_mb_per_s"),
        "publishes_per_entry": _median_of(results, "publishes_per_entry"),
        "node_cpu_ms_per_10k_rows": _median_of(results, "node_cpu_ms_per_10k_rows"),
        "cpu_cores": _median_cores(results),
        "errors": sum(result.errors for result in results),
        "elections": sum(result.term_changed for result in results),
        "leaders": sorted({result.leader for result in results}),
    }


def summarize(results: list[CellResult]) -> list[Summary]:
    summaries = []
    keys = sorted({(r.columns, r.threads, r.batch_rows, r.pipeline) for r in results})
    for columns, threads, batch_rows, pipeline in keys:
        cell = [
            r
            for r in results
            if (r.columns, r.threads, r.batch_rows, r.pipeline)
            == (columns, threads, batch_rows, pipeline)
        ]
        by_mode = {mode: [r for r in cell if r.mode == mode] for mode in MODES}
        ratios = []
        for repeat in sorted({r.repeat for r in cell}):
            pair = {r.mode: r for r in cell if r.repeat == repeat}
            if set(pair) == set(MODES) and pair["local"].rows_per_s > 0:
                ratios.append(pair["ha"].rows_per_s / pair["local"].rows_per_s)
        summaries.append(
            Summary(
                columns,
                threads,
                batch_rows,
                _mode_summary(by_mode["ha"]),
                _mode_summary(by_mode["local"]),
                common.median(ratios),
                min(ratios, default=math.nan),
                max(ratios, default=math.nan),
                len(ratios),
                pipeline,
            )
        )
    return summaries


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def _cores(cores: dict[str, float], ha: bool) -> str:
    parts = [f"L {cores['leader']:.2f}"]
    if ha:
        followers = [cores[role] for role in ("follower1", "follower2") if role in cores]
        parts.append("F " + "/".join(f"{value:.2f}" for value in followers))
    parts.append(f"C {cores['client']:.2f}")
    return ", ".join(parts)


def markdown(
    summaries: list[Summary], results: list[CellResult], settings: Settings, meta: dict[str, Any]
) -> str:
    lines = [
        "# HA vs non-HA write throughput",
        "",
        f"Run {meta['started']} ({meta['elapsed_s']:.0f} s): `{meta['command']}`. "
        f"Machine: {meta['machine']['cpus']} cores ({meta['machine']['cpu_model']}), "
        f"{meta['machine']['memory_gib']} GiB, Python {meta['machine']['python']}, pyarrow "
        f"{meta['machine']['pyarrow']}; code {meta['machine'].get('code', '?')}; three nodes "
        "and this client on one machine, one disk; unary cells over "
        f"{'the publish port' if settings.transport == 'port' else 'gRPC'}. "
        f"{settings.repeats} repeat(s) of the grid; each cell runs up to "
        f"{settings.duration_s:g} s or {settings.cell_bytes_max / 1e6:,.0f} MB of payload per "
        f"mode. Figures are medians over the repeats; the ratio is the median of the "
        f"per-repeat HA/non-HA ratios, each measured back to back. "
        f"Load average during the run: {meta['load_min']:.1f} to {meta['load_max']:.1f} "
        f"(2 cores; other engineers' tests share the machine)."
        + (
            f" **What-if run: the nodes ran with HASTREAM_TUNING `{meta['tuning']}`** (knobs "
            "off the product's defaults)."
            if meta.get("tuning")
            else ""
        ),
        "",
        "| cols | threads | batch | publish | HA rows/s | non-HA rows/s | HA/non-HA "
        "| HA ack p50 / p99 ms | non-HA ack p50 / p99 ms | HA pub/entry | HA CPU cores "
        "| non-HA CPU cores | node CPU ms per 10k rows HA / non-HA "
        "| DolphinDB HA rows/s (HA/normal) |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for summary in summaries:
        ha, local = summary.ha, summary.local
        spread = ""
        if summary.repeats > 1:
            spread = f" ({summary.ratio_min:.0%}-{summary.ratio_max:.0%})"
        reference = DOLPHINDB.get((summary.columns, summary.threads, summary.batch_rows))
        dolphin = (
            ""
            if reference is None or summary.pipeline
            else f"{_rate(reference.ha_rows_per_s)} ({reference.ratio_percent:.0f}%)"
        )
        errors = ""
        if ha["errors"] or local["errors"]:
            errors = f" [errors HA {ha['errors']}, non-HA {local['errors']}]"
        if ha["elections"] or local["elections"]:
            errors += f" [election in {ha['elections'] + local['elections']} run(s)]"
        lines.append(
            f"| {summary.columns} | {summary.threads} | {summary.batch_rows:,} "
            f"| {_window(summary.pipeline)} "
            f"| {_rate(ha['rows_per_s'])} | {_rate(local['rows_per_s'])} "
            f"| {summary.ratio:.0%}{spread}{errors} "
            f"| {ha['latency_p50_ms']:.1f} / {ha['latency_p99_ms']:.1f} "
            f"| {local['latency_p50_ms']:.1f} / {local['latency_p99_ms']:.1f} "
            f"| {ha['publishes_per_entry']:.1f} "
            f"| {_cores(ha['cpu_cores'], True)} "
            f"| {_cores(local['cpu_cores'], False)} "
            f"| {_rate(ha['node_cpu_ms_per_10k_rows'])} / "
            f"{_rate(local['node_cpu_ms_per_10k_rows'])} | {dolphin} |"
        )
    lines += [
        "",
        "CPU cores: average over the cell of utime+stime of the leader node process (L), the "
        "two followers (F) and the benchmark client (C); 2.00 is the whole machine. "
        "pub/entry: publishes packed into one Raft entry by group commit. Node CPU per 10k "
        "rows: utime+stime of the three node processes per 10,000 rows written (the cost of "
        "a row, which depends less than rows/s on what else runs on the machine). "
        "publish: `unary` = one blocking Publish per thread; `pipe N` = PublishStream with up "
        "to N requests in flight per thread (api_clients.PublishPipeline); its ack latency is "
        "per request, from submit to acknowledgement.",
        "",
    ]
    if settings.repeats > 1:
        lines += ["HA rows/s across repeats (min-max), to show the noise:", ""]
        lines += [
            "| cols | threads | batch | publish | HA min | HA max | non-HA min | non-HA max |"
        ]
        lines += ["|---:|---:|---:|---|---:|---:|---:|---:|"]
        for summary in summaries:
            ha, local = summary.ha, summary.local
            lines.append(
                f"| {summary.columns} | {summary.threads} | {summary.batch_rows:,} "
                f"| {_window(summary.pipeline)} "
                f"| {_rate(ha['rows_per_s_min'])} | {_rate(ha['rows_per_s_max'])} "
                f"| {_rate(local['rows_per_s_min'])} | {_rate(local['rows_per_s_max'])} |"
            )
        lines.append("")
    lines += _memory_lines(results)
    lines += _target_lines(summaries)
    return "\n".join(lines) + "\n"


def _memory_lines(results: list[CellResult]) -> list[str]:
    peak: dict[str, float] = {}
    for result in results:
        for alias, mib in result.rss_peak_mib.items():
            peak[alias] = max(peak.get(alias, 0.0), mib)
    last = results[-1].rss_now_mib if results else {}
    cells = " ".join(
        f"{alias}: peak {peak[alias]:,.0f} MiB, at end {last.get(alias, math.nan):,.0f} MiB;"
        for alias in sorted(peak)
    )
    return [f"Node memory (VmHWM = peak RSS since the node started): {cells}", ""]


def _target_lines(summaries: list[Summary]) -> list[str]:
    pipelined = [s for s in summaries if s.pipeline]
    summaries = [s for s in summaries if not s.pipeline]
    by_key = {(s.columns, s.threads, s.batch_rows): s for s in summaries}
    lines = ["## Targets (from the issue)", ""]
    one = by_key.get((11, 1, 10_000))
    if one is not None:
        value = one.ha["rows_per_s"]
        met = "met" if value >= TARGET_1T_10K_ROWS_S else "NOT met"
        lines.append(
            f"- 1 thread, batch 10,000, 11 columns, HA >= 1,000,000 rows/s: "
            f"{value:,.0f} rows/s, **{met}**"
        )
    big = [s for s in summaries if s.batch_rows >= 1_000]
    if big:
        worst = min(big, key=lambda s: s.ratio)
        met = "met" if worst.ratio >= TARGET_RATIO_BATCH_1000 else "NOT met"
        ratios = ", ".join(f"{s.columns}c/{s.threads}t/{s.batch_rows}: {s.ratio:.0%}" for s in big)
        lines.append(f"- HA/non-HA >= 90% at batch >= 1000: {ratios}; **{met}**")
    four = by_key.get((11, 4, 1))
    four_pipelined = [s for s in pipelined if (s.columns, s.threads, s.batch_rows) == (11, 4, 1)]
    if four_pipelined:
        # Group commit needs several publishes in flight: judged on the pipelined cell.
        best = max(four_pipelined, key=lambda s: s.pipeline)
        value = best.ha["rows_per_s"]
        met = "met" if value >= TARGET_4T_BATCH1_ROWS_S else "NOT met"
        unary = "" if four is None else f" (unary Publish: {four.ha['rows_per_s']:,.0f} rows/s)"
        lines.append(
            f"- 4 threads, batch 1 (11 columns), HA >= 4,000 rows/s: {value:,.0f} rows/s "
            f"pipelined ({best.pipeline} in flight per thread), **{met}**{unary}"
        )
    elif four is not None:
        value = four.ha["rows_per_s"]
        met = "met" if value >= TARGET_4T_BATCH1_ROWS_S else "NOT met"
        lines.append(
            f"- 4 threads, batch 1 (11 columns), HA >= 4,000 rows/s: {value:,.0f} rows/s "
            f"(unary Publish), **{met}**"
        )
    return [*lines, ""]


# --- chart ------------------------------------------------------------------------------------


def chart(summaries: list[Summary], path: Path) -> None:
    """One panel per column count over the batch sizes (unary cells), and one per
    (columns, threads, batch) that has pipelined cells, over the windows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unary = [s for s in summaries if not s.pipeline]
    pipelined = sorted({(s.columns, s.threads, s.batch_rows) for s in summaries if s.pipeline})
    # A window scan's unary cells are its panels' first bars: no batch panel for them.
    scan_only = all((s.columns, s.threads, s.batch_rows) in pipelined for s in unary)
    columns_list = [] if scan_only else sorted({s.columns for s in unary})
    panels = len(columns_list) + len(pipelined)
    figure, axes = plt.subplots(1, panels, figsize=(7 * panels, 5), squeeze=False)
    for axis, columns in zip(axes[0], columns_list, strict=False):
        _batch_panel(axis, [s for s in unary if s.columns == columns], columns)
    for axis, (columns, threads, batch_rows) in zip(
        axes[0][len(columns_list) :], pipelined, strict=True
    ):
        cells = [
            s
            for s in summaries
            if (s.columns, s.threads, s.batch_rows) == (columns, threads, batch_rows)
        ]
        _window_panel(axis, sorted(cells, key=lambda s: s.pipeline), columns, threads, batch_rows)
    figure.suptitle("HA (3 replicas, fsynced majority) vs non-HA (local journal) write rows/s")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


_SERIES_COLORS: Final = {
    (1, "ha"): "#1f77b4",
    (1, "local"): "#aec7e8",
    (4, "ha"): "#d62728",
    (4, "local"): "#ff9896",
}
_BAR_WIDTH: Final = 0.2


def _batch_panel(axis: Any, cells: list[Summary], columns: int) -> None:
    """Rows/s per batch size: 1 and 4 threads, HA and non-HA, DolphinDB's marks."""
    batches = sorted({s.batch_rows for s in cells})
    reference_labelled = False
    for index, (threads, mode) in enumerate(_SERIES_COLORS):
        xs, ys, refs = [], [], []
        for position, batch_rows in enumerate(batches):
            match = [s for s in cells if (s.threads, s.batch_rows) == (threads, batch_rows)]
            if not match:
                continue
            x = position + (index - 1.5) * _BAR_WIDTH
            xs.append(x)
            ys.append(getattr(match[0], mode)["rows_per_s"])
            reference = DOLPHINDB.get((columns, threads, batch_rows))
            if reference is not None:
                value = reference.ha_rows_per_s if mode == "ha" else reference.normal_rows_per_s
                refs.append((x, value))
        if xs:
            axis.bar(
                xs,
                ys,
                _BAR_WIDTH,
                color=_SERIES_COLORS[threads, mode],
                label=f"{threads} thread{'s' if threads > 1 else ''}, {MODE_LABEL[mode]}",
            )
        if refs:
            axis.scatter(
                [x for x, _ in refs],
                [y for _, y in refs],
                marker="_",
                s=300,
                color="black",
                zorder=3,
                label=None if reference_labelled else "DolphinDB (published)",
            )
            reference_labelled = True
    for position, batch_rows in enumerate(batches):
        for threads, offset in ((1, -1.0), (4, 1.0)):
            match = [s for s in cells if (s.threads, s.batch_rows) == (threads, batch_rows)]
            if match and not math.isnan(match[0].ratio):
                axis.annotate(
                    f"{match[0].ratio:.0%}",
                    (position + offset * _BAR_WIDTH, match[0].ha["rows_per_s"]),
                    textcoords="offset points",
                    xytext=(0, 12),
                    ha="center",
                    fontsize=8,
                )
    # A fixed range: one batch size alone would otherwise stretch its bars over the panel.
    axis.set_xlim(-0.5, len(batches) - 0.5)
    axis.set_xticks(range(len(batches)), [f"{b:,}" for b in batches])
    axis.set_yscale("log")
    axis.set_xlabel("rows per publish (batch)")
    axis.set_ylabel("rows/s")
    axis.set_title(f"{columns} columns (labels: HA/non-HA)")
    axis.grid(axis="y", which="both", alpha=0.3)
    axis.legend(fontsize=8, loc="upper left")


def _window_panel(
    axis: Any, cells: list[Summary], columns: int, threads: int, batch_rows: int
) -> None:
    """Rows/s per pipeline window (unary first) of one cell: HA and non-HA side by side."""
    for index, mode in enumerate(("ha", "local")):
        xs = [position + (index - 0.5) * 2 * _BAR_WIDTH for position in range(len(cells))]
        axis.bar(
            xs,
            [getattr(cell, mode)["rows_per_s"] for cell in cells],
            2 * _BAR_WIDTH,
            color=_SERIES_COLORS[4, mode],
            label=MODE_LABEL[mode],
        )
    for position, cell in enumerate(cells):
        if not math.isnan(cell.ratio):
            axis.annotate(
                f"{cell.ratio:.0%}",
                (position - _BAR_WIDTH, cell.ha["rows_per_s"]),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
    axis.set_xlim(-0.5, len(cells) - 0.5)
    axis.set_xticks(range(len(cells)), [_window(cell.pipeline) for cell in cells])
    axis.set_yscale("log")
    axis.set_xlabel("requests in flight per thread")
    axis.set_ylabel("rows/s")
    axis.set_title(
        f"{columns} columns, {threads} thread{'s' if threads > 1 else ''}, "
        f"{batch_rows:,} row{'s' if batch_rows > 1 else ''} per publish (labels: HA/non-HA)"
    )
    axis.grid(axis="y", which="both", alpha=0.3)
    axis.legend(fontsize=8, loc="upper left")


# --- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="reduced grid (threads 1,4 x batch 1,1000,10000 x 11 cols), 2 s cells",
    )
    parser.add_argument("--repeat", type=int, default=1, help="run the grid N times; medians")
    parser.add_argument("--duration", type=float, help="seconds per cell and mode")
    parser.add_argument("--cell-mb", type=float, help="payload MB per cell and mode (row bound)")
    parser.add_argument("--threads", type=int, nargs="*", help="override the grid's threads")
    parser.add_argument("--batch", type=int, nargs="*", help="override the grid's batch sizes")
    parser.add_argument("--columns", type=int, nargs="*", help="override the grid's columns")
    parser.add_argument(
        "--pipeline",
        type=int,
        nargs="*",
        help="windows per thread to run: 0 = unary Publish, N = PublishStream with N in "
        "flight (quick default: 0 64; full default: 0)",
    )
    parser.add_argument(
        "--pipeline-batch-max",
        type=int,
        help="pipelined cells only for batches up to this many rows (quick default 1000)",
    )
    parser.add_argument(
        "--purge-interval",
        type=float,
        default=60.0,
        help="streamingHAPurgeInterval of the cluster (s)",
    )
    parser.add_argument(
        "--election-timeout",
        type=float,
        default=1.5,
        help="streamingRaftElectionTimeout of the cluster (s)",
    )
    parser.add_argument(
        "--transport",
        choices=("port", "grpc"),
        default="port",
        help="unary cells: the node's publish port (default) or raw gRPC stubs",
    )
    parser.add_argument("--keep", action="store_true", help="keep the cluster's directory")
    parser.add_argument(
        "--tuning", default="", help="what-if: HASTREAM_TUNING knobs for the nodes (A/B only)"
    )
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--name", default="throughput", help="output file stem")
    parser.add_argument(
        "--merge", type=Path, nargs="+", help="only summarize these saved JSON runs together"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    grid = dict(QUICK_GRID if args.quick else FULL_GRID)
    for key in ("threads", "batch", "columns", "pipeline"):
        if getattr(args, key):
            grid[key] = tuple(getattr(args, key))
    if args.pipeline_batch_max:
        grid["pipeline_batch_max"] = (args.pipeline_batch_max,)
    settings = Settings(
        duration_s=args.duration or (2.0 if args.quick else 5.0),
        cell_bytes_max=int((args.cell_mb or (150 if args.quick else 400)) * 1e6),
        repeats=args.repeat,
        grid=grid,
        purge_interval_s=args.purge_interval,
        election_timeout_s=args.election_timeout,
        transport=args.transport,
    )
    if args.merge:
        return merge(args.merge, args.out, args.name)
    started = time.time()
    machine = common.machine()  # before the nodes start: the code they run
    with common.bench_cluster(
        purge_interval_s=settings.purge_interval_s,
        election_timeout_s=settings.election_timeout_s,
        keep=args.keep,
        environment=common.tuning_environment(args.tuning),
    ) as cluster:
        print(f"cluster in {cluster.root}", flush=True)
        results = run_grid(cluster, settings)
    meta = {
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "elapsed_s": time.time() - started,
        "command": "python -m bench.throughput " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine,
        "tuning": args.tuning,
    }
    code_after = common.code_version()
    if code_after != machine["code"]:
        meta["machine"] = {
            **machine,
            "code": f"{machine['code']} (changed to {code_after} "
            "during the run; the nodes kept the code they started with)",
        }
    write_outputs(results, settings, meta, args.out, args.name)
    return 0


def write_outputs(
    results: list[CellResult],
    settings: Settings,
    meta: dict[str, Any],
    out: Path,
    name: str,
) -> None:
    loads = [value for r in results for value in (r.load_before, r.load_after)]
    meta = {**meta, "load_min": min(loads), "load_max": max(loads)}
    summaries = summarize(results)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(summaries, results, settings, meta)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "settings": asdict(settings),
                "summaries": [asdict(s) for s in summaries],
                "results": [asdict(r) for r in results],
            },
            indent=1,
        )
    )
    chart(summaries, out / f"{name}.png")
    print()
    print(text)
    print(f"wrote {out / (name + '.md')}, .json, .png")


def merge(paths: list[Path], out: Path, name: str) -> int:
    """Medians over the runs saved in several JSON files (each run's repeats stay paired)."""
    results: list[CellResult] = []
    documents = [json.loads(path.read_text()) for path in paths]
    for number, document in enumerate(documents):
        for raw in document["results"]:
            result = CellResult(**raw)
            result.repeat += 1000 * number  # keep the HA/non-HA pairs of each file apart
            if math.isnan(result.node_cpu_ms_per_10k_rows):  # saved by an older version
                cores = sum(v for alias, v in result.cpu_cores.items() if alias != "client")
                result.node_cpu_ms_per_10k_rows = (
                    cores * result.wall_s * 1000 / max(result.rows, 1) * 10_000
                )
            results.append(result)
    first = documents[0]
    settings = Settings(**{**first["settings"], "repeats": len({r.repeat for r in results})})
    meta = {
        **first["meta"],
        "command": first["meta"]["command"]
        if len(paths) == 1
        else "python -m bench.throughput --merge " + " ".join(str(p) for p in paths),
        "started": ", ".join(document["meta"]["started"] for document in documents),
        "elapsed_s": sum(document["meta"]["elapsed_s"] for document in documents),
    }
    write_outputs(results, settings, meta, out, name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
