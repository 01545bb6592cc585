"""Shared pieces of the benchmarks: the tables' schemas, pre-built Arrow IPC payloads, the
cluster they run against, and per-process CPU / RSS from /proc.

Payloads are built column by column with numpy (no per-row Python), serialized once, and
reused: the publishing loops only send bytes that already exist.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
import numpy as np
import pyarrow as pa

from deploy.local_cluster import LocalCluster, wait_until
from proto import hastream_pb2 as pb
from raftstore import tuning

REPO: Final = Path(__file__).resolve().parents[1]
RESULTS_DIR: Final = REPO / "bench" / "results"
HA_GROUP: Final = 2
LOCAL_GROUP: Final = 0
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
_SYMBOLS: Final = np.array(
    ["AAPL", "MSFT", "GOOG", "AMZN", "META", "NVDA", "TSLA", "IBM", "ORCL", "INTC"]
)

# DolphinDB's benchmark used an 11-column and a 211-column table (its schemas are in an
# attachment we do not have). Ours: 11 columns of a typical tick/device row (~71 bytes in
# Arrow), and 211 columns of wide numeric data (~1.27 KB) whose batch of 10,000 rows
# (12.7 MB) stays under the 16 MiB publish limit.
NARROW_COLUMNS: Final = 11
WIDE_COLUMNS: Final = 211


def schema_for(columns: int) -> pa.Schema:
    head = [("id", pa.int64()), ("ts", pa.timestamp("ms")), ("sym", pa.string())]
    if columns == NARROW_COLUMNS:
        return pa.schema(
            [
                *head,
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
    if columns == WIDE_COLUMNS:
        half = (WIDE_COLUMNS - len(head)) // 2
        floats = [(f"f{number:03d}", pa.float64()) for number in range(half)]
        ints = [(f"i{number:03d}", pa.int32()) for number in range(half)]
        return pa.schema([*head, *floats, *ints])
    raise ValueError(f"columns must be {NARROW_COLUMNS} or {WIDE_COLUMNS}, got {columns}")


def make_table(schema: pa.Schema, rows: int, first_id: int, seed: int = 0) -> pa.Table:
    """`rows` rows with ids [first_id, first_id + rows), built column-wise."""
    generator = np.random.default_rng(seed + first_id)
    ids = np.arange(first_id, first_id + rows, dtype=np.int64)
    arrays: list[pa.Array] = []
    for column in schema:
        if column.name == "id":
            arrays.append(pa.array(ids))
        elif column.name == "ts":
            arrays.append(pa.array(1_750_000_000_000 + ids, type=pa.timestamp("ms")))
        elif column.name == "sym":
            arrays.append(pa.array(_SYMBOLS[ids % len(_SYMBOLS)]))
        elif pa.types.is_floating(column.type):
            arrays.append(pa.array(generator.random(rows) * 100.0))
        elif pa.types.is_boolean(column.type):
            arrays.append(pa.array(ids % 2 == 0))
        else:
            values = generator.integers(0, 1_000_000, rows)
            arrays.append(pa.array(values.astype(column.type.to_pandas_dtype())))
    return pa.Table.from_arrays(arrays, schema=schema)


def ipc_payload(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def payloads(schema: pa.Schema, rows: int, count: int, first_id: int = 0) -> list[bytes]:
    """`count` distinct IPC stream payloads of `rows` rows each."""
    return [
        ipc_payload(make_table(schema, rows, first_id + number * rows)) for number in range(count)
    ]


# --- /proc ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid` so far (/proc/<pid>/stat fields 14, 15)."""
    with open(f"/proc/{pid}/stat") as stat:
        return _stat_cpu_seconds(stat.read())


def _stat_cpu_seconds(text: str) -> float:
    """utime + stime from the text of a /proc stat file (fields 14 and 15)."""
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuTimes:
    """The machine's CPU time so far, in clock ticks (/proc/stat's first line): all of it,
    and what the hypervisor gave other guests while this one had work to run (`steal`).
    On a shared VM, steal is what makes one run's rows/s differ from the next run's."""

    total: int
    steal: int
    idle: int = 0  # idle and iowait: the CPUs had nothing to run

    @staticmethod
    def now() -> CpuTimes:
        with open("/proc/stat") as stat:
            return CpuTimes.parse(stat.readline())

    @staticmethod
    def parse(line: str) -> CpuTimes:
        """From /proc/stat's "cpu  user nice system idle iowait irq softirq steal ..."
        (guest time is counted in user already: not added twice)."""
        values = [int(value) for value in line.split()[1:]]
        steal = values[7] if len(values) > 7 else 0
        return CpuTimes(total=sum(values[:8]), steal=steal, idle=sum(values[3:5]))

    def steal_share_since(self, before: CpuTimes) -> float:
        """The share of the machine's CPU time stolen between `before` and this."""
        total = self.total - before.total
        return (self.steal - before.steal) / total if total > 0 else 0.0

    def busy_seconds_since(self, before: CpuTimes) -> float:
        """The CPU time the machine ran anything between `before` and this: every process
        and the kernel's own threads (kworkers, interrupts), which a process's CPU misses."""
        ticks = (self.total - before.total) - (self.idle - before.idle)
        return (ticks - (self.steal - before.steal)) / _CLOCK_TICKS


_SWITCH_KEYS: Final = frozenset(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))


@dataclass(frozen=True)
class ThreadCounters:
    """One thread's CPU (utime + stime) and context switches (voluntary and involuntary)
    so far: a context switch is the thread going to sleep or being put off the CPU, the
    wake-ups a hand-off between threads or processes costs."""

    cpu_s: float
    switches: int


def thread_counters(pid: int) -> dict[int, ThreadCounters]:
    """Every live thread of `pid`: tid -> its counters (/proc/<pid>/task/*/stat, status).
    {} once the process exited; a thread that ends between the listing and the read is left
    out."""
    counters: dict[int, ThreadCounters] = {}
    for task in task_ids(pid):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                cpu_s = _stat_cpu_seconds(stat.read())
            with open(f"/proc/{pid}/task/{task}/status") as status:
                switches = sum(
                    int(value)
                    for key, _, value in (line.partition(":") for line in status)
                    if key in _SWITCH_KEYS
                )
        except OSError:
            continue
        counters[task] = ThreadCounters(cpu_s, switches)
    return counters


def task_ids(pid: int) -> list[int]:
    """The thread ids of `pid` (/proc/<pid>/task); [] once the process exited."""
    try:
        return [int(task) for task in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def context_switches(pids: Sequence[int]) -> int:
    """Context switches so far of every thread of the processes `pids` (`ThreadCounters`).
    A process or thread that exited counts 0 (a cell reports its errors)."""
    return sum(counters.switches for pid in pids for counters in thread_counters(pid).values())


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak RSS since start) of `pid`, in KiB."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0])
    return values


def load_average() -> float:
    with open("/proc/loadavg") as loadavg:
        return float(loadavg.read().split()[0])


def machine() -> dict[str, object]:
    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with open("/proc/meminfo") as meminfo:
        memory_kb = int(meminfo.readline().split()[1])
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(memory_kb / 2**20, 1),
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "kernel": platform.release(),
        "code": code_version(),
    }


# What the benchmarks run: the node, its wire format, the clients and the Spark connector.
_PRODUCT_DIRS: Final = ("raftstore", "proto", "api_clients", "hastream", "spark_publisher")


def code_version() -> str:
    """The last commit that changed the product (`_PRODUCT_DIRS`), '+dirty' with local
    changes there: what the measured node and client code ran."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()

    commit = git("log", "-1", "--format=%h", "--", *_PRODUCT_DIRS) or "unknown"
    dirty = git("status", "--porcelain", "--", *_PRODUCT_DIRS)
    return commit + ("+dirty" if dirty else "")


def ha_term(cluster: LocalCluster) -> int:
    """The HA group's highest term among the live nodes: its change over a cell counts the
    elections during it."""
    return cluster.highest_term(HA_GROUP)


def node_pids(cluster: LocalCluster) -> dict[str, int]:
    pids = {}
    for alias, node in cluster.nodes.items():
        if node.process is not None and node.process.poll() is None:
            pids[alias] = node.process.pid
    return pids


@dataclass
class CpuSample:
    """CPU seconds of each node process and of this (client) process at one instant."""

    nodes: dict[str, float]
    client: float

    @staticmethod
    def take(pids: dict[str, int]) -> CpuSample:
        return CpuSample(
            {alias: cpu_seconds(pid) for alias, pid in pids.items()}, cpu_seconds(os.getpid())
        )

    def cores_since(self, earlier: CpuSample, wall_s: float) -> dict[str, float]:
        """Average cores used by each process between `earlier` and this sample."""
        used = {alias: (self.nodes[alias] - earlier.nodes[alias]) / wall_s for alias in self.nodes}
        used["client"] = (self.client - earlier.client) / wall_s
        return used


# --- cluster -------------------------------------------------------------------------------


def tuning_environment(knobs: str) -> dict[str, str]:
    """The node environment for raftstore/tuning.py's `knobs` ("key=value,..."; "" = none).
    Raises ConfigError for a bad knob here, not later in three node logs."""
    if not knobs:
        return {}
    tuning.parse(knobs, "check")
    return {tuning.ENVIRONMENT_VARIABLE: knobs}


@contextmanager
def bench_cluster(
    *,
    purge_interval_s: float,
    election_timeout_s: float,
    keep: bool = False,
    environment: dict[str, str] | None = None,
    hosts: dict[str, str] | None = None,
    launch_prefix: dict[str, tuple[str, ...]] | None = None,
    groups: tuple[int, ...] = (HA_GROUP,),
    parent: Path | None = None,
) -> Iterator[LocalCluster]:
    """A three-node cluster under /tmp, or under `parent` (the same disk as everything else
    on this machine), with the Raft `groups`, each with a leader when it is handed over;
    removed afterwards unless `keep`. `environment` goes to every node process (e.g.
    `tuning_environment`, for A/B measurements only). `hosts` and `launch_prefix` (alias ->
    address, command prefix) run the nodes elsewhere, e.g. in network namespaces."""
    root = Path(tempfile.mkdtemp(prefix="hastream-bench-", dir=parent))
    cluster = LocalCluster(
        root,
        groups=groups,
        purge_interval_s=purge_interval_s,
        election_timeout_s=election_timeout_s,
        hosts=dict(hosts or {}),
        launch_prefix=dict(launch_prefix or {}),
        environment=dict(environment or {}),
    )
    failed = False
    try:
        cluster.start()
        for group in groups:
            cluster.leader(group)
        yield cluster
    except BaseException:
        failed = True  # keep the node logs for the post-mortem
        raise
    finally:
        cluster.stop()
        if keep or failed:
            print(f"cluster directory kept: {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)


def _error_name(error: grpc.RpcError) -> str:
    return str(dict(error.trailing_metadata() or ()).get("hastream-error", ""))


def create_table(
    cluster: LocalCluster,
    alias: str | None,
    table: str,
    schema: pa.Schema,
    *,
    group: int,
    cache_limit: int = 100_000,
    key_column: str = "",
) -> str:
    """Create an HA table (group >= 2, on its leader) or a non-HA table (group 0, on node
    `alias`, default the HA leader). Retries across leader changes (a table that exists
    after a retry counts as created). Returns the node it was created on."""
    request = pb.CreateTableRequest(
        raft_group=group,
        table=table,
        schema_ipc=schema.serialize().to_pybytes(),
        cache_limit=cache_limit,
        key_column=key_column,
    )
    target: list[str] = []

    def create() -> bool:
        node = cluster.leader(HA_GROUP) if group != LOCAL_GROUP or alias is None else alias
        try:
            cluster.stub(node).HaStreamTable(request, timeout=30)
        except grpc.RpcError as error:
            if _error_name(error) != "TableExists":
                raise
        target.append(node)
        return True

    wait_until(create, timeout_s=120, interval_s=0.5, message=f"create {table}")
    return target[-1]


def drop_table(cluster: LocalCluster, alias: str, table: str, *, group: int) -> None:
    """Drop `table` (forced), retrying across leader changes."""

    def drop() -> bool:
        node = cluster.leader(HA_GROUP) if group != LOCAL_GROUP else alias
        try:
            cluster.stub(node).DropStreamTable(
                pb.DropTableRequest(table=table, force=True), timeout=30
            )
        except grpc.RpcError as error:
            if _error_name(error) != "TableNotFound":
                raise
        return True

    wait_until(drop, timeout_s=120, interval_s=0.5, message=f"drop {table}")


def print_report(module: str, argv: Sequence[str] | None, text: str, markdown: str | None) -> None:
    """Print a benchmark's Markdown `text`; with `markdown`, also write it to that file under
    the command that made it (`python -m <module> <argv>`)."""
    print(text, end="")
    if markdown:
        command = " ".join(sys.argv[1:] if argv is None else argv)
        with open(markdown, "w") as out:
            out.write(f"`python -m {module} {command}`\n\n{text}")


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def median(values: list[float]) -> float:
    values = [value for value in values if value == value]  # drop NaN
    return statistics.median(values) if values else float("nan")
