"""How long each thread waits for a CPU once woken, and where Linux put it: the kernel's
scheduler trace points under one publish shape.

    python -m bench.sched_wakeups --shape wait:1 [--seconds 4] [--markdown out.md]
    python -m bench.sched_wakeups --shape wait:1 --tuning yield_after_ack=off

On a fresh local three-node cluster, one `Publisher` in this process publishes the shape
with bench.checkouts_ab's loop (as bench.thread_costs does). After the warm-up append, every
thread of the nodes and of this client is named (`py-spy dump`, else the OS name), then
`perf record -e sched:sched_switch -e sched:sched_wakeup -a` records the whole machine for
the middle of the cell. Each wake-up of a sleeping thread is paired with the switch that
puts it on a CPU: the time between is what the woken thread waited for one.

Printed, per process and thread: wake-ups per append and the wait's mean, p50 and p90, with
each thread's share of all the waiting; and for the leader's Raft tick thread (the one an
acknowledgement wakes) the same by placement: what ran on the CPU it was woken onto and on
the other CPU, and whether the waker ran on the same CPU. A wake-up onto a CPU that is
awake costs microseconds; one queued behind a busy thread, or onto a halted vCPU woken from
another, costs hundreds on some VMs (docs/benchmark.md, the fourth session of 2026-11-28).

`--tuning` starts the nodes with raftstore/tuning.py's knobs (HASTREAM_TUNING), to see a
knob's effect on the same tables. Needs `perf` and the kernel's tracefs, which this mounts
if it is missing (root only).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from api_clients import Session
from bench import common
from bench.checkouts_ab import Cell, Shape, publish
from bench.publish_rows import SCHEMA, RowPool, hastream_builder
from bench.thread_costs import thread_names
from deploy.local_cluster import LocalCluster
from hastream.errors import ConfigError

TRACEFS: Final = Path("/sys/kernel/tracing")
# `perf script -F comm,pid,tid,cpu,time,event,trace`:
#   python  7901/7915  [000]  1524.838929: sched:sched_switch: prev_comm=... prev_pid=7915 ...
_LINE: Final = re.compile(
    r"^\s*.+?\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(sched_switch|sched_wakeup):\s+(.*)$"
)
_FIELD: Final = re.compile(r"(prev_pid|prev_state|next_pid|pid|target_cpu)=(\S+)")
_TICK_THREAD: Final = "_autoTickThread"  # pysyncobj's tick thread: "Thread-1 (_autoTickThread)"
_IDLE: Final = "idle"
_SHOWN_SHARE: Final = 0.005  # threads with less of the waiting are summed per process


class PerfUnavailable(RuntimeError):
    """perf or the kernel's scheduler trace points cannot be used here (the message says
    which)."""


@dataclass(frozen=True)
class Wake:
    """One wake-up of a sleeping thread and its wait for a CPU."""

    tid: int
    at: float  # seconds, the kernel's clock
    wait_s: float
    target: str  # what ran on the CPU it was woken onto ("idle", or process/thread)
    other: str  # what ran on the other CPU then (_others: on more CPUs, how many idled)
    same_cpu: bool  # the waker ran on the CPU the thread was woken onto


def parse_wakes(lines: Iterable[str], describe: dict[int, str]) -> list[Wake]:
    """The wake-ups of sleeping threads in `perf script` output, each with its wait until a
    switch put the thread on a CPU. `describe` names a tid ("leader node2/_serve"); others
    are "other". A wake-up of a thread that is running or already woken (the kernel traces
    those too) is not a wait and is left out."""
    running: dict[int, int] = {}  # cpu -> tid on it (0: idle)
    sleeping: set[int] = set()
    pending: dict[int, tuple[float, str, str, bool]] = {}
    wakes: list[Wake] = []
    for line in lines:
        match = _LINE.match(line)
        if match is None:
            continue
        _, _, cpu_text, at_text, kind, rest = match.groups()
        cpu, at = int(cpu_text), float(at_text)
        fields = dict(_FIELD.findall(rest))
        if kind == "sched_switch":
            previous, following = int(fields["prev_pid"]), int(fields["next_pid"])
            running[cpu] = following
            if fields["prev_state"][:1] in ("S", "D"):  # asleep, not merely preempted
                sleeping.add(previous)
            started = pending.pop(following, None)
            sleeping.discard(following)
            if started is not None:
                woken_at, target, other, same = started
                wakes.append(Wake(following, woken_at, at - woken_at, target, other, same))
        else:
            tid, target_cpu = int(fields["pid"]), int(fields["target_cpu"])
            if tid not in sleeping or tid in pending:
                continue
            other = _others([t for c, t in running.items() if c != target_cpu], describe)
            target = _what(running.get(target_cpu, 0), describe)
            pending[tid] = (at, target, other, target_cpu == cpu)
    return wakes


def _what(tid: int, describe: dict[int, str]) -> str:
    return _IDLE if tid == 0 else describe.get(tid, "other")


def _others(tids: list[int], describe: dict[int, str]) -> str:
    """What ran on the other CPUs: the occupant of the one other CPU of a two-CPU machine,
    else how many of them were idle."""
    if len(tids) == 1:
        return _what(tids[0], describe)
    if not tids:
        return "-"
    return f"{sum(1 for tid in tids if tid == 0)} of {len(tids)} others idle"


@dataclass(frozen=True)
class WaitStats:
    label: str
    count: int
    mean_us: float
    p50_us: float
    p90_us: float
    total_s: float


def stats(label: str, waits: list[float]) -> WaitStats:
    return WaitStats(
        label,
        len(waits),
        statistics.fmean(waits) * 1e6,
        statistics.median(waits) * 1e6,
        common.percentile(waits, 0.9) * 1e6,
        sum(waits),
    )


def by_thread(wakes: list[Wake], describe: dict[int, str]) -> list[WaitStats]:
    """Per named thread, its waits; most waiting first."""
    groups: dict[str, list[float]] = defaultdict(list)
    for wake in wakes:
        if wake.tid in describe:
            groups[describe[wake.tid]].append(wake.wait_s)
    return sorted((stats(label, w) for label, w in groups.items()), key=lambda s: -s.total_s)


def by_placement(wakes: list[Wake], tid: int) -> list[WaitStats]:
    """One thread's waits by where it was woken: the CPU's occupant, the other's, and
    whether the waker was on that CPU; most frequent first."""
    groups: dict[str, list[float]] = defaultdict(list)
    for wake in wakes:
        if wake.tid == tid:
            where = "woken from that CPU" if wake.same_cpu else "woken from the other CPU"
            groups[f"{wake.target} / {wake.other} / {where}"].append(wake.wait_s)
    return sorted((stats(label, w) for label, w in groups.items()), key=lambda s: -s.count)


def ensure_tracefs() -> None:
    """The scheduler's trace points must be reachable for perf: mount tracefs if needed."""
    if shutil.which("perf") is None:
        raise PerfUnavailable("no perf on PATH (Debian: apt-get install linux-perf)")
    if (TRACEFS / "events" / "sched").is_dir():
        return
    done = subprocess.run(
        ["mount", "-t", "tracefs", "nodev", str(TRACEFS)],
        capture_output=True,
        text=True,
        check=False,
    )
    if not (TRACEFS / "events" / "sched").is_dir():
        raise PerfUnavailable(f"no tracefs at {TRACEFS} and mounting it failed: {done.stderr}")


@dataclass
class Recording:
    cell: Cell
    wakes: list[Wake]
    describe: dict[int, str]
    tick_tid: int | None  # the leader's Raft tick thread
    recorded_s: float


def record(cluster: LocalCluster, shape: Shape, seconds: float, workdir: Path) -> Recording:
    """One cell on `cluster`, perf recording the middle `seconds - 1` of it."""
    ensure_tracefs()
    table = "sched_wakeups"
    cluster.create_table(table, SCHEMA, group=common.HA_GROUP)
    session = Session([node.site for node in cluster.nodes.values()])
    session.getStreamingLeader(common.HA_GROUP)
    leader = cluster.leader(common.HA_GROUP)
    roles = {
        pid: f"{'leader' if alias == leader else 'follower'} {alias}"
        for alias, pid in common.node_pids(cluster).items()
    }
    roles[os.getpid()] = "client"
    describe: dict[int, str] = {}
    recorded_s = max(0.5, seconds - 1.0)
    data = workdir / "perf.data"
    perf: list[subprocess.Popen[bytes]] = []

    def between() -> None:
        if perf:  # the end: the recording is over by now
            perf[0].wait(timeout=60)
            return
        for pid, role in roles.items():  # named before perf starts: py-spy pauses them
            for tid, name in thread_names(pid).items():
                describe[tid] = f"{role}/{_short(name)}"
        perf.append(
            subprocess.Popen(
                ["perf", "record", "-q", "-e", "sched:sched_switch", "-e", "sched:sched_wakeup",
                 "-a", "-o", str(data), "--", "sleep", f"{recorded_s:g}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip

    try:
        build = hastream_builder(RowPool.make(), shape.rows)
        cell = publish(session, table, shape, build, seconds, between=between)
    finally:
        session.close()
        for process in perf:
            if process.poll() is None:
                process.kill()
    if not perf or perf[0].returncode != 0 or not data.exists():
        code = perf[0].returncode if perf else None
        raise PerfUnavailable(f"perf record recorded nothing (exit status {code})")
    script = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "comm,pid,tid,cpu,time,event,trace"],
        capture_output=True,
        text=True,
        check=True,
    )
    wakes = parse_wakes(script.stdout.splitlines(), describe)
    tick = next(
        (
            tid
            for tid, what in describe.items()
            if what.startswith("leader") and _TICK_THREAD in what
        ),
        None,
    )
    return Recording(cell, wakes, describe, tick, recorded_s)


def _short(name: str) -> str:
    """'Thread-1 (_autoTickThread)' -> '_autoTickThread'; 'grpc_3' stays."""
    match = re.fullmatch(r"Thread-\d+ \((.*)\)", name)
    return match.group(1) if match else name


def report(shape: Shape, recording: Recording) -> str:
    appends = recording.cell.rows_per_s / shape.rows * recording.recorded_s
    threads = by_thread(recording.wakes, recording.describe)
    total = sum(s.total_s for s in threads) or 1.0
    kind = "wait" if shape.wait else "async"
    lines = [
        f"shape {kind}:{shape.rows}: {recording.cell.rows_per_s:,.0f} rows/s"
        + (f", p50 {recording.cell.p50_ms:.2f} ms" if recording.cell.p50_ms is not None else "")
        + f"; {recording.recorded_s:g} s recorded (~{appends:,.0f} appends);"
        f" load {common.load_average():.1f}, code {common.code_version()}",
        "",
        "| process/thread | wake-ups per append | wait mean us | p50 | p90 | share of waiting |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rest: dict[str, float] = defaultdict(float)
    for s in threads:
        if s.total_s / total < _SHOWN_SHARE:
            rest[s.label.split("/", 1)[0]] += s.total_s
            continue
        lines.append(
            f"| {s.label} | {s.count / appends:.2f} | {s.mean_us:,.0f} | {s.p50_us:,.0f} |"
            f" {s.p90_us:,.0f} | {s.total_s / total:.1%} |"
        )
    for process, seconds in sorted(rest.items()):
        lines.append(f"| {process}/(other threads) | | | | | {seconds / total:.1%} |")
    if recording.tick_tid is not None:
        lines += [
            "",
            "The leader's Raft tick thread, by placement (the woken-onto CPU's occupant /"
            " the other CPU's / where the waker ran):",
            "",
            "| placement | wake-ups | wait p50 us | p90 | mean |",
            "|---|---:|---:|---:|---:|",
        ]
        for s in by_placement(recording.wakes, recording.tick_tid):
            lines.append(
                f"| {s.label} | {s.count} | {s.p50_us:,.0f} | {s.p90_us:,.0f} | {s.mean_us:,.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sched_wakeups",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shape", type=Shape.parse, default=Shape(wait=True, rows=1))
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument("--tuning", default="", help="HASTREAM_TUNING of the nodes (key=value,...)")
    args = parser.parse_args(argv)
    if args.seconds < 1.5:
        parser.error("--seconds >= 1.5 (one second of it is not recorded)")
    try:
        environment = common.tuning_environment(args.tuning)
    except ConfigError as error:
        parser.error(f"--tuning: {error}")
    try:
        ensure_tracefs()
    except PerfUnavailable as error:
        print(f"cannot record: {error}", file=sys.stderr)
        return 2
    try:
        with (
            tempfile.TemporaryDirectory(prefix="sched-wakeups-") as workdir,
            common.bench_cluster(
                purge_interval_s=60, election_timeout_s=1.5, environment=environment
            ) as cluster,
        ):
            recording = record(cluster, args.shape, args.seconds, Path(workdir))
    except PerfUnavailable as error:
        print(f"cannot record: {error}", file=sys.stderr)
        return 2
    common.print_report("bench.sched_wakeups", argv, report(args.shape, recording), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
