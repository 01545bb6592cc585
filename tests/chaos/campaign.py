"""The fault campaign: rounds of one fault class against a real cluster under load.

Load, for the whole run: group 2 holds `acked` (keyed), written by a writer that waits for
each acknowledgement (and resends a failed batch with the same keys) and read by a
`persistOffset=True` subscriber; group 3 holds `piped` (unkeyed), written by a pipelining
writer (`append_async`) and a waiting one. Checkpoints every 2 s, so the checkpoint files
exist and the journal is purged while the faults happen.

A round injects one fault, holds it, heals it, then waits until the cluster is whole again
(every node up, leaders, every replica applied all that was committed, groups healthy).
After the last round the workload stops and `Scenario.final_check` reads every replica.

    python -m tests.chaos.run campaign --rounds 20 --nodes 3 5      # the long run
"""

from __future__ import annotations

import enum
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from deploy.local_cluster import LocalCluster, wait_until
from raftstore.storage.journal import live_segments
from tests.chaos import faults, verify
from tests.chaos.faults import MIB, Flip
from tests.chaos.scenario import Scenario, hold_less_log
from tests.chaos.workload import AckedWriter, PipelinedWriter, ReadProbe, SubscriberProbe

GROUPS: Final = (2, 3)
PURGE_INTERVAL_S: Final = 2.0
DISK_BYTES: Final = 64 * MIB
STOP_HOLD_S: Final = 6.0
DISK_FULL_HOLD_S: Final = 4.0
ROUND_SETTLE_S: Final = 45.0
WARM_UP_ROWS: Final = 300  # on every replica of each table before the first round
LOAD_BETWEEN_ROUNDS_S: Final = (0.5, 1.5)

# A node whose Raft log or checkpoint is damaged rebuilds it from its peers by itself.
AUTO_REJOIN = ("streamingAutoRejoin=true",)


class FaultClass(enum.Enum):
    KILL_RANDOM = "kill-random"
    KILL_LEADER = "kill-leader"
    KILL_TWO = "kill-two"  # two of five nodes at once
    STOP_LEADER = "stop-leader"
    STOP_FOLLOWER = "stop-follower"
    FLIP_DATA = "flip-data"
    FLIP_HEADER = "flip-header"
    FLIP_CHECKPOINT = "flip-checkpoint"
    FLIP_JOURNAL = "flip-journal"
    DISK_FULL_LEADER = "disk-full-leader"
    DISK_FULL_FOLLOWER = "disk-full-follower"
    MIX = "mix"

    @property
    def needs_disks(self) -> bool:
        """Whether every round needs tmpfs data disks (MIX uses them when there are)."""
        return self in (FaultClass.DISK_FULL_LEADER, FaultClass.DISK_FULL_FOLLOWER)

    def fits(self, nodes: int) -> bool:
        return self is not FaultClass.KILL_TWO or nodes >= 5


def _kill_random(scenario: Scenario) -> None:
    victim = scenario.rng.choice(list(scenario.cluster.nodes))
    scenario.kill(victim)
    scenario.hold(scenario.rng.uniform(0.5, 3.0))
    scenario.start(victim)


def _kill_leader(scenario: Scenario) -> None:
    victim = scenario.leader(scenario.rng.choice(GROUPS))
    scenario.kill(victim)
    scenario.hold(scenario.rng.uniform(0.5, 3.0))
    scenario.start(victim)


def _kill_two(scenario: Scenario) -> None:
    victims = scenario.rng.sample(sorted(scenario.cluster.nodes), 2)
    for victim in victims:
        scenario.kill(victim)
    scenario.hold(scenario.rng.uniform(0.5, 3.0))
    for victim in victims:
        scenario.start(victim)


def _stop_leader(scenario: Scenario) -> None:
    with scenario.frozen(scenario.leader(scenario.rng.choice(GROUPS))):
        scenario.hold(STOP_HOLD_S)


def _stop_follower(scenario: Scenario) -> None:
    with scenario.frozen(scenario.follower(scenario.rng.choice(GROUPS))):
        scenario.hold(STOP_HOLD_S)


def _flip_on_stopped_node(scenario: Scenario, flip: Callable[[str, int], Flip | None]) -> None:
    """Stop a random node (SIGTERM), damage one of its files (of a random group that has
    one), start it again."""
    victim = scenario.rng.choice(list(scenario.cluster.nodes))
    scenario.terminate(victim)
    flipped = None
    for group in scenario.rng.sample(GROUPS, len(GROUPS)):
        flipped = flip(victim, group)
        if flipped is not None:
            break
    scenario.note(f"flipped {flipped}" if flipped else f"nothing to flip on {victim}")
    scenario.start(victim)


def _flip_data(scenario: Scenario) -> None:
    def flip(alias: str, group: int) -> Flip | None:
        segments = faults.segment_files(scenario.cluster.persistence_dir(alias), group)
        return faults.flip_segment_payload(scenario.rng, segments)

    _flip_on_stopped_node(scenario, flip)


def _flip_header(scenario: Scenario) -> None:
    def flip(alias: str, group: int) -> Flip | None:
        segments = faults.segment_files(scenario.cluster.persistence_dir(alias), group)
        return faults.flip_segment_header(scenario.rng, segments)

    _flip_on_stopped_node(scenario, flip)


def _flip_checkpoint(scenario: Scenario) -> None:
    def flip(alias: str, group: int) -> Flip | None:
        path = scenario.cluster.ha_dir(alias) / f"group-{group}" / "checkpoint"
        return faults.flip_anywhere(scenario.rng, path, "checkpoint")

    # Every node checkpoints every PURGE_INTERVAL_S while entries arrive.
    wait_until(
        lambda: all(
            (scenario.cluster.ha_dir(alias) / f"group-{group}" / "checkpoint").exists()
            for alias in scenario.cluster.nodes
            for group in GROUPS
        ),
        timeout_s=60,
        message="checkpoint files written",
    )
    _flip_on_stopped_node(scenario, flip)


def _flip_journal(scenario: Scenario) -> None:
    def flip(alias: str, group: int) -> Flip | None:
        segments = live_segments(scenario.cluster.ha_dir(alias) / f"group-{group}")
        return faults.flip_journal_entry(scenario.rng, segments)

    _flip_on_stopped_node(scenario, flip)


def _disk_full_leader(scenario: Scenario) -> None:
    scenario.disk_full(scenario.leader(scenario.rng.choice(GROUPS)), DISK_FULL_HOLD_S)


def _disk_full_follower(scenario: Scenario) -> None:
    scenario.disk_full(scenario.follower(scenario.rng.choice(GROUPS)), DISK_FULL_HOLD_S)


ROUNDS: Final[dict[FaultClass, Callable[[Scenario], None]]] = {
    FaultClass.KILL_RANDOM: _kill_random,
    FaultClass.KILL_LEADER: _kill_leader,
    FaultClass.KILL_TWO: _kill_two,
    FaultClass.STOP_LEADER: _stop_leader,
    FaultClass.STOP_FOLLOWER: _stop_follower,
    FaultClass.FLIP_DATA: _flip_data,
    FaultClass.FLIP_HEADER: _flip_header,
    FaultClass.FLIP_CHECKPOINT: _flip_checkpoint,
    FaultClass.FLIP_JOURNAL: _flip_journal,
    FaultClass.DISK_FULL_LEADER: _disk_full_leader,
    FaultClass.DISK_FULL_FOLLOWER: _disk_full_follower,
}


def _round(scenario: Scenario, fault: FaultClass, nodes: int) -> FaultClass:
    if fault is FaultClass.MIX:
        choices = [
            c for c in ROUNDS if c.fits(nodes) and (bool(scenario.disks) or not c.needs_disks)
        ]
        fault = scenario.rng.choice(choices)
    ROUNDS[fault](scenario)
    return fault


@dataclass(frozen=True, slots=True)
class CampaignResult:
    fault: FaultClass
    nodes: int
    seed: int
    rounds_done: int
    elapsed_s: float
    acked_rows: int
    problems: tuple[str, ...]
    report: str

    @property
    def passed(self) -> bool:
        return not self.problems


def setup(scenario: Scenario) -> None:
    """The campaign's tables, writers and subscriber (see the module docstring)."""
    scenario.create_table("acked", 2, keyed=True)
    scenario.create_table("piped", 3, keyed=False)
    scenario.barrier_tables = {2: "acked", 3: "piped"}
    scenario.stable_tables = ["acked", "piped"]

    def rng() -> random.Random:
        return random.Random(scenario.rng.random())

    cluster, ledger = scenario.cluster, scenario.ledger
    scenario.workers = [
        AckedWriter("writer-acked", cluster, ledger, rng(), table="acked", writer=1, keyed=True),
        PipelinedWriter("writer-piped", cluster, ledger, rng(), table="piped", writer=2),
        AckedWriter("writer-piped-acked", cluster, ledger, rng(), table="piped", writer=3),
        ReadProbe("reads", cluster, ledger, rng(), tables=("acked", "piped")),
    ]
    scenario.subscribers = [SubscriberProbe(scenario.cluster, "acked")]
    scenario.start_workload()
    scenario.wait_rows(WARM_UP_ROWS)


def run_campaign(
    fault: FaultClass,
    *,
    nodes: int,
    rounds: int,
    seed: int,
    root: Path | None = None,
    disks: bool = True,
    purge_interval_s: float | None = None,
    journal_resident_bytes: int | None = None,
) -> CampaignResult:
    """`rounds` rounds of `fault` on a fresh `nodes`-node cluster under `root` (a new
    temporary directory by default); returns what was found. `disks`: each node's data
    on its own tmpfs (needs root), for the disk-full rounds. `purge_interval_s` (default
    PURGE_INTERVAL_S) and `journal_resident_bytes`: as randomized.run_random's (long logs,
    read back)."""
    if purge_interval_s is None:
        purge_interval_s = PURGE_INTERVAL_S
    assert fault.fits(nodes), f"{fault.value} needs 5 nodes"
    assert disks or not fault.needs_disks, f"{fault.value} needs tmpfs data disks"
    root = root or Path(tempfile.mkdtemp(prefix=f"chaos-{fault.value}-"))
    started = time.monotonic()
    cluster = LocalCluster(
        root / "cluster",
        size=nodes,
        groups=GROUPS,
        purge_interval_s=purge_interval_s,
        extra_config=AUTO_REJOIN,
    )
    hold_less_log(cluster, journal_resident_bytes)
    scenario = Scenario(cluster, random.Random(seed), seed)
    scenario.note(
        f"seed={seed} nodes={nodes} purge_interval_s={purge_interval_s} "
        f"journal_resident_bytes={journal_resident_bytes} logs={root}"
    )
    problems: list[str] = []
    done = 0
    try:
        if disks and (fault.needs_disks or fault is FaultClass.MIX):
            scenario.mount_disks(sorted(cluster.nodes), DISK_BYTES)
        cluster.start()
        setup(scenario)
        for number in range(rounds):
            scenario.note(f"round {number + 1}/{rounds}: {fault.value}")
            chosen = _round(scenario, fault, nodes)
            if chosen is not fault:
                scenario.note(f"  (mix chose {chosen.value})")
            verify.wait_healthy(
                cluster,
                scenario.barrier_tables,
                expected_up=scenario.expected_up(),
                timeout_s=ROUND_SETTLE_S,
            )
            done += 1
            scenario.hold(scenario.rng.uniform(*LOAD_BETWEEN_ROUNDS_S))  # rows for the next
        problems += scenario.final_check()
    except AssertionError as error:  # NodeDied, a timeout: the round's finding
        problems.append(f"round {done + 1}: {error}")
        problems += scenario.after_failure()
    finally:
        scenario.close()
    report = scenario.report(problems, title=f"campaign {fault.value} nodes={nodes} rounds={done}")
    return CampaignResult(
        fault=fault,
        nodes=nodes,
        seed=seed,
        rounds_done=done,
        elapsed_s=time.monotonic() - started,
        acked_rows=scenario.ledger.acked_rows(),
        problems=tuple(problems),
        report=report,
    )
