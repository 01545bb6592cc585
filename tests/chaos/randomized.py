"""The seeded randomised run: three real nodes, a random client workload and random faults.

Workload (threads, all through `api_clients`): group 2 table `s2k` (keyed) with a waiting
and a pipelining writer and a `persistOffset=True` subscriber; group 3 table `s3u`
(unkeyed) with a waiting and a pipelining writer and an offset committer; two churn clients
creating (in group 2 or 3), dropping and appending to the tables `c0` and `c1`.

Faults, one at a time in a random order with random pauses: kill -9 of one node or of all
three, SIGSTOP/SIGCONT, SIGTERM + restart of one node or of all three, a restart under a
low open-files limit (and back), and a full data disk on the node whose persistenceDir is
a small tmpfs (8 MiB, grown when freed, and before a fault whenever less than 8 MiB of it is
free: only the disk-full fault fills it). After every fourth fault the run waits until the
cluster is whole again (a barrier applied everywhere, groups healthy), so a stuck group is
reported near the fault that caused it. Only the client threads, pysyncobj and the OS
scheduler are not under the seed; the choice and order of faults and operations are.

    python -m tests.chaos.run random --minutes 30 --seed 7
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from deploy.local_cluster import LocalCluster
from tests.chaos import faults, verify
from tests.chaos.faults import MIB
from tests.chaos.scenario import Scenario, hold_less_log
from tests.chaos.workload import (
    AckedWriter,
    AioWriter,
    OffsetCommitter,
    PipelinedWriter,
    ReadProbe,
    SubscriberProbe,
    TableChurn,
    TableGroupsWatcher,
)

GROUPS: Final = (2, 3)
CHURN_NAMES: Final = ("c0", "c1")
DISK_BYTES: Final = 8 * MIB
DISK_HEADROOM_BYTES: Final = 8 * MIB  # node3's disk is grown when less is free (not a fault)
FD_MARGIN_MIN: Final = 8
FD_MARGIN_MAX: Final = 48
WHOLE_EVERY_FAULTS: Final = 4  # then wait until the cluster is whole again

# A node whose Raft log or checkpoint is damaged rebuilds it from its peers by itself.
AUTO_REJOIN = ("streamingAutoRejoin=true",)


def _victim(scenario: Scenario) -> str:
    return scenario.rng.choice(sorted(scenario.cluster.nodes))


def _kill_one(scenario: Scenario) -> None:
    victim = _victim(scenario)
    scenario.kill(victim)
    scenario.hold(scenario.rng.uniform(0.0, 3.0))
    scenario.start(victim)


def _kill_all(scenario: Scenario) -> None:
    for alias in sorted(scenario.cluster.nodes):
        scenario.kill(alias)
    scenario.hold(scenario.rng.uniform(0.0, 2.0))
    scenario.start_all(sorted(scenario.cluster.nodes))


def _stop_one(scenario: Scenario) -> None:
    with scenario.frozen(_victim(scenario)):
        scenario.hold(scenario.rng.uniform(1.0, 6.0))


def _restart_one(scenario: Scenario) -> None:
    victim = _victim(scenario)
    scenario.terminate(victim)
    scenario.start(victim)


def _restart_all(scenario: Scenario) -> None:
    for alias in sorted(scenario.cluster.nodes):
        scenario.terminate(alias)
    scenario.start_all(sorted(scenario.cluster.nodes))


def _low_fd(scenario: Scenario) -> None:
    """Restart a node with only a few spare file descriptors, let the churn open tables on
    it, then restart it normally."""
    victim = _victim(scenario)
    limit = faults.open_files(scenario.cluster.pid(victim)) + scenario.rng.randint(
        FD_MARGIN_MIN, FD_MARGIN_MAX
    )
    scenario.terminate(victim)
    scenario.start(victim, nofile=limit)
    scenario.hold(scenario.rng.uniform(3.0, 8.0))
    scenario.check_alive()
    scenario.terminate(victim)
    scenario.start(victim)


def _disk_full(scenario: Scenario) -> None:
    (alias,) = scenario.disks
    scenario.disk_full(alias, scenario.rng.uniform(2.0, 5.0))


FAULTS: Final[dict[str, tuple[float, Callable[[Scenario], None]]]] = {
    # name: (weight, action)
    "kill": (3, _kill_one),
    "kill-all": (1, _kill_all),
    "stop": (2, _stop_one),
    "restart": (2, _restart_one),
    "restart-all": (1, _restart_all),
    "low-fd": (1, _low_fd),
    "disk-full": (1.5, _disk_full),
}


@dataclass(frozen=True, slots=True)
class RandomResult:
    seed: int
    elapsed_s: float
    faults: int
    acked_rows: int
    problems: tuple[str, ...]
    report: str

    @property
    def passed(self) -> bool:
        return not self.problems


def setup(scenario: Scenario) -> None:
    scenario.create_table("s2k", 2, keyed=True)
    scenario.create_table("s3u", 3, keyed=False)
    scenario.barrier_tables = {2: "s2k", 3: "s3u"}
    scenario.stable_tables = ["s2k", "s3u"]

    def rng() -> random.Random:
        return random.Random(scenario.rng.random())

    cluster, ledger = scenario.cluster, scenario.ledger
    scenario.workers = [
        AckedWriter("w1", cluster, ledger, rng(), table="s2k", writer=1, keyed=True),
        PipelinedWriter("w2", cluster, ledger, rng(), table="s2k", writer=2),
        AckedWriter("w3", cluster, ledger, rng(), table="s3u", writer=3),
        PipelinedWriter("w4", cluster, ledger, rng(), table="s3u", writer=4),
        AioWriter("w5", cluster, ledger, rng(), table="s2k", writer=5, keyed=True),
        OffsetCommitter("commits", cluster, ledger, rng(), table="s3u"),
        TableChurn("churn1", cluster, ledger, rng(), names=CHURN_NAMES, writer=10),
        TableChurn("churn2", cluster, ledger, rng(), names=CHURN_NAMES, writer=11),
        ReadProbe("reads", cluster, ledger, rng(), tables=("s2k", "s3u")),
        TableGroupsWatcher("groups", cluster, ledger, rng()),
    ]
    scenario.subscribers = [SubscriberProbe(cluster, "s2k")]
    scenario.start_workload()


def run_random(
    seed: int,
    *,
    duration_s: float,
    root: Path | None = None,
    disks: bool = True,
    fault_names: Collection[str] | None = None,
    purge_interval_s: float | None = None,
    journal_resident_bytes: int | None = None,
) -> RandomResult:
    """Faults (`fault_names`, default all of FAULTS) for `duration_s` under the workload,
    then the final check. `disks`: node3's data on an 8 MiB tmpfs (needs root), for the
    disk-full fault. `purge_interval_s`: the cluster's checkpoint interval (default drawn
    from 1, 2 and 5 s); a long one (600) leaves checkpoints to the log's size, so restarts
    replay long logs. `journal_resident_bytes`: the nodes' Raft journals hold this many
    command bytes in memory (raftstore/tuning.py; default 96 MiB), so a small one has
    replays and lagging followers read entries back from the journal files."""
    rng = random.Random(seed)
    root = root or Path(tempfile.mkdtemp(prefix="chaos-random-"))
    started = time.monotonic()
    drawn = rng.choice((1.0, 2.0, 5.0))  # drawn either way: a seed's later draws stay put
    purge_interval_s = drawn if purge_interval_s is None else purge_interval_s
    cluster = LocalCluster(
        root / "cluster",
        size=3,
        groups=GROUPS,
        purge_interval_s=purge_interval_s,
        extra_config=AUTO_REJOIN,
    )
    hold_less_log(cluster, journal_resident_bytes)
    scenario = Scenario(cluster, rng, seed)
    scenario.note(
        f"seed={seed} purge_interval_s={purge_interval_s} "
        f"journal_resident_bytes={journal_resident_bytes} disks={disks} logs={root}"
    )
    wanted = set(FAULTS if fault_names is None else fault_names)
    assert wanted <= set(FAULTS), f"unknown faults {wanted - set(FAULTS)}"
    available = {
        name: entry
        for name, entry in FAULTS.items()
        if name in wanted and (disks or name != "disk-full")
    }
    names = sorted(available)
    weights = [available[name][0] for name in names]
    problems: list[str] = []
    count = 0
    try:
        if disks:
            scenario.mount_disks(["node3"], DISK_BYTES)
        cluster.start()
        setup(scenario)
        while time.monotonic() - started < duration_s:
            scenario.keep_headroom(DISK_HEADROOM_BYTES)
            name = rng.choices(names, weights=weights)[0]
            scenario.note(f"fault {count + 1}: {name}")
            available[name][1](scenario)
            count += 1
            scenario.check_alive()
            if count % WHOLE_EVERY_FAULTS == 0:  # a stuck group is found near its cause
                verify.wait_healthy(
                    cluster, scenario.barrier_tables, expected_up=scenario.expected_up()
                )
                scenario.note("whole again: every replica applied a barrier, groups healthy")
            scenario.hold(rng.uniform(0.5, 2.5))
            scenario.check_alive()
        scenario.heal()
        problems += scenario.final_check(churn_names=CHURN_NAMES)
    except AssertionError as error:  # NodeDied, a timeout
        problems.append(f"after {count} faults: {error}")
        problems += scenario.after_failure()
    finally:
        scenario.close()
    return RandomResult(
        seed=seed,
        elapsed_s=time.monotonic() - started,
        faults=count,
        acked_rows=scenario.ledger.acked_rows(),
        problems=tuple(problems),
        report=scenario.report(problems, title=f"random run, {count} faults"),
    )
