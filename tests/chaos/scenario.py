"""A chaos scenario: a real local cluster (optionally with a tmpfs data disk per node), the
seeded random source, the client workload, the faults' bookkeeping and the final check.

Shared by the randomised run (`randomized.py`) and the fault campaign (`campaign.py`).
Nodes the scenario takes down on purpose are in `down`; any other node that is not running
is a node that died on its own, which is a failure (with its log lines in the report).
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Final

from api_clients import Session
from deploy.local_cluster import LocalCluster, wait_until
from raftstore import tuning
from tests.chaos import model, verify
from tests.chaos.faults import MIB, Tmpfs
from tests.chaos.workload import (
    KEY_COLUMN,
    SCHEMA,
    ReadProbe,
    SubscriberProbe,
    TableGroupsWatcher,
    Worker,
    session_for,
)

log = logging.getLogger(__name__)

SUBSCRIBER_CATCH_UP_S: Final = 60.0
NODE_READY_S: Final = 60.0
HOLD_POLL_S: Final = 0.1
HOLD_SLACK_S: Final = 10.0


def hold_less_log(cluster: LocalCluster, journal_resident_bytes: int | None) -> None:
    """Before the nodes start: their Raft journals hold `journal_resident_bytes` of
    commands in memory (raftstore/tuning.py; None: the product's 96 MiB), so replays and
    lagging followers read entries back from the journal files after a few MB."""
    if journal_resident_bytes is not None:
        tuned = f"journal_resident_bytes={journal_resident_bytes}"
        cluster.environment[tuning.ENVIRONMENT_VARIABLE] = tuned


@dataclass
class Scenario:
    cluster: LocalCluster
    rng: random.Random
    seed: int
    disks: dict[str, Tmpfs] = field(default_factory=dict)
    down: set[str] = field(default_factory=set)  # taken down by the scenario
    notes: list[str] = field(default_factory=list)
    ledger: model.Ledger = field(default_factory=model.Ledger)
    workers: list[Worker] = field(default_factory=list)
    subscribers: list[SubscriberProbe] = field(default_factory=list)
    barrier_tables: dict[int, str] = field(default_factory=dict)  # group -> a stable table
    stable_tables: list[str] = field(default_factory=list)
    _started_s: float = field(default_factory=time.monotonic)

    # --- bookkeeping ---

    def note(self, text: str) -> None:
        line = f"[{time.monotonic() - self._started_s:7.1f}s] {text}"
        log.info("chaos %s", line)
        self.notes.append(line)

    def expected_up(self) -> list[str]:
        return [alias for alias in self.cluster.nodes if alias not in self.down]

    def check_alive(self) -> None:
        verify.check_alive(self.cluster, self.expected_up())

    # --- processes ---

    def kill(self, alias: str) -> None:
        self.note(f"kill -9 {alias}")
        self.down.add(alias)
        self.cluster.kill(alias)

    def terminate(self, alias: str) -> None:
        self.note(f"SIGTERM {alias}")
        self.down.add(alias)
        code = self.cluster.terminate(alias)
        if code not in (0, -signal.SIGTERM):
            self.note(f"{alias} exit code after SIGTERM: {code}")

    def start(self, alias: str, *, nofile: int | None = None) -> None:
        limit = "" if nofile is None else f" under nofile={nofile}"
        self.note(f"start {alias}{limit}")
        self.cluster.start_node(alias, wait=False, nofile=nofile)
        self.down.discard(alias)
        self._wait_ready(alias, limit)

    def start_all(self, aliases: list[str]) -> None:
        """Start every node of `aliases`, then wait for each: after a whole-cluster outage a
        node whose last state was a repair (a leader's checkpoint installed, rows still to
        fetch) is ready only once a peer can send them."""
        for alias in aliases:
            self.note(f"start {alias}")
            self.cluster.start_node(alias, wait=False)
            self.down.discard(alias)
        for alias in aliases:
            self._wait_ready(alias, "")

    def _wait_ready(self, alias: str, limit: str) -> None:
        try:
            self.cluster.wait_node_ready(alias, timeout_s=NODE_READY_S)
        except AssertionError:
            raise verify.NodeDied(
                f"{alias} did not come up{limit}\n{verify.diagnostics(self.cluster, [alias])}"
            ) from None

    def freeze(self, alias: str) -> None:
        self.note(f"SIGSTOP {alias}")
        self.cluster.signal(alias, signal.SIGSTOP)

    def thaw(self, alias: str) -> None:
        self.note(f"SIGCONT {alias}")
        self.cluster.signal(alias, signal.SIGCONT)

    @contextmanager
    def frozen(self, alias: str) -> Iterator[None]:
        self.freeze(alias)
        try:
            yield
        finally:
            self.thaw(alias)

    def hold(self, seconds: float) -> None:
        """Keep a fault in place for `seconds` (a fault's duration, not a synchronisation),
        watching meanwhile that every node the scenario keeps up stays up: one that dies is
        reported at once (NodeDied), not after the fault."""
        end = time.monotonic() + seconds

        def held() -> bool:
            self.check_alive()
            return time.monotonic() >= end

        wait_until(
            held,
            timeout_s=seconds + HOLD_SLACK_S,
            interval_s=HOLD_POLL_S,
            message=f"a fault held for {seconds:.1f}s",
            fatal=(verify.NodeDied,),
        )

    def leader(self, group: int) -> str:
        return self.cluster.leader(group, timeout_s=60)

    def follower(self, group: int) -> str:
        leader = self.leader(group)
        return self.rng.choice([alias for alias in self.cluster.alive() if alias != leader])

    def session(self) -> Session:
        return session_for(self.cluster)

    # --- disks ---

    def mount_disks(self, aliases: list[str], size_bytes: int) -> None:
        """A tmpfs of `size_bytes` at each node's persistenceDir (before the nodes start)."""
        for alias in aliases:
            disk = Tmpfs(self.cluster.persistence_dir(alias), size_bytes)
            disk.mount()
            self.disks[alias] = disk

    def disk_full(self, alias: str, seconds: float) -> None:
        disk = self.disks[alias]
        written = disk.fill()
        self.note(f"disk full on {alias} ({written // MIB} MiB filler, {disk.free_bytes()} B free)")
        self.hold(seconds)
        disk.free()
        self.note(f"disk freed on {alias} (grown to {disk.size_bytes // MIB} MiB)")

    def keep_headroom(self, headroom_bytes: int) -> None:
        """Grow a disk that the workload itself has nearly filled, as an operator watching
        it would: only the disk-full fault is meant to fill a disk. Without this a long run
        whose faults never grew node3's small tmpfs fills it under the writers, and the node
        then (rightly) stays unready until the end, which the run would report as stuck."""
        for alias, disk in self.disks.items():
            free = disk.free_bytes()
            if free < headroom_bytes:
                disk.resize(disk.size_bytes + headroom_bytes)
                self.note(
                    f"disk headroom on {alias}: {free} B free, grown to "
                    f"{disk.size_bytes // MIB} MiB"
                )

    # --- workload ---

    def create_table(self, name: str, group: int, *, keyed: bool) -> None:
        with self.session() as session:
            session.haStreamTable(group, SCHEMA, name, 10_000, KEY_COLUMN if keyed else None)
        self.note(f"created {name} in group {group} keyed={keyed}")

    def wait_rows(self, rows: int, timeout_s: float = 60) -> None:
        """Until every replica of each stable table holds at least `rows` rows."""
        wait_until(
            lambda: all(
                self.cluster.row_count(alias, table) >= rows
                for table in self.stable_tables
                for alias in self.cluster.alive()
            ),
            timeout_s=timeout_s,
            message=f"{rows} rows in {self.stable_tables} on every replica",
        )
        self.note(f"warmed up: >= {rows} rows per table")

    def start_workload(self) -> None:
        for worker in self.workers:
            worker.start()

    def stop_workload(self) -> list[str]:
        problems: list[str] = []
        for worker in self.workers:
            worker.stop()
            problems += worker.unexpected
            last = f" (last: {worker.last_error})" if worker.last_error else ""
            self.note(f"{worker.name}: {worker.calls} calls, {worker.errors} failed{last}")
        return problems

    def close(self) -> None:
        for subscriber in self.subscribers:
            subscriber.close()
        for worker in self.workers:
            worker.stop(timeout_s=10)
        self.cluster.stop()
        for disk in self.disks.values():
            disk.unmount()

    # --- the end ---

    def heal(self) -> None:
        """Start every node the scenario took down."""
        if self.down:
            self.start_all(sorted(self.down))

    def final_check(self, *, churn_names: tuple[str, ...] = ()) -> list[str]:
        """Stop the workload, settle, and check everything (see `model`). Returns problems."""
        problems = self.stop_workload()
        self.check_alive()
        if self.down:
            problems.append(f"nodes still down at the end: {sorted(self.down)}")
        verify.wait_healthy(self.cluster, self.barrier_tables, expected_up=self.expected_up())
        final_rows: dict[str, list[int]] = {}
        for table in self.stable_tables:
            rows, found = self._check_table(table)
            problems += found
            final_rows[table] = rows
        for subscriber in self.subscribers:
            problems += self._check_subscriber(subscriber, final_rows.get(subscriber.table, []))
        problems += self._check_reads(final_rows)
        for watcher in self.workers:
            if isinstance(watcher, TableGroupsWatcher) and watcher.seen_in_two_groups:
                seen = watcher.seen_in_two_groups
                problems.append(f"a table was in two groups at once {len(seen)} times: {seen[:3]}")
        for name in churn_names:
            problems += self._check_churn_table(name)
        for commit_topic in sorted({commit.topic for commit in self.ledger.commits}):
            offsets = {
                alias: verify.topic_offset(self.cluster, alias, commit_topic)
                for alias in self.cluster.alive()
            }
            problems += model.check_committed_offset(
                commit_topic, offsets, self.ledger.commits_of(commit_topic)
            )
        for alias in self.cluster.alive():
            problems += verify.health_problems(self.cluster, alias)
        return problems

    def _replica_rows(self, table: str) -> dict[str, list[int] | None]:
        return {
            alias: verify.read_keys(self.cluster, alias, table) for alias in self.cluster.alive()
        }

    def _check_table(self, table: str) -> tuple[list[int], list[str]]:
        replicas = self._replica_rows(table)
        missing = [alias for alias, rows in replicas.items() if rows is None]
        if missing:
            return [], [f"{table}: missing on {missing}"]
        present = {alias: rows for alias, rows in replicas.items() if rows is not None}
        problems = model.check_replicas_identical(table, present)
        reference = present[min(present)]
        appends = self.ledger.appends_of(table)
        problems += model.check_rows(table, reference, appends, self.ledger.drops_of(table))
        acked = sum(append.count for append in appends if append.outcome is model.Outcome.ACKED)
        lengths = {alias: len(rows) for alias, rows in sorted(present.items())}
        self.note(f"{table}: rows per replica {lengths}, {acked} acknowledged")
        return reference, problems

    def _check_subscriber(self, subscriber: SubscriberProbe, rows: list[int]) -> list[str]:
        with contextlib.suppress(AssertionError):  # reported below with what it delivered
            wait_until(
                lambda: subscriber.delivered_rows() >= len(rows) or subscriber.error is not None,
                timeout_s=SUBSCRIBER_CATCH_UP_S,
                message="subscriber caught up",
            )
        problems = model.check_subscriber(subscriber.table, subscriber.snapshot(), rows)
        delivered = subscriber.delivered_rows()
        if subscriber.error is not None:
            problems.append(f"{subscriber.table}: subscription ended: {subscriber.error!r}")
        elif delivered < len(rows):
            problems.append(
                f"{subscriber.table}: subscriber delivered {delivered} of {len(rows)} rows "
                f"after {SUBSCRIBER_CATCH_UP_S:.0f}s"
            )
        self.note(f"{subscriber.table}: subscriber delivered {delivered} rows")
        return problems

    def _check_reads(self, final_rows: dict[str, list[int]]) -> list[str]:
        problems: list[str] = []
        for probe in self.workers:
            if not isinstance(probe, ReadProbe):
                continue
            for table, history in sorted(probe.histories.items()):
                errors = dict(history.errors)
                self.note(f"{table}: {history.reads} replica reads during the run, errors {errors}")
                problems += history.check(final_rows.get(table, []))
        return problems

    def _check_churn_table(self, name: str) -> list[str]:
        problems: list[str] = []
        listed = {
            alias: verify.table_groups(self.cluster, alias).get(name, [])
            for alias in self.cluster.alive()
        }
        if len({tuple(groups) for groups in listed.values()}) > 1:
            problems.append(f"{name}: nodes disagree on its groups: {listed}")
        for alias, groups in listed.items():
            if len(groups) > 1:
                problems.append(f"{name}: exists in groups {groups} at once on {alias}")
        replicas = self._replica_rows(name)
        present = {alias: rows for alias, rows in replicas.items() if rows is not None}
        if present and len(present) != len(replicas):
            problems.append(f"{name}: exists on {sorted(present)} only")
        problems += model.check_replicas_identical(name, present)
        rows = present[min(present)] if present else []
        problems += model.check_rows(
            name, rows, self.ledger.appends_of(name), self.ledger.drops_of(name)
        )
        self.note(f"{name}: {'absent' if not present else f'{len(rows)} rows'} at the end")
        return problems

    def after_failure(self) -> list[str]:
        """After a failed round: restart each node that died once (does it come back, or
        crash-loop?), then, if a majority runs, check the data the survivors hold."""
        problems: list[str] = []
        dead = [alias for alias in self.expected_up() if self.cluster.exit_code(alias) is not None]
        for alias in dead:
            try:
                self.start(alias)
                verify.wait_healthy(
                    self.cluster, self.barrier_tables, expected_up=self.expected_up(), timeout_s=30
                )
                self.note(f"{alias} came back after a restart")
            except verify.NodeDied as error:
                self.down |= {
                    a for a in self.expected_up() if self.cluster.exit_code(a) is not None
                }
                problems.append(f"{alias} fails again on restart (crash loop): {error}")
            except AssertionError as error:
                problems.append(f"{alias} restarted but the cluster is not healthy: {error}")
        if dead and len(self.cluster.alive()) * 2 > len(self.cluster.nodes):
            try:
                found = self.final_check()
            except AssertionError as error:
                found = [f"{error}"]
            return problems + [f"after the failure: {problem}" for problem in found]
        # The cluster cannot settle: still, no replica may have diverged or lost a row.
        found = self.unsettled_data_check()
        return problems + [f"after the failure (unsettled): {problem}" for problem in found]

    def unsettled_data_check(self) -> list[str]:
        """Without a barrier: stop the workload, read each stable table from every running
        node; replicas may lag (prefixes of each other) but not diverge, and the longest
        must hold every acknowledged row once, in writer order."""
        problems = self.stop_workload()
        for table in self.stable_tables:
            replicas: dict[str, list[int]] = {}
            for alias in self.cluster.alive():
                try:
                    keys = verify.read_keys(self.cluster, alias, table, timeout_s=10)
                except AssertionError as error:  # a replica that refuses reads for good
                    self.note(f"{table}: no read from {alias}: {error}")
                    continue
                if keys is not None:
                    replicas[alias] = keys
            if not replicas:
                problems.append(f"{table}: no replica could be read")
                continue
            longest_alias = max(replicas, key=lambda alias: len(replicas[alias]))
            longest = replicas[longest_alias]
            for alias, keys in sorted(replicas.items()):
                offset = model.first_difference(keys, longest)
                if offset is not None:
                    problems.append(
                        f"{table}: {alias} and {longest_alias} diverge from offset {offset}"
                    )
            lengths = {alias: len(keys) for alias, keys in sorted(replicas.items())}
            self.note(f"{table}: replica lengths (unsettled) {lengths}")
            problems += model.check_rows(
                table, longest, self.ledger.appends_of(table), self.ledger.drops_of(table)
            )
        return problems

    def report(self, problems: list[str], *, title: str) -> str:
        lines = [f"{title} seed={self.seed}: {len(problems)} problem(s)"]
        lines += [f"  - {problem}" for problem in problems]
        lines.append("events:")
        lines += [f"  {note}" for note in self.notes[-80:]]
        return "\n".join(lines)
