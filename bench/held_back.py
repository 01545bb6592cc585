"""What the held-back follower costs a waited publisher: the same cluster with it running,
and with it stopped, in turns.

    python -m bench.held_back [--rows 1] [--rounds 8] [--seconds 2] [--trace]

The leader sends each new entry at once only to the follower a commit needs (the eager one)
and the other follower everything it lacks every `HOLD_FOLLOWERS_S` (raftstore/pacing.py).
That held-back follower is on no publisher's path, yet its batches take the machine's two
cores from the path: this measures how much. One three-node cluster (deploy/local_cluster.py:
real node processes); every round publishes waited appends of `--rows` rows for `--seconds`
twice, in turns (the order alternates from round to round): with every node running, and
with the held-back follower stopped (SIGSTOP; it is the follower that did fewer context
switches over the 200 appends just before, which the pacing makes the held-back one; the
same follower is stopped in every round, and should the pacing have swapped the two roles
meanwhile, the other takes the eager place within twice the hold). A stop long enough for
the leader to drop its link (`connectionTimeout`, twice the election timeout) would change
what the leader does, so a window is kept far shorter. Printed per window: appends/s, the call's
p50 / p90 / mean ms and each node's CPU per append; at the end the medians of both modes and
their ratio (stopped / running): the most a cheaper held-back follower could give this shape
here.

`--trace` has every node record its timeline (raftstore/trace.py), and splits the calls of the
running windows by whether a follower received a batch (two or more entries in one message:
the held-back follower's) while they ran: their count and mean ms each, and what the
overlapping calls add to the mean call.

At the end the follower is continued, every replica catches up, and each must hold every
acknowledged row once: its row count equals the acknowledged rows, and every replica's table
equals the leader's (the tool fails otherwise). Nothing here patches the nodes: the cluster
is the product as shipped.
"""

from __future__ import annotations

import argparse
import bisect
import json
import shutil
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from api_clients import Publisher, Session
from bench import common
from bench.publish_rows import SCHEMA, RowPool, hastream_builder
from deploy.local_cluster import LocalCluster
from raftstore import trace

MODES = ("running", "stopped")
_PROBE_APPENDS = 200  # appends over which the followers' context switches are counted
_SETTLE_APPENDS = 30  # appends after a stop or continue, before a window's clock starts
_ELECTION_TIMEOUT_S = 1.5  # the cluster's; a window stays far below its connectionTimeout
_COMPARE_ROWS_MAX = 2_000_000  # replicas' tables read back and compared up to this many rows


@dataclass(frozen=True)
class Window:
    mode: str
    rows_per_s: float
    p50_ms: float
    p90_ms: float
    mean_ms: float
    cpu_us: dict[str, float]  # node alias -> CPU per append
    calls: list[tuple[float, float]] = field(repr=False)  # (start, end), trace.clock


@dataclass(frozen=True)
class Split:
    """The running windows' calls, by whether a follower received a batch (two or more
    entries at once: the held-back one's) while each ran."""

    overlapping: int
    overlapping_mean_ms: float
    others: int
    others_mean_ms: float

    @property
    def added_ms_per_call(self) -> float:
        """What the overlapping calls add to the mean call of all of them."""
        total = self.overlapping + self.others
        extra = self.overlapping_mean_ms - self.others_mean_ms
        return extra * self.overlapping / total if total else 0.0


def split_calls(calls: list[tuple[float, float]], received: list[float]) -> Split:
    """`calls` split by whether a time of `received` (sorted) falls within them."""
    overlapping: list[float] = []
    others: list[float] = []
    for started, ended in calls:
        at = bisect.bisect_left(received, started)
        within = at < len(received) and received[at] <= ended
        (overlapping if within else others).append((ended - started) * 1000)
    return Split(
        len(overlapping),
        statistics.fmean(overlapping) if overlapping else 0.0,
        len(others),
        statistics.fmean(others) if others else 0.0,
    )


def held_back_follower(leader: str, append: Callable[[], object], pids: dict[str, int]) -> str:
    """The follower that did fewer context switches over `_PROBE_APPENDS` appends."""
    followers = [alias for alias in pids if alias != leader]
    before = {alias: common.context_switches([pids[alias]]) for alias in followers}
    for _ in range(_PROBE_APPENDS):
        append()
    done = {alias: common.context_switches([pids[alias]]) - before[alias] for alias in followers}
    return min(followers, key=lambda alias: done[alias])


@contextmanager
def stopped(cluster: LocalCluster, alias: str, stop: bool) -> Iterator[None]:
    """The node stopped (SIGSTOP) for the block when `stop`; continued however it ends."""
    if not stop:
        yield
        return
    cluster.signal(alias, signal.SIGSTOP)
    try:
        yield
    finally:
        cluster.signal(alias, signal.SIGCONT)


def window(
    mode: str,
    publisher: Publisher,
    build: Callable[[int], object],
    numbers: Iterator[int],
    seconds: float,
    pids: dict[str, int],
) -> Window:
    """Waited appends for `seconds`; returns the window's figures."""
    for _ in range(_SETTLE_APPENDS):
        publisher.append(build(next(numbers)))
    cpu_before = {alias: common.cpu_seconds(pid) for alias, pid in pids.items()}
    calls: list[tuple[float, float]] = []
    clock = trace.clock
    started = clock()
    while clock() - started < seconds:
        data = build(next(numbers))
        sent = clock()
        publisher.append(data)
        calls.append((sent, clock()))
    elapsed = clock() - started
    latencies = sorted((end - begin) * 1000 for begin, end in calls)
    return Window(
        mode,
        len(calls) / elapsed,
        common.percentile(latencies, 0.5),
        common.percentile(latencies, 0.9),
        statistics.fmean(latencies),
        {
            alias: (common.cpu_seconds(pid) - cpu_before[alias]) / len(calls) * 1e6
            for alias, pid in pids.items()
        },
        calls,
    )


def check_replicas(cluster: LocalCluster, table: str, acknowledged: int, leader: str) -> None:
    """Every replica caught up and holds every acknowledged row once: its row count is the
    acknowledged rows and its table equals the leader's (read back up to
    `_COMPARE_ROWS_MAX` rows: three replicas' copies of more would take GiBs here).
    Raises AssertionError."""
    expected: pa.Table | None = None
    for alias in [leader, *(a for a in cluster.nodes if a != leader)]:
        assert cluster.caught_up(alias, timeout_s=60), f"{alias} did not catch up"
        rows = cluster.row_count(alias, table)
        assert rows == acknowledged, f"{alias} holds {rows} rows, {acknowledged} acknowledged"
        if acknowledged > _COMPARE_ROWS_MAX:
            continue
        held = cluster.read_table(alias, table)
        if expected is None:
            expected = held
        assert held.equals(expected), f"{alias}'s rows differ from the leader's"


def run(rows: int, rounds: int, seconds: float, traced: bool) -> tuple[list[Window], Split | None]:
    root = Path(tempfile.mkdtemp(prefix="hastream-held-back-"))
    try:
        return _run(root, rows, rounds, seconds, traced)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(
    root: Path, rows: int, rounds: int, seconds: float, traced: bool
) -> tuple[list[Window], Split | None]:
    knobs = f"trace_file={root}/<ALIAS>-trace.json" if traced else ""
    with common.bench_cluster(
        purge_interval_s=60.0,
        election_timeout_s=_ELECTION_TIMEOUT_S,
        environment=common.tuning_environment(knobs),
        parent=root,
    ) as cluster:
        leader = cluster.leader(common.HA_GROUP)
        cluster.create_table("held_back", SCHEMA, group=common.HA_GROUP)
        session = Session([node.site for node in cluster.nodes.values()])
        publisher = Publisher(session, "held_back")
        build = hastream_builder(RowPool.make(), rows)
        numbers = iter(range(sys.maxsize))  # every append takes the next: the count at the end
        pids = common.node_pids(cluster)
        windows: list[Window] = []
        try:
            held = held_back_follower(leader, lambda: publisher.append(build(next(numbers))), pids)
            term = common.ha_term(cluster)
            print(f"leader {leader}, held-back follower {held}", flush=True)
            for number in range(rounds):
                for mode in MODES if number % 2 == 0 else tuple(reversed(MODES)):
                    with stopped(cluster, held, mode == "stopped"):
                        found = window(mode, publisher, build, numbers, seconds, pids)
                    windows.append(found)
                    print(progress_line(number, found), flush=True)
            appended = next(numbers)
        finally:
            publisher.close()
            session.close()
        elections = common.ha_term(cluster) - term
        if elections:
            print(f"note: {elections} election(s) during the run", flush=True)
        check_replicas(cluster, "held_back", appended * rows, leader)
        cluster.stop()  # traced nodes write their timelines as they stop
    split = None
    if traced:
        batches: list[float] = []
        for alias in pids:
            if alias != leader:
                path = trace.timeline_path(root / f"{alias}-trace.json")
                batches += batch_times(json.loads(path.read_text()).get("received", []))
        running = [call for w in windows if w.mode == "running" for call in w.calls]
        split = split_calls(running, sorted(batches))
    return windows, split


def batch_times(received: list[tuple[int, float]]) -> list[float]:
    """When a follower received a message of two or more new entries (a held-back
    follower's batch; the eager one gets one entry per message, a heartbeat none): the
    received events (last index, time) whose index moved by two or more. The roles may
    swap during a run, so both followers' are taken."""
    found: list[float] = []
    previous: int | None = None
    for index, at in received:
        if previous is not None and index - previous >= 2:
            found.append(at)
        previous = index if previous is None else max(previous, index)
    return found


def progress_line(number: int, found: Window) -> str:
    cpu = ", ".join(f"{alias} {us:,.0f}" for alias, us in sorted(found.cpu_us.items()))
    return (
        f"round {number} {found.mode:8s}: {found.rows_per_s:,.0f} appends/s, call p50 "
        f"{found.p50_ms:.2f} p90 {found.p90_ms:.2f} mean {found.mean_ms:.2f} ms; "
        f"CPU us per append {cpu}"
    )


def report(windows: list[Window], split: Split | None, rows: int) -> list[str]:
    def median(mode: str, value: Callable[[Window], float]) -> float:
        return statistics.median(value(w) for w in windows if w.mode == mode)

    lines = [
        "| mode | appends/s | rows/s | call p50 ms | p90 | mean |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        appends = median(mode, lambda w: w.rows_per_s)
        lines.append(
            f"| {mode} | {appends:,.0f} | {appends * rows:,.0f} "
            f"| {median(mode, lambda w: w.p50_ms):.2f} "
            f"| {median(mode, lambda w: w.p90_ms):.2f} "
            f"| {median(mode, lambda w: w.mean_ms):.2f} |"
        )
    ratio = median("stopped", lambda w: w.rows_per_s) / median("running", lambda w: w.rows_per_s)
    paired = [
        stopped_w.rows_per_s / running_w.rows_per_s
        for running_w, stopped_w in zip(
            [w for w in windows if w.mode == "running"],
            [w for w in windows if w.mode == "stopped"],
            strict=True,
        )
    ]
    lines += [
        "",
        f"stopped / running: rows/s x{ratio:.2f} (medians); round by round "
        f"x{statistics.median(paired):.2f}",
    ]
    if split is not None:
        lines += [
            "",
            f"running windows, calls during which a follower received a batch: "
            f"{split.overlapping:,}, mean {split.overlapping_mean_ms:.2f} ms; the others: "
            f"{split.others:,}, mean {split.others_mean_ms:.2f} ms; the overlapping calls add "
            f"{split.added_ms_per_call:.3f} ms to the mean call",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.held_back", description=__doc__)
    parser.add_argument("--rows", type=int, default=1, help="rows per waited append")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=2.0, help="per window (below 2.5)")
    parser.add_argument("--trace", action="store_true", help="split the calls (see above)")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 2.5:
        parser.error("--seconds must be in (0, 2.5]: a longer stop drops the leader's link")
    if args.rows < 1 or args.rounds < 1:
        parser.error("--rows and --rounds must be at least 1")
    windows, split = run(args.rows, args.rounds, args.seconds, args.trace)
    print(
        f"\nheld-back follower, {args.rows} row(s) per waited append, code {common.code_version()}"
    )
    print("\n".join(report(windows, split, args.rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
