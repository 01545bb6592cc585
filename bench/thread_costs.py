"""What one append costs each thread: CPU and context switches per append, thread by thread,
of the three nodes and of the publishing client, at one publish shape.

    python -m bench.thread_costs --shape wait:1 [--seconds 5] [--markdown out.md]
    python -m bench.thread_costs --shape async:100

On a fresh local three-node cluster, one `Publisher` in this process publishes the shape
(as in bench.vs_nats: `wait:N` is `Publisher.append` of N rows waited for, `async:N` is
`append_async` with 64 in flight; one row is a row tuple, N rows a pyarrow Table of the
11-column rows, built inside the loop as a user's program would). Around the timed loop it
reads every thread's utime + stime and its voluntary and involuntary context switches
(/proc/<pid>/task/<tid>/{stat,status}). A context switch is a thread going to sleep or
being put off the CPU: a hand-off between threads (a GIL or lock wait, a queue, a poll) is
one on each side, and on two shared cores a wake-up can cost as much as the work it hands
over. Threads are named as py-spy (`py-spy dump`) or Python's `threading` sees them, else by
their OS name (gRPC's C threads). The client's main thread is split into building the
rows and the append call (`time.thread_time` around each).

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from api_clients import Publisher, Session
from bench import common
from bench.checkouts_ab import Shape
from bench.publish_rows import SCHEMA, RowPool, hastream_builder
from deploy.local_cluster import LocalCluster

_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
_WINDOW: Final = 64  # in flight for the async shapes, as bench.vs_nats
_SHOWN_CPU_SHARE: Final = 0.01
_SHOWN_SWITCHES: Final = 0.01  # per append
# `py-spy dump`'s thread lines: Thread 7263 (idle): "Thread-1 (_autoTickThread)"
_DUMP_THREAD: Final = re.compile(r'^Thread (0x[0-9A-Fa-f]+|\d+) \([^)]*\): "(.*)"', re.MULTILINE)


@dataclass(frozen=True)
class ThreadSample:
    """One thread's counters so far."""

    cpu_s: float
    switches: int


@dataclass(frozen=True)
class ThreadCost:
    """One thread's share of a cell, per append."""

    process: str  # "leader node2", "follower node1", "client"
    thread: str
    cpu_us: float
    switches: float


def thread_samples(pid: int) -> dict[int, ThreadSample]:
    """Every live thread of `pid`: tid -> its CPU and context switches so far."""
    samples: dict[int, ThreadSample] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return samples
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                text = stat.read()
            with open(f"/proc/{pid}/task/{task}/status") as status:
                lines = status.read().splitlines()
        except OSError:
            continue  # the thread ended between the listing and the read
        fields = text[text.rindex(")") + 2 :].split()
        switches = sum(
            int(line.partition(":")[2])
            for line in lines
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
        )
        cpu_s = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        samples[int(task)] = ThreadSample(cpu_s, switches)
    return samples


def os_thread_names(pid: int) -> dict[int, str]:
    """tid -> the OS thread name (`comm`: 15 characters, what gRPC's C threads set)."""
    names: dict[int, str] = {}
    for tid in thread_samples(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                names[tid] = comm.read().strip()
        except OSError:
            continue
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
    before: dict[int, ThreadSample],
    after: dict[int, ThreadSample],
    names: dict[int, str],
    appends: int,
) -> list[ThreadCost]:
    """Per thread of one process, what it spent between the samples per append (a thread
    that started in between counts from zero; one that ended is gone from `after`)."""
    result = []
    for tid, end in after.items():
        start = before.get(tid, ThreadSample(0.0, 0))
        result.append(
            ThreadCost(
                process=process,
                thread=names.get(tid, f"tid {tid}"),
                cpu_us=(end.cpu_s - start.cpu_s) / appends * 1e6,
                switches=(end.switches - start.switches) / appends,
            )
        )
    return sorted(result, key=lambda cost: (-cost.cpu_us, -cost.switches, cost.thread))


@dataclass
class ClientLoop:
    """The timed loop's own numbers: appends, rows/s, and the main thread's split."""

    appends: int = 0
    rows_per_s: float = 0.0
    build_us: float = 0.0  # main thread CPU per append building the rows
    call_us: float = 0.0  # main thread CPU per append inside append / append_async
    p50_ms: float | None = None


def publish(
    publisher: Publisher,
    shape: Shape,
    build: Callable[[int], object],
    seconds: float,
    between: Callable[[], None],
) -> ClientLoop:
    """Publish `shape` for `seconds` after one warm-up append; `between()` runs right after
    the warm-up and right after the last acknowledgement (the counters' samples)."""
    first = build(0)
    if shape.wait:
        publisher.append(first)
    else:
        publisher.append_async(first).result()
    between()
    clock, cpu = time.perf_counter, time.thread_time
    loop = ClientLoop()
    latencies: list[float] = []
    build_s = call_s = 0.0
    number, started = 1, clock()
    while clock() - started < seconds:
        cpu_started = cpu()
        data = build(number)
        cpu_built = cpu()
        sent = clock()
        if shape.wait:
            publisher.append(data)
            latencies.append(clock() - sent)
        else:
            publisher.append_async(data)
        call_s += cpu() - cpu_built
        build_s += cpu_built - cpu_started
        number += 1
    publisher.flush()
    elapsed = clock() - started
    between()
    loop.appends = number - 1
    loop.rows_per_s = loop.appends * shape.rows / elapsed
    loop.build_us = build_s / loop.appends * 1e6
    loop.call_us = call_s / loop.appends * 1e6
    if latencies:
        latencies.sort()
        loop.p50_ms = latencies[len(latencies) // 2] * 1000
    return loop


def measure(
    cluster: LocalCluster, shape: Shape, seconds: float
) -> tuple[ClientLoop, list[ThreadCost]]:
    """One cell on `cluster`: the loop's numbers and every thread's cost per append."""
    table = "thread_costs"
    cluster.create_table(table, SCHEMA, group=common.HA_GROUP)
    session = Session([node.site for node in cluster.nodes.values()])
    session.getStreamingLeader(common.HA_GROUP)
    leader = cluster.leader(common.HA_GROUP)
    pids = common.node_pids(cluster)
    roles = {
        alias: f"{'leader' if alias == leader else 'follower'} {alias}"
        for alias in sorted(pids, key=lambda alias: (alias != leader, alias))
    }
    client_pid = os.getpid()
    samples: list[dict[str, dict[int, ThreadSample]]] = []

    def sample() -> None:
        taken = {role: thread_samples(pids[alias]) for alias, role in roles.items()}
        taken["client"] = thread_samples(client_pid)
        samples.append(taken)

    publisher = Publisher(session, table, max_in_flight=None if shape.wait else _WINDOW)
    try:
        loop = publish(
            publisher, shape, hastream_builder(RowPool.make(), shape.rows), seconds, sample
        )
        names = {role: _names(pids[alias]) for alias, role in roles.items()}
        names["client"] = {**os_thread_names(client_pid), **own_thread_names()}
    finally:
        publisher.close()
        session.close()
    before, after = samples
    result: list[ThreadCost] = []
    for process in [*roles.values(), "client"]:
        result += costs(process, before[process], after[process], names[process], loop.appends)
    return loop, result


def _names(pid: int) -> dict[int, str]:
    return {**os_thread_names(pid), **python_thread_names(pid)}


def report(shape: Shape, loop: ClientLoop, thread_costs: Sequence[ThreadCost]) -> str:
    """The Markdown tables: per process, its notable threads and its totals."""
    kind = "wait" if shape.wait else "async"
    lines = [
        f"shape {kind}:{shape.rows}: {loop.appends:,} appends, {loop.rows_per_s:,.0f} rows/s"
        + (f", p50 {loop.p50_ms:.2f} ms" if loop.p50_ms is not None else "")
        + f"; client main thread per append: building the rows {loop.build_us:.0f} us CPU,"
        f" the {'append' if shape.wait else 'append_async'} call {loop.call_us:.0f} us CPU;"
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
        loop, thread_costs = measure(cluster, args.shape, args.seconds)
    text = report(args.shape, loop, thread_costs)
    print(text, end="")
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(f"`python -m bench.thread_costs {' '.join(argv or sys.argv[1:])}`\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
