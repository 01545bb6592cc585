"""A/B of a node-side change: two checkouts, one three-node cluster each, cells interleaved.

    python -m bench.checkouts_ab --a <checkout> --b <checkout> --shape async:10000 \\
        [--columns 11|211] [--rounds 5] [--seconds 4]

`git worktree add /tmp/before <rev>` makes the other checkout. Both clusters run side by
side on this machine; every round publishes one cell into a fresh table on each, in turns
(the order alternates from round to round), so drifting load hits both arms alike. The
client is this process's code (api_clients of the checkout this runs from): the A/B is of
the nodes. Shapes, as in bench.vs_nats: `wait:N` (Publisher.append of N rows, waited for;
also its p50 latency) or `async:N` (append_async, 64 in flight); one row is a row tuple,
N rows a pyarrow Table of bench.vs_nats's 11 columns, or with `--columns 211` of the wide
table of bench.throughput (pre-built, so the client costs little). Prints each round and
the medians, with the ratio B/A, of rows/s and of the three nodes' CPU per 10,000 rows
(utime + stime: the cost of a row, steadier than rows/s on a shared machine) and of their
context switches per append (every hand-off between threads or processes is a sleep and a
wake-up; on a slow machine a wake-up costs as much as the work it hands over), Raft elections
during a cell (the HA group's term moved), and at the end the checkpoint times of each arm
(the `checkpoint ... took_ms` lines of its nodes' logs: the data-file fsync a checkpoint
does on the Raft thread). Each round also shows the share of the machine's CPU time the
hypervisor stole (/proc/stat; on a shared VM it went from 0% to 35% within minutes here),
and the last line gives the median of the rounds' own B/A ratios (each pair ran back to
back, in one minute's weather) with the range of steal the run saw: an A/B whose rounds
saw much steal says little.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa

from api_clients import Publisher, Session
from bench import common
from bench.publish_rows import SCHEMA, RowPool, cpu_meter, hastream_builder
from deploy.local_cluster import LocalCluster


@dataclass(frozen=True)
class Shape:
    wait: bool
    rows: int

    @staticmethod
    def parse(text: str) -> Shape:
        kind, _, rows = text.partition(":")
        if kind not in ("wait", "async") or not rows.isdigit() or int(rows) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: expected wait:N or async:N")
        return Shape(wait=kind == "wait", rows=int(rows))

    def __str__(self) -> str:
        """As `parse` reads it: wait:N or async:N."""
        return f"{'wait' if self.wait else 'async'}:{self.rows}"


@dataclass(frozen=True)
class Cell:
    rows_per_s: float  # timed rows over the timed loop and the flush
    p50_ms: float | None
    rows: int  # every row the cell published, the warm-up append included
    build_cpu_us: float = 0.0  # the calling thread's CPU per timed append building its rows
    call_cpu_us: float = 0.0  # ... and inside append / append_async
    node_cpu_ms_per_10k: float = 0.0  # set by run(): the nodes' CPU over `rows`
    node_switches_per_append: float = 0.0  # set by run(): the nodes' context switches
    elections: int = 0  # set by run(): how far the HA group's term moved during the cell
    steal: float = 0.0  # set by run(): the machine's CPU time stolen by the hypervisor
    # set by run(): the machine's busy CPU over `rows`: the nodes, this client and the
    # kernel's threads (a kworker's fdatasync), which the nodes' CPU does not count
    machine_cpu_ms_per_10k: float = 0.0


def publish(
    session: Session,
    table: str,
    shape: Shape,
    build: Callable[[int], object],
    seconds: float,
    *,
    between: Callable[[], None] = lambda: None,
) -> Cell:
    """Publish `shape` (rows made by `build`) into `table` for `seconds`, after one warm-up
    append; `between()` runs right after the warm-up and right after the last
    acknowledgement, with the publisher still open (where a caller samples counters)."""
    publisher = Publisher(session, table)
    clock, cpu = time.perf_counter, time.thread_time
    try:
        if shape.wait:
            publisher.append(build(0))
        else:
            publisher.append_async(build(0)).result()
        between()
        latencies: list[float] = []
        build_s = call_s = 0.0
        number, started = 1, clock()
        while clock() - started < seconds:
            cpu_started = cpu()
            data = build(number)
            cpu_built = cpu()
            if shape.wait:
                sent = clock()
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
    finally:
        publisher.close()
    p50 = statistics.median(latencies) * 1000 if latencies else None
    timed = max(1, number - 1)
    return Cell(
        (number - 1) * shape.rows / elapsed,
        p50,
        rows=number * shape.rows,
        build_cpu_us=build_s / timed * 1e6,
        call_cpu_us=call_s / timed * 1e6,
    )


_CHECKPOINT_LINE = re.compile(rf"checkpoint group={common.HA_GROUP} .*took_ms=([0-9.]+)")


def checkpoint_times_ms(cluster: LocalCluster) -> list[float]:
    """Every HA-group checkpoint's duration in the cluster's node logs (ms)."""
    took: list[float] = []
    for node in cluster.nodes.values():
        text = node.log_path.read_text(errors="replace") if node.log_path.exists() else ""
        took.extend(float(match) for match in _CHECKPOINT_LINE.findall(text))
    return took


def wide_builder(rows: int) -> tuple[pa.Schema, Callable[[int], object]]:
    """(schema, build) of bench.throughput's 211-column table: a few tables built once
    and handed out in turn (the client's work per append stays small)."""
    schema = common.schema_for(common.WIDE_COLUMNS)
    tables = [common.make_table(schema, rows, number * rows) for number in range(4)]
    return schema, lambda number: tables[number % len(tables)]


def run(checkouts: dict[str, Path], shape: Shape, rounds: int, seconds: float, columns: int) -> int:
    clusters: dict[str, LocalCluster] = {}
    roots: list[Path] = []
    sessions: dict[str, Session] = {}
    cells: dict[str, list[Cell]] = {arm: [] for arm in checkouts}
    if columns == common.WIDE_COLUMNS:
        schema, build = wide_builder(shape.rows)
    else:
        schema, build = SCHEMA, hastream_builder(RowPool.make(), shape.rows)
    try:
        for arm, repo in checkouts.items():
            root = Path(tempfile.mkdtemp(prefix=f"hastream-ab-{arm}-"))
            roots.append(root)
            cluster = clusters[arm] = LocalCluster(
                root,
                purge_interval_s=60,
                repo=repo,
                publish_ports=(repo / "raftstore" / "publish_port.py").exists(),
            )
            cluster.start()
            cluster.leader(common.HA_GROUP)
            sessions[arm] = Session([node.site for node in cluster.nodes.values()])
        for number in range(rounds):
            order = list(checkouts) if number % 2 == 0 else list(reversed(checkouts))
            for arm in order:
                table = f"ab{number}"
                clusters[arm].create_table(table, schema, group=common.HA_GROUP)
                sessions[arm].getStreamingLeader(common.HA_GROUP)
                pids = list(common.node_pids(clusters[arm]).values())
                term = common.ha_term(clusters[arm])
                switches = common.context_switches(pids)
                machine = common.CpuTimes.now()
                with cpu_meter(pids) as spent:
                    cell = publish(sessions[arm], table, shape, build, seconds)
                cell = replace(
                    cell,
                    node_cpu_ms_per_10k=spent[0] * 1000 / cell.rows * 10_000,
                    node_switches_per_append=(common.context_switches(pids) - switches)
                    / (cell.rows / shape.rows),
                    elections=common.ha_term(clusters[arm]) - term,
                )
                machine_after = common.CpuTimes.now()
                cell = replace(
                    cell,
                    steal=machine_after.steal_share_since(machine),
                    machine_cpu_ms_per_10k=machine_after.busy_seconds_since(machine)
                    * 1000
                    / cell.rows
                    * 10_000,
                )
                cells[arm].append(cell)
                latency = "" if cell.p50_ms is None else f", p50 {cell.p50_ms:.2f} ms"
                elections = f", {cell.elections} election(s)" if cell.elections else ""
                print(
                    f"round {number} {arm}: {cell.rows_per_s:,.0f} rows/s{latency}, "
                    f"node CPU {cell.node_cpu_ms_per_10k:,.1f} ms per 10k rows "
                    f"(machine {cell.machine_cpu_ms_per_10k:,.1f}), "
                    f"{cell.node_switches_per_append:.1f} node context switches per append, "
                    f"steal {cell.steal:.0%}{elections}",
                    flush=True,
                )
        for arm, cluster in clusters.items():
            took = checkpoint_times_ms(cluster)
            if took:
                print(
                    f"{arm} checkpoints of the HA group: {len(took)}, took median "
                    f"{statistics.median(took):,.1f} ms, max {max(took):,.1f} ms"
                )
    finally:
        for session in sessions.values():
            session.close()
        for cluster in clusters.values():
            cluster.stop()
        for root in roots:  # a run writes gigabytes: an A/B left behind filled the disk
            shutil.rmtree(root, ignore_errors=True)
    medians = {arm: statistics.median(c.rows_per_s for c in runs) for arm, runs in cells.items()}
    cpu = {
        arm: statistics.median(c.node_cpu_ms_per_10k for c in runs) for arm, runs in cells.items()
    }
    switches = {
        arm: statistics.median(c.node_switches_per_append for c in runs)
        for arm, runs in cells.items()
    }
    machine = {
        arm: statistics.median(c.machine_cpu_ms_per_10k for c in runs)
        for arm, runs in cells.items()
    }
    for arm, repo in checkouts.items():
        p50s = [c.p50_ms for c in cells[arm] if c.p50_ms is not None]
        latency = f", p50 {statistics.median(p50s):.2f} ms" if p50s else ""
        print(
            f"{arm} ({repo}): median {medians[arm]:,.0f} rows/s{latency}, "
            f"node CPU {cpu[arm]:,.1f} ms per 10k rows (machine {machine[arm]:,.1f}), "
            f"{switches[arm]:.1f} node context switches per append"
        )
    print(
        f"B/A: rows/s x{medians['B'] / medians['A']:.2f}, node CPU per row "
        f"x{cpu['B'] / cpu['A']:.2f} (machine x{machine['B'] / machine['A']:.2f}), "
        f"context switches per append "
        f"x{switches['B'] / switches['A']:.2f} (load average {common.load_average():.1f})"
    )
    print(paired_summary(cells["A"], cells["B"]))
    return 0


def paired_summary(a: list[Cell], b: list[Cell]) -> str:
    """The B/A ratios of each round's two cells, which ran back to back: their median, and
    the range of the steal the rounds saw. On a VM whose host takes a third of the CPU one
    minute and nothing the next, a round's pair shares its minute; the ratio of the
    medians above mixes minutes."""
    pairs = list(zip(a, b, strict=True))
    rows = statistics.median(y.rows_per_s / x.rows_per_s for x, y in pairs)
    cpu_ratios = [
        y.node_cpu_ms_per_10k / x.node_cpu_ms_per_10k for x, y in pairs if x.node_cpu_ms_per_10k
    ]
    cpu = f", node CPU per row x{statistics.median(cpu_ratios):.2f}" if cpu_ratios else ""
    machine_ratios = [
        y.machine_cpu_ms_per_10k / x.machine_cpu_ms_per_10k
        for x, y in pairs
        if x.machine_cpu_ms_per_10k
    ]
    if machine_ratios:
        cpu += f" (machine x{statistics.median(machine_ratios):.2f})"
    steal = [cell.steal for cell in a + b]
    return (
        f"B/A round by round (median of the {len(pairs)} pairs): rows/s x{rows:.2f}{cpu};"
        f" steal {min(steal):.0%}-{max(steal):.0%} of the machine's CPU"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.checkouts_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--a", type=Path, required=True, help="checkout A (the baseline)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B (the candidate)")
    parser.add_argument("--shape", type=Shape.parse, default=Shape(wait=False, rows=10_000))
    parser.add_argument(
        "--columns", type=int, choices=(common.NARROW_COLUMNS, common.WIDE_COLUMNS), default=11
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args(argv)
    for checkout in (args.a, args.b):
        if not (checkout / "raftstore" / "__main__.py").is_file():
            parser.error(f"{checkout} is not a checkout of this project (no raftstore/)")
    if args.rounds < 1 or args.seconds <= 0:
        parser.error("--rounds >= 1 and --seconds > 0")
    return run(
        {"A": args.a.resolve(), "B": args.b.resolve()},
        args.shape,
        args.rounds,
        args.seconds,
        args.columns,
    )


if __name__ == "__main__":
    sys.exit(main())
