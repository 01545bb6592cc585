"""A leader that goes silent instead of dying, under steady publishers and a subscriber on a
real three-node cluster: cut off by the network (each node in its own network namespace,
the leader's bridge port taken down) or frozen (SIGSTOP). Nothing resets its connections,
so only the client's hedge (`api_clients.call_policy.hedge`) gets the publishers and the
subscriber off it before HTTP/2 keepalive or their own deadlines would.

Each case: publishes resume within 2 s of the new leader's election (unary `append`,
pipelined `append_async`, and the subscription's rows), then the old leader comes back
(link up, SIGCONT: with pre-vote it comes back at the term it left, and follows)
and every node agrees on a leader, and every acknowledged row is on every replica exactly
once, in publish order; the subscriber saw every row once, in order.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pytest

from api_clients import AppendResult, Publisher, Session
from deploy import netns
from tests.harness import (
    LocalCluster,
    assert_replicas_hold_exactly,
    wait_replicas_settled,
    wait_until,
)

pytestmark = pytest.mark.cluster

SCHEMA = pa.schema([("id", pa.int64()), ("price", pa.float64())])
ALIASES = ("node1", "node2", "node3")
GROUP = 2
RESUME_S_MAX = 2.0  # from the new leader's election to the first acknowledgement
BATCH_ROWS = 10
DEADLINE_S = 60.0
WAIT_S = 60.0


def batch(first: int, count: int = BATCH_ROWS) -> pa.Table:
    ids = list(range(first, first + count))
    return pa.table({"id": ids, "price": [i * 0.5 for i in ids]}, schema=SCHEMA)


@dataclass
class Acks:
    """Acknowledged ids and when each acknowledgement arrived (monotonic), in order."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def add(self, ids: list[int]) -> None:
        with self.lock:
            self.ids.extend(ids)
            self.times.append(time.monotonic())

    def first_after(self, moment: float) -> float | None:
        with self.lock:
            return next((at for at in self.times if at > moment), None)

    def longest_gap_s(self, start: float) -> float:
        """The longest time between two acknowledgements after `start` (the stall)."""
        with self.lock:
            times = [at for at in self.times if at >= start]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def count(self) -> int:
        with self.lock:
            return len(self.ids)


class Load:
    """A unary publisher and a pipelined one (each its own table, a batch every 20 ms), and
    a subscriber of the unary table, all through one client Session over every node."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.session = Session([node.site for node in cluster.nodes.values()], deadline_s=60)
        self.unary, self.pipelined, self.seen = Acks(), Acks(), Acks()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._unary, name="unary-publisher"),
            threading.Thread(target=self._pipelined, name="pipelined-publisher"),
        ]
        self.submitted = 0

    def start(self) -> None:
        self.subscription = self.session.subscribe(
            "ticks", lambda rows, _: self.seen.add(rows.column("id").to_pylist()), offset=0
        )
        for thread in self.threads:
            thread.start()

    def _unary(self) -> None:
        publisher = Publisher(self.session, "ticks", deadline_s=DEADLINE_S)
        first = 0
        try:
            while not self.stop.wait(0.02):  # paced; until the test stops it
                publisher.append(batch(first))
                self.unary.add(list(range(first, first + BATCH_ROWS)))
                first += BATCH_ROWS
        except BaseException as error:
            self.unary.errors.append(error)

    def _pipelined(self) -> None:
        publisher = Publisher(self.session, "ticks_pipe", deadline_s=DEADLINE_S, max_in_flight=16)
        futures: list[Future[AppendResult]] = []
        try:
            while not self.stop.wait(0.02):  # paced; until the test stops it
                future = publisher.append_async(batch(self.submitted))
                future.add_done_callback(self._acknowledged(self.submitted))
                futures.append(future)
                self.submitted += BATCH_ROWS
            publisher.close()
            for future in futures:
                future.result(timeout=0)  # every request acknowledged, none failed
        except BaseException as error:
            self.pipelined.errors.append(error)

    def _acknowledged(self, first: int) -> Callable[[Future[AppendResult]], None]:
        def done(future: Future[AppendResult]) -> None:  # in request order (driver thread)
            if future.exception() is None:
                self.pipelined.add(list(range(first, first + BATCH_ROWS)))

        return done

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=DEADLINE_S)
        assert not any(thread.is_alive() for thread in self.threads), "publishers did not end"

    def close(self) -> None:
        self.stop.set()
        self.session.close()


Fault = Callable[[str], Callable[[], None]]  # loses the leader; returns how to bring it back


@pytest.fixture(params=["partition", "freeze"])
def faulty_cluster(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[LocalCluster, Fault]]:
    """A started cluster and its fault: `partition` runs every node in its own network
    namespace (skipped without root or `ip netns`), `freeze` SIGSTOPs."""
    network: netns.NamespaceNetwork | None = None
    if request.param == "partition":
        reason = netns.unavailable()
        if reason is not None:
            pytest.skip(f"partition case needs network namespaces: {reason}")
        network = netns.NamespaceNetwork.create(ALIASES)
    try:
        cluster = LocalCluster(
            tmp_path / "cluster",
            hosts=network.hosts() if network is not None else {},
            launch_prefix=network.prefixes() if network is not None else {},
        )
        try:
            cluster.start()

            def fault(alias: str) -> Callable[[], None]:
                if network is not None:
                    network.cut(alias)
                    return lambda: network.heal(alias)
                cluster.signal(alias, signal.SIGSTOP)
                return lambda: cluster.signal(alias, signal.SIGCONT)

            yield cluster, fault
        finally:
            cluster.stop()
    finally:
        if network is not None:
            network.destroy()


def elected(cluster: LocalCluster, lost: str, term_before: int) -> str | None:
    """A survivor that reports itself leader of a newer term, if any."""
    for alias in ALIASES:
        if alias == lost:
            continue
        status = cluster.group_status(alias, GROUP)
        if status["role"] == "leader" and int(status["term"]) > term_before:
            return alias
    return None


def test_publishes_and_the_subscriber_leave_a_silent_leader_within_2s_of_the_election(
    faulty_cluster: tuple[LocalCluster, Fault],
) -> None:
    cluster, fault = faulty_cluster
    cluster.create_table("ticks", SCHEMA)  # no key column: a duplicate would show
    cluster.create_table("ticks_pipe", SCHEMA)
    load = Load(cluster)
    try:
        load.start()
        wait_until(lambda: load.seen.count() >= 200, timeout_s=WAIT_S, message="steady load")
        leader = cluster.leader(GROUP)
        term_before = int(cluster.group_status(leader, GROUP)["term"])
        lost_at = time.monotonic()
        restore = fault(leader)
        try:
            new_leader = wait_until(
                lambda: elected(cluster, leader, term_before),
                timeout_s=WAIT_S,
                interval_s=0.05,
                message="a new leader",
            )
            elected_at = time.monotonic()
            # An answer already on its way when the leader was lost may still arrive after
            # `lost_at`: what counts is the first one after the election.
            resumed = {}
            for name, acks in (("unary", load.unary), ("pipelined", load.pipelined)):
                first = wait_until(
                    lambda acks=acks: acks.first_after(elected_at) or acks.errors,
                    timeout_s=WAIT_S,
                    interval_s=0.02,
                    message=f"{name} publishes acknowledged again",
                )
                assert not isinstance(first, list), f"{name} publisher failed: {first}"
                resumed[name] = first - elected_at
            seen_at = wait_until(
                lambda: load.seen.first_after(elected_at), timeout_s=WAIT_S, interval_s=0.02
            )
            resumed["subscriber"] = seen_at - elected_at
            stalls = {
                name: acks.longest_gap_s(lost_at - 1.0)
                for name, acks in (
                    ("unary", load.unary),
                    ("pipelined", load.pipelined),
                    ("subscriber", load.seen),
                )
            }
            print(
                f"lost {leader} at 0, {new_leader} elected at {elected_at - lost_at:.2f} s; "
                "first after the election: "
                + ", ".join(f"{name} +{after:.2f} s" for name, after in resumed.items())
                + "; stalls: "
                + ", ".join(f"{name} {stall:.2f} s" for name, stall in stalls.items())
            )
            assert all(after <= RESUME_S_MAX for after in resumed.values()), resumed
        finally:
            restore()
        wait_until(  # the old leader is back
            lambda: cluster.leader(GROUP, timeout_s=2),
            timeout_s=WAIT_S,
            message=f"{leader} is back and every node agrees on a leader",
        )
        load.finish()
        assert not load.unary.errors, load.unary.errors
        assert not load.pipelined.errors, load.pipelined.errors
        for table, acks in (("ticks", load.unary), ("ticks_pipe", load.pipelined)):
            wait_replicas_settled(cluster, table, GROUP)
            assert_replicas_hold_exactly(cluster, table, acks.ids, group=GROUP)
            for alias in ALIASES:  # exactly the acknowledged rows, in publish order
                assert cluster.read_table(alias, table).column("id").to_pylist() == acks.ids
        assert load.pipelined.ids == list(range(load.submitted))
        wait_until(
            lambda: load.seen.count() == len(load.unary.ids),
            timeout_s=WAIT_S,
            message="the subscriber saw every row",
        )
        assert load.seen.ids == load.unary.ids  # once each, in order
        assert load.subscription.connections >= 2
    finally:
        load.close()
