"""What one append costs, function by function, inside the nodes: calls and CPU per append.

    python -m bench.func_costs --shape wait:1000 [--seconds 6] [--markdown out.md]
    python -m bench.func_costs --shape wait:1 --functions raftstore.apply:Applier.apply ...

On a fresh local three-node cluster whose node processes load bench/func_costs_node.py
(through `bench/func_costs_hook/sitecustomize.py` on their PYTHONPATH), one `Publisher`
publishes the shape with bench.checkouts_ab's loop, as bench.thread_costs does. Right
after the warm-up append the nodes wrap the functions (`--functions`, default `FUNCTIONS`:
the write path of a leader and a follower) with a `time.thread_time_ns()` clock; right
after the last acknowledgement they report each function's calls and CPU. Printed per
node: each function's calls, CPU us (inclusive: a wrapped function called by a wrapped one
counts in both) per append and per call, beside the node's whole CPU per append (all its
threads, /proc). The wrapping costs ~1 us of CPU per wrapped call, counted in the node's
total: compare functions within one run, and measure speed with the other benchmarks.
bench.thread_costs gives the same cell thread by thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench import common, func_costs_node, thread_costs
from bench.checkouts_ab import Shape

HOOK_DIR: Final = Path(__file__).resolve().parent / "func_costs_hook"
ANSWER_TIMEOUT_S: Final = 10.0

FUNCTIONS: Final = (
    # the tick thread's loop
    "raftstore.replication:_SyncObj._tick",
    "raftstore.replication:_SyncObj._poll_until_next_send",
    "raftstore.replication:_SyncObj._housekeep",
    "pysyncobj.syncobj:SyncObj._onTick",
    # receiving: peer messages, publish requests
    "raftstore.pysyncobj_patches:AesGcmEncryptor.open",
    "raftstore.pysyncobj_patches:AesGcmEncryptor.open_split",
    "pysyncobj.syncobj:SyncObj._SyncObj__onMessageReceived",
    "raftstore.port_loop:LoopedConnection.on_event",
    "raftstore.publish_port:PublishPort.begin",
    "raftstore.batcher:Batcher.submit_many",
    "raftstore.state_machine:GroupStateMachine.validate_publish",
    # proposing and sending
    "raftstore.replication:_SyncObj._applyCommand",
    "raftstore.replication:_SyncObj.propose_now",
    "pysyncobj.syncobj:SyncObj._SyncObj__sendAppendEntries",
    "pysyncobj.tcp_connection:TcpConnection.send",
    "raftstore.pysyncobj_patches:AesGcmEncryptor.seal",
    "raftstore.pysyncobj_patches:AesGcmEncryptor.seal_split",
    # the journal
    "raftstore.pysyncobj_patches:PysyncobjJournal.add",
    "raftstore.storage.journal:DurableJournal.sync",
    "raftstore.storage.journal:DurableJournal.sync_ahead",
    "raftstore.replication:_SyncObj._sync_and_acknowledge",
    # commit and apply
    "raftstore.replication:_SyncObj._checkCommandsToApply",
    "raftstore.replication:_SyncObj._SyncObj__applyLogEntries",
    "raftstore.apply:Applier.apply",
    "raftstore.state_machine:GroupStateMachine.apply",
    "raftstore.tables:TableStore.append",
    "raftstore.storage.segments:TableLog.append",
)


@dataclass(frozen=True)
class FunctionCost:
    function: str
    calls: float  # per append
    cpu_us: float  # per append

    @property
    def us_per_call(self) -> float:
        return self.cpu_us / self.calls if self.calls else 0.0


@dataclass(frozen=True)
class NodeCosts:
    process: str  # "leader node2", "follower node1"
    cpu_us: float  # the whole process, per append
    functions: list[FunctionCost]
    missing: dict[str, str]


class Requests:
    """The harness's side of the request files (see bench/func_costs_node.py)."""

    def __init__(self, directory: Path, pids: dict[str, int]) -> None:
        self._directory = directory
        self._pids = pids
        self._number = 0

    def ask(self) -> dict[str, dict[str, object]]:
        """Every node's report for a new request (waits for all of them)."""
        self._number += 1
        request = self._directory / func_costs_node.REQUEST_FILE
        partial = request.with_suffix(".part")
        partial.write_text(str(self._number))
        partial.rename(request)
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        reports: dict[str, dict[str, object]] = {}
        while len(reports) < len(self._pids):
            for process, pid in self._pids.items():
                path = self._directory / f"{pid}-{self._number}.json"
                if process not in reports and path.exists():
                    reports[process] = json.loads(path.read_text())
            if time.monotonic() > deadline:
                missing = sorted(set(self._pids) - set(reports))
                raise TimeoutError(f"no func_costs report from {missing}: hook not loaded?")
            time.sleep(0.01)
        return reports


def node_costs(
    process: str,
    before: dict[str, object],
    after: dict[str, object],
    cpu_s: float,
    appends: int,
) -> NodeCosts:
    start = before["functions"]
    end = after["functions"]
    assert isinstance(start, dict)
    assert isinstance(end, dict)
    functions = []
    for function, (calls, ns) in end.items():
        calls_before, ns_before = start.get(function, (0, 0))
        functions.append(
            FunctionCost(
                function,
                (calls - calls_before) / appends,
                (ns - ns_before) / 1e3 / appends,
            )
        )
    missing = after["missing"]
    assert isinstance(missing, dict)
    return NodeCosts(process, cpu_s / appends * 1e6, functions, missing)


def measure(
    shape: Shape, seconds: float, functions: Sequence[str], scratch_parent: Path | None = None
) -> tuple[str, list[NodeCosts]]:
    """The cell's per-function costs; the cluster and the request files go under
    `scratch_parent` (the system's temporary directory by default), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="func-costs-", dir=scratch_parent) as scratch:
        directory = Path(scratch)
        environment = {
            "PYTHONPATH": f"{HOOK_DIR}{os.pathsep}{common.REPO}",
            func_costs_node.DIRECTORY_VARIABLE: str(directory),
            func_costs_node.TARGETS_VARIABLE: ",".join(functions),
        }
        with common.bench_cluster(
            purge_interval_s=60,
            election_timeout_s=1.5,
            environment=environment,
            parent=scratch_parent,
        ) as cluster:
            pids = thread_costs.node_processes(cluster)
            requests = Requests(directory, pids)
            reports: list[dict[str, dict[str, object]]] = []
            cpu: list[dict[str, float]] = []

            def sample() -> None:
                reports.append(requests.ask())
                cpu.append({process: common.cpu_seconds(pid) for process, pid in pids.items()})

            cell = thread_costs.publish_cell(cluster, "func_costs", shape, seconds, sample)
    appends = thread_costs.timed_appends(cell, shape)
    (before, after), (cpu_before, cpu_after) = reports, cpu
    header = (
        f"shape {shape}: {appends:,} appends, {cell.rows_per_s:,.0f} rows/s, "
        f"code {common.code_version()}"
    )
    return header, [
        node_costs(
            process,
            before[process],
            after[process],
            cpu_after[process] - cpu_before[process],
            appends,
        )
        for process in pids
    ]


def report(header: str, nodes: Sequence[NodeCosts]) -> str:
    lines = [header, ""]
    for node in nodes:
        lines += [
            f"## {node.process}: {node.cpu_us:,.0f} us of CPU per append (all threads)",
            "",
            "| function | calls per append | CPU us per append | us per call |",
            "|---|---:|---:|---:|",
        ]
        for cost in node.functions:
            if cost.calls:
                lines.append(
                    f"| `{cost.function}` | {cost.calls:.2f} | {cost.cpu_us:,.1f} "
                    f"| {cost.us_per_call:,.1f} |"
                )
        never = [cost.function for cost in node.functions if not cost.calls]
        if never:
            lines += ["", "Not called: " + ", ".join(f"`{name}`" for name in never)]
        if node.missing:
            lines += [
                "",
                "Not wrapped: " + "; ".join(f"{k} ({v})" for k, v in node.missing.items()),
            ]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.func_costs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shape", type=Shape.parse, default=Shape(wait=True, rows=1))
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--functions", nargs="+", default=list(FUNCTIONS))
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument(
        "--scratch", type=Path, help="where the cluster and request files go (default: temp)"
    )
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error("--seconds > 0")
    header, nodes = measure(args.shape, args.seconds, args.functions, args.scratch)
    common.print_report("bench.func_costs", argv, report(header, nodes), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
