"""The leader's pacing of its followers (raftstore/pacing.py) on a real three-node cluster:
the follower a commit does not need gets waited one-row publishes in batches (its journal's
fdatasyncs, read from its metrics, are bounded by time, not by entries), and freezing
either follower (SIGSTOP) costs the waited publishes neither a failure nor an election."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from api_clients import Session
from deploy.local_cluster import LocalCluster
from raftstore.replication import HOLD_FOLLOWERS_S
from tests.harness import assert_replicas_hold_exactly, wait_until
from tests.ops_helpers import SCHEMA, SteadyPublisher, sample, scrape

pytestmark = pytest.mark.cluster

GROUP = 2
# Longest wait between two acknowledgements while a follower is frozen: the held-back
# follower's batch goes HOLD_FOLLOWERS_S after its first entry; the rest is room for a
# loaded machine. Far below an election (the cluster's timeout is seconds).
FROZEN_GAP_MAX_S = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("pacing"), groups=(GROUP,))
    local.enable_metrics()
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture
def session(cluster: LocalCluster) -> Iterator[Session]:
    with Session([f"127.0.0.1:{node.port}" for node in cluster.nodes.values()]) as opened:
        yield opened


def fsyncs(cluster: LocalCluster, alias: str) -> float:
    families = scrape(cluster.metrics_ports[alias])
    return sample(families, "hastream_raft_fsync_seconds_count", group=str(GROUP)) or 0.0


def terms(cluster: LocalCluster) -> set[int]:
    return {int(cluster.group_status(alias, GROUP)["term"]) for alias in cluster.alive()}


def test_the_follower_a_commit_does_not_need_gets_entries_in_batches(
    cluster: LocalCluster, session: Session
) -> None:
    session.haStreamTable(GROUP, SCHEMA, "paced", cacheLimit=100_000, keyColumn="id")
    leader = cluster.leader(GROUP)
    followers = sorted(alias for alias in cluster.nodes if alias != leader)
    before = {alias: fsyncs(cluster, alias) for alias in followers}
    started = time.monotonic()
    publisher = SteadyPublisher(session, "paced", rows=1, interval_s=0.0).start()
    try:
        wait_until(lambda: len(publisher.acked) >= 1_000, timeout_s=60, message="1,000 appends")
    finally:
        publisher.stop()
    elapsed = time.monotonic() - started
    synced = {alias: fsyncs(cluster, alias) - before[alias] for alias in followers}
    appends = len(publisher.acked)
    assert publisher.failures == []
    # One follower fsyncs once per batch: at most one per HOLD_FOLLOWERS_S (and a few for
    # the table's creation and the heartbeats' commit notices), however many appends.
    bound = 1.5 * elapsed / HOLD_FOLLOWERS_S + 10
    assert min(synced.values()) <= bound, (synced, appends, round(elapsed, 2))
    assert_replicas_hold_exactly(cluster, "paced", publisher.acked)


def test_freezing_either_follower_costs_waited_publishes_no_failure_and_no_election(
    cluster: LocalCluster, session: Session
) -> None:
    session.haStreamTable(GROUP, SCHEMA, "frozen", cacheLimit=100_000, keyColumn="id")
    leader = cluster.leader(GROUP)
    term = terms(cluster)
    assert len(term) == 1
    publisher = SteadyPublisher(session, "frozen", rows=1, interval_s=0.002).start()
    try:
        for follower in sorted(alias for alias in cluster.nodes if alias != leader):
            acked = len(publisher.acked)
            since = time.monotonic()
            cluster.signal(follower, signal.SIGSTOP)
            try:
                wait_until(
                    lambda acked=acked: len(publisher.acked) >= acked + 200,
                    timeout_s=30,
                    message=f"200 appends with {follower} frozen",
                )
                gap = publisher.gaps_since(since)
            finally:
                cluster.signal(follower, signal.SIGCONT)
            assert gap < FROZEN_GAP_MAX_S, (
                f"{follower} frozen: acknowledgements stalled {gap:.3f} s"
            )
    finally:
        publisher.stop()
    assert publisher.failures == []
    assert cluster.leader(GROUP) == leader
    assert terms(cluster) == term, "an election ran"
    assert_replicas_hold_exactly(cluster, "frozen", publisher.acked)
