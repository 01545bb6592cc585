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
import shutil
import tempfile
import time
from pathlib import Path

from bench import common
from deploy.local_cluster import LocalCluster


def measure(groups: int, seconds: float) -> dict[str, tuple[float, float]]:
    """alias -> (cores, wake-ups per second) of each node over `seconds` of idleness."""
    root = Path(tempfile.mkdtemp(prefix="hastream-idle-"))
    cluster = LocalCluster(root, groups=tuple(range(2, 2 + groups)))
    try:
        cluster.start()
        for group in cluster.groups:
            cluster.leader(group)
        time.sleep(1.0)  # the first heartbeats and checkpoints after the elections settle
        pids = common.node_pids(cluster)
        before = {alias: common.thread_counters(pid) for alias, pid in pids.items()}
        started = time.perf_counter()
        time.sleep(seconds)  # the measurement itself: nothing else runs meanwhile
        after = {alias: common.thread_counters(pid) for alias, pid in pids.items()}
        wall_s = time.perf_counter() - started
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    result = {}
    for alias in pids:
        cpu_s = switches = 0.0
        for tid, counters in after[alias].items():
            earlier = before[alias].get(tid)
            if earlier is not None:
                cpu_s += counters.cpu_s - earlier.cpu_s
                switches += counters.switches - earlier.switches
        result[alias] = (cpu_s / wall_s, switches / wall_s)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.idle", description=__doc__)
    parser.add_argument("--groups", type=int, default=2, help="Raft groups (ids 2, 3, ...)")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    result = measure(args.groups, args.seconds)
    code = common.code_version()
    print(f"idle cluster, {args.groups} Raft group(s), {args.seconds:g} s, code {code}")
    print("| node | CPU, cores | wake-ups per second |")
    print("|---|---:|---:|")
    for alias, (cores, wakeups) in sorted(result.items()):
        print(f"| {alias} | {cores:.3f} | {wakeups:,.0f} |")


if __name__ == "__main__":
    main()
