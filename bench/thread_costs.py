"""What one append costs each thread: CPU and context switches per append, thread by thread,
of the three nodes and of the publishing client, at one publish shape.

    python -m bench.thread_costs --shape wait:1 [--seconds 5] [--markdown out.md]
    python -m bench.thread_costs --shape async:100

On a fresh local three-node cluster, one `Publisher` in this process publishes the shape
with bench.checkouts_ab's loop (as in bench.vs_nats: `wait:N` is `Publisher.append` of N
rows waited for, `async:N` is `append_async` with 64 in flight; one row is a row tuple, N
rows a pyarrow Table of the 11-column rows, built inside the loop as a user's program
would). Around the timed loop it reads every thread's utime + stime and its voluntary and
involuntary context switches (`common.thread_counters`). A context switch is a thread going
to sleep or being put off the CPU: a hand-off between threads (a GIL or lock wait, a queue,
a poll) is one on each side, and on two shared cores a wake-up can cost as much as the work
it hands over. Threads are named as py-spy (`py-spy dump`) or Python's `threading` sees
them, else by their OS name (gRPC's C threads). The client's main thread is split into
building the rows and the append call (`time.thread_time` around each).

Prints one table per process (leader, followers, client) with the threads that took at least
1% of its CPU or one switch per 100 appends, and per process the totals: where a shape's CPU
goes, and how many wake-ups an append takes on each side (the cost a one-event-loop node or
fewer client threads would remove).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Final

from api_clients import Session
from bench import common
from bench.checkouts_ab import Cell, Shape, publish
from bench.common import ThreadCounters
from bench.publish_rows import SCHEMA, RowPool, hastream_builder
from deploy.local_cluster import LocalCluster

_SHOWN_CPU_SHARE: Final = 0.01
_SHOWN_SWITCHES: Final = 0.01  # per append
# `py-spy dump`'s thread lines: Thread 7263 (idle): "Thread-1 (_autoTickThread)"
_DUMP_THREAD: Final = re.compile(r'^Thread (0x[0-9A-Fa-f]+|\d+) \([^)]*\): "(.*)"', re.MULTILINE)


@dataclass(frozen=True)
class ThreadCost:
    """One thread's share of a cell, per append."""

    process: str  # "leader node2", "follower node1", "client"
    thread: str
    cpu_us: float
    switches: float


def os_thread_names(pid: int) -> dict[int, str]:
    """tid -> the OS thread name (`comm`: 15 characters, what gRPC's C threads set)."""
    names: dict[int, str] = {}
    for task in common.task_ids(pid):
        with suppress(OSError), open(f"/proc/{pid}/task/{task}/comm") as comm:
            names[task] = comm.read().strip()
    return names


def parse_dump(text: str) -> dict[int, str]:
    """tid -> Python thread name, from `py-spy dump`'s output (decimal or hex ids)."""
    return {int(tid, 0): name for tid, name in _DUMP_THREAD.findall(text)}


def python_thread_names(pid: int) -> dict[int, str]:
    """tid -> Python thread name of another process, by `py-spy dump`; {} without py-spy
    (bench/requirements.txt installs it) or when it cannot attach."""
    spy = shutil.which("py-spy")
    if spy is None:
        return {}
    done = subprocess.run(
        [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60, check=False
    )
    return parse_dump(done.stdout)


def own_thread_names() -> dict[int, str]:
    """tid -> Python thread name of this process."""
    return {
        thread.native_id: thread.name
        for thread in threading.enumerate()
        if thread.native_id is not None
    }


def costs(
    process: str,
    before: dict[int, ThreadCounters],
    after: dict[int, ThreadCounters],
    names: dict[int, str],
    appends: int,
) -> list[ThreadCost]:
    """Per thread of one process, what it spent between the samples per append (a thread
    that started in between counts from zero; one that ended is gone from `after`)."""
    result = []
    for tid, end in after.items():
        start = before.get(tid, ThreadCounters(0.0, 0))
        result.append(
            ThreadCost(
                process=process,
                thread=names.get(tid, f"tid {tid}"),
                cpu_us=(end.cpu_s - start.cpu_s) / appends * 1e6,
                switches=(end.switches - start.switches) / appends,
            )
        )
    return sorted(result, key=lambda cost: (-cost.cpu_us, -cost.switches, cost.thread))


def node_processes(cluster: LocalCluster) -> dict[str, int]:
    """ "leader nodeN" / "follower nodeN" -> pid of the HA group's nodes, the leader first."""
    leader = cluster.leader(common.HA_GROUP)
    pids = common.node_pids(cluster)
    return {
        f"{'leader' if alias == leader else 'follower'} {alias}": pids[alias]
        for alias in sorted(pids, key=lambda alias: (alias != leader, alias))
    }


def publish_cell(
    cluster: LocalCluster,
    table: str,
    shape: Shape,
    seconds: float,
    between: Callable[[], None],
) -> Cell:
    """Create `table` and publish `shape` into it for `seconds` with bench.checkouts_ab's
    loop (one Publisher of this process); `between` runs after the warm-up append and after
    the last acknowledgement (`timed_appends` lie between)."""
    cluster.create_table(table, SCHEMA, group=common.HA_GROUP)
    session = Session([node.site for node in cluster.nodes.values()])
    try:
        session.getStreamingLeader(common.HA_GROUP)
        build = hastream_builder(RowPool.make(), shape.rows)
        return publish(session, table, shape, build, seconds, between=between)
    finally:
        session.close()


def measure(cluster: LocalCluster, shape: Shape, seconds: float) -> tuple[Cell, list[ThreadCost]]:
    """One cell on `cluster` (bench.checkouts_ab's loop): its numbers and every thread's
    cost per timed append."""
    pids = {**node_processes(cluster), "client": os.getpid()}
    samples: list[dict[str, dict[int, ThreadCounters]]] = []
    names: dict[str, dict[int, str]] = {}

    def sample() -> None:
        samples.append({process: common.thread_counters(pid) for process, pid in pids.items()})
        if len(samples) == 2:  # the end, with the client's publishing threads still alive
            names.update({process: thread_names(pid) for process, pid in pids.items()})

    cell = publish_cell(cluster, "thread_costs", shape, seconds, sample)
    appends = timed_appends(cell, shape)
    before, after = samples
    result: list[ThreadCost] = []
    for process in pids:
        result += costs(process, before[process], after[process], names[process], appends)
    return cell, result


def timed_appends(cell: Cell, shape: Shape) -> int:
    """The cell's appends after the warm-up one (the samples are taken around them)."""
    return cell.rows // shape.rows - 1


def thread_names(pid: int) -> dict[int, str]:
    """tid -> name of every thread of `pid`: the Python name where there is one (this
    process's own, or by `py-spy dump`), else the OS name."""
    own = own_thread_names() if pid == os.getpid() else python_thread_names(pid)
    return {**os_thread_names(pid), **own}


def report(shape: Shape, cell: Cell, thread_costs: Sequence[ThreadCost]) -> str:
    """The Markdown tables: per process, its notable threads and its totals."""
    appends = timed_appends(cell, shape)
    lines = [
        f"shape {shape}: {appends:,} appends, {cell.rows_per_s:,.0f} rows/s"
        + (f", p50 {cell.p50_ms:.2f} ms" if cell.p50_ms is not None else "")
        + f"; client main thread per append: building the rows {cell.build_cpu_us:.0f} us CPU,"
        f" the {'append' if shape.wait else 'append_async'} call {cell.call_cpu_us:.0f} us CPU;"
        f" load {common.load_average():.1f}, code {common.code_version()}",
        "",
        "| process | thread | CPU us per append | context switches per append |",
        "|---|---|---:|---:|",
    ]
    processes = list(dict.fromkeys(cost.process for cost in thread_costs))
    for process in processes:
        own = [cost for cost in thread_costs if cost.process == process]
        cpu_total = sum(cost.cpu_us for cost in own)
        switches_total = sum(cost.switches for cost in own)
        for cost in own:
            if cost.cpu_us >= cpu_total * _SHOWN_CPU_SHARE or cost.switches >= _SHOWN_SWITCHES:
                lines.append(
                    f"| {process} | {cost.thread} | {cost.cpu_us:,.0f} | {cost.switches:.2f} |"
                )
        lines.append(
            f"| **{process}** | **all {len(own)} threads** | **{cpu_total:,.0f}** |"
            f" **{switches_total:.2f}** |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.thread_costs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shape", type=Shape.parse, default=Shape(wait=True, rows=1))
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error("--seconds > 0")
    with common.bench_cluster(purge_interval_s=60, election_timeout_s=1.5) as cluster:
        cell, thread_costs = measure(cluster, args.shape, args.seconds)
    common.print_report(
        "bench.thread_costs", argv, report(args.shape, cell, thread_costs), args.markdown
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
