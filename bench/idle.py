"""What an idle cluster costs: each node's CPU and wake-ups with nothing to do.

    python -m bench.idle [--groups 2] [--seconds 10]

Starts a local three-node cluster with `--groups` Raft groups (2, 3, ...), waits until
every group has a leader, lets it sit idle for a second, then counts over `--seconds`, per
node: the CPU its process used (in cores: 0.05 is 5% of one core) and how often its threads
went to sleep and woke (voluntary and involuntary context switches per second). Each Raft
group runs a tick thread per node, so the cost grows with the groups: on a shared machine
an idle cluster should take next to nothing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import common


def measure(
    groups: int, seconds: float, parent: Path | None = None
) -> dict[str, tuple[float, float]]:
    """alias -> (cores, wake-ups per second) of each node over `seconds` of idleness, on a
    cluster made under `parent` (default: the system's temporary directory) and removed."""
    raft_groups = tuple(range(common.HA_GROUP, common.HA_GROUP + groups))
    with common.bench_cluster(
        purge_interval_s=300.0, election_timeout_s=1.0, groups=raft_groups, parent=parent
    ) as cluster:
        time.sleep(1.0)  # the first heartbeats and checkpoints after the elections settle
        pids = common.node_pids(cluster)
        before = {alias: _counters(pid) for alias, pid in pids.items()}
        started = time.perf_counter()
        time.sleep(seconds)  # the measurement itself: nothing else runs meanwhile
        after = {alias: _counters(pid) for alias, pid in pids.items()}
        wall_s = time.perf_counter() - started
    return {
        alias: (
            (after[alias][0] - before[alias][0]) / wall_s,
            (after[alias][1] - before[alias][1]) / wall_s,
        )
        for alias in pids
    }


def _counters(pid: int) -> tuple[float, int]:
    """The process's CPU seconds and its live threads' context switches so far."""
    return common.cpu_seconds(pid), common.context_switches([pid])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.idle", description=__doc__)
    parser.add_argument("--groups", type=int, default=2, help="Raft groups (ids 2, 3, ...)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the cluster's directory is made"
    )
    args = parser.parse_args(argv)
    result = measure(args.groups, args.seconds, args.dir)
    code = common.code_version()
    print(f"idle cluster, {args.groups} Raft group(s), {args.seconds:g} s, code {code}")
    print("| node | CPU, cores | wake-ups per second |")
    print("|---|---:|---:|")
    for alias, (cores, wakeups) in sorted(result.items()):
        print(f"| {alias} | {cores:.3f} | {wakeups:,.0f} |")


if __name__ == "__main__":
    main()
