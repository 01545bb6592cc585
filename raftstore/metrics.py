"""Prometheus metrics of one node, collected at scrape time from the status it already keeps.

Nothing here runs on the write path: `NodeCollector.collect` reads each group's status, the
replica's latency histograms (stats.py), per-table publish counters, health and topic
offsets when Prometheus scrapes `/metrics` (status_http.py), and builds the families then.
Process RSS, open fds and CPU come from prometheus_client's own ProcessCollector.

Names follow the Prometheus conventions: a `hastream_` prefix, base units (`_seconds`,
`_bytes`), `_total` on counters, and labels `group`, `table`, `topic`, `follower`, `role`,
`state`. docs/operations.md lists them with the queries an operator asks first.

Threads: `collect` runs on the HTTP server's request thread; everything it reads is safe to
read from any thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from hastream.model import LOCAL_GROUP
from raftstore.group import Group
from raftstore.health import ReplicaState
from raftstore.stats import HistogramSnapshot, subscriber_lag
from raftstore.storage.files import OPEN_DATA_FILES

ROLES = ("leader", "follower", "candidate")
HEALTH_STATES = tuple(state.value for state in ReplicaState)


class MetricsSource(Protocol):
    """What the collector reads of the node (node.py)."""

    alias: str

    def groups(self) -> list[Group]: ...

    def ready(self) -> bool: ...

    def serving(self) -> bool: ...

    def housekeeping_status(self) -> dict[str, Any]: ...


def registry_for(source: MetricsSource) -> CollectorRegistry:
    """A registry of the node's collector and the process collector (not the global one:
    tests run several nodes' exporters in one process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(source))
    ProcessCollector(registry=registry)
    return registry


def histogram(
    name: str, documentation: str, labels: list[str]
) -> tuple[HistogramMetricFamily, Any]:
    family = HistogramMetricFamily(name, documentation, labels=labels)

    def add(values: list[str], snapshot: HistogramSnapshot) -> None:
        buckets = [(_le(bound), count) for bound, count in snapshot.buckets]
        family.add_metric(values, buckets, snapshot.sum_s)

    return family, add


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class NodeCollector(Collector):
    def __init__(self, source: MetricsSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        source = self._source
        groups = source.groups()
        statuses = [(group, group.status()) for group in groups]
        yield from _node_families(source)
        yield from _raft_families([(g, s) for g, s in statuses if g.group_id != LOCAL_GROUP])
        yield from _replica_families(statuses)
        yield from _table_families(statuses)
        yield from _topic_families(statuses)


def _node_families(source: MetricsSource) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "hastream_node_ready",
        "1 once every group replayed its log and none is in doubt",
        value=int(source.ready()),
    )
    yield GaugeMetricFamily(
        "hastream_node_serving",
        "1 while ready and every Raft group has a known leader (grpc.health.v1 SERVING)",
        value=int(source.serving()),
    )
    yield GaugeMetricFamily(
        "hastream_open_data_files", "Data-file handles held open", value=OPEN_DATA_FILES.count
    )
    yield GaugeMetricFamily(
        "hastream_open_data_files_limit",
        "Most data-file handles held open at once",
        value=OPEN_DATA_FILES.capacity(),
    )
    housekeeping = source.housekeeping_status()
    scrub = housekeeping.get("scrub") or {}
    yield CounterMetricFamily(
        "hastream_scrub_findings",
        "Damaged records the online scrub found",
        value=len(scrub.get("findings", [])),
    )
    yield CounterMetricFamily(
        "hastream_scrub_verified_bytes",
        "Data-file bytes the online scrub re-read and verified",
        value=int(scrub.get("bytes_verified", 0)),
    )
    yield CounterMetricFamily(
        "hastream_digest_comparisons",
        "Table digests this node compared with its peers' (as leader)",
        value=int(housekeeping.get("digest_comparisons", 0)),
    )
    yield CounterMetricFamily(
        "hastream_digest_mismatches",
        "Replica digests that disagreed with the majority's (each starts a repair)",
        value=int(housekeeping.get("digest_mismatches", 0)),
    )
    yield from _publish_port_families(housekeeping)


def _publish_port_families(housekeeping: dict[str, Any]) -> Iterator[Metric]:
    port = housekeeping.get("publish_port")
    if port is None:
        return
    yield CounterMetricFamily(
        "hastream_publish_port_publishes",
        "Publishes answered on the publish port (the rest of the waited ones came over gRPC)",
        value=int(port["answered"]),
    )
    yield GaugeMetricFamily(
        "hastream_publish_port_connections",
        "Open connections to the publish port",
        value=int(port["connections"]),
    )


def _raft_families(statuses: list[tuple[Group, dict[str, Any]]]) -> Iterator[Metric]:
    g = ["group"]
    role = GaugeMetricFamily("hastream_raft_role", "1 for this member's role", labels=[*g, "role"])
    leader = GaugeMetricFamily(
        "hastream_raft_leader", "1 for the leader this member knows", labels=[*g, "leader"]
    )
    has_leader = GaugeMetricFamily(
        "hastream_raft_has_leader", "1 while this member knows a leader", labels=g
    )
    term = GaugeMetricFamily("hastream_raft_term", "Current Raft term", labels=g)
    commit = GaugeMetricFamily("hastream_raft_commit_index", "Raft commit index", labels=g)
    applied = GaugeMetricFamily("hastream_raft_applied_index", "Last applied index", labels=g)
    last = GaugeMetricFamily("hastream_raft_last_log_index", "Index of the last entry", labels=g)
    changes = CounterMetricFamily(
        "hastream_raft_leader_changes", "Changes of the leader this member knows", labels=g
    )
    slow_ticks = CounterMetricFamily(
        "hastream_raft_slow_ticks",
        "Ticks that held the Raft thread for half an election timeout or more",
        labels=g,
    )
    pre_votes = CounterMetricFamily(
        "hastream_raft_pre_votes", "Pre-vote rounds this member started", labels=g
    )
    log_bytes = GaugeMetricFamily(
        "hastream_raft_log_bytes", "Bytes of entries held in the Raft log", labels=g
    )
    log_entries = GaugeMetricFamily(
        "hastream_raft_log_entries", "Entries held in the Raft log", labels=g
    )
    lag = GaugeMetricFamily(
        "hastream_raft_follower_match_lag_entries",
        "On the leader: entries a follower's log lacks (last log index - match index)",
        labels=[*g, "follower"],
    )
    transfer = GaugeMetricFamily(
        "hastream_raft_transfer_in_progress", "1 while handing leadership over", labels=g
    )
    fsync, add_fsync = histogram(
        "hastream_raft_fsync_seconds", "fdatasync of the Raft journal", labels=g
    )
    for group, status in statuses:
        labels = [str(group.group_id)]
        for name in ROLES:
            role.add_metric([*labels, name], int(status["role"] == name))
        leader_alias = str(status.get("leader") or "").rpartition(":")[2]
        has_leader.add_metric(labels, int(bool(leader_alias)))
        if leader_alias:
            leader.add_metric([*labels, leader_alias], 1)
        term.add_metric(labels, status["term"])
        commit.add_metric(labels, status["commit_index"])
        applied.add_metric(labels, status["last_applied"])
        last.add_metric(labels, status["last_log_index"])
        changes.add_metric(labels, status["leader_changes"])
        slow_ticks.add_metric(labels, status["slow_ticks"])
        pre_votes.add_metric(labels, status["pre_votes"])
        log_bytes.add_metric(labels, status["journal_bytes"])
        log_entries.add_metric(labels, status["log_len"])
        transfer.add_metric(labels, int(status.get("transfer_target") is not None))
        if status["role"] == "leader":
            for follower, match in sorted(status.get("match_index", {}).items()):
                lag.add_metric([*labels, follower], max(0, status["last_log_index"] - match))
        latencies = group.latencies()
        if "fsync" in latencies:
            add_fsync(labels, latencies["fsync"])
    yield from (role, leader, has_leader, term, commit, applied, last, changes)
    yield from (slow_ticks, pre_votes)
    yield from (log_bytes, log_entries, lag, transfer, fsync)


def _replica_families(statuses: list[tuple[Group, dict[str, Any]]]) -> Iterator[Metric]:
    g = ["group"]
    health = GaugeMetricFamily(
        "hastream_replica_health", "1 for the replica's health state", labels=[*g, "state"]
    )
    counters = {
        key: CounterMetricFamily(name, documentation, labels=g)
        for key, name, documentation in (
            ("apply_stalls", "hastream_apply_stalls", "Times applying stalled on the environment"),
            ("repairs_completed", "hastream_repairs", "Repairs from peers completed"),
            ("corruptions_repaired", "hastream_corruptions_repaired", "Damaged tables repaired"),
            ("entries_applied", "hastream_entries_applied", "Raft entries applied"),
            ("checkpoints_written", "hastream_checkpoints", "Checkpoints written"),
        )
    }
    checkpoint_bytes = GaugeMetricFamily(
        "hastream_checkpoint_bytes", "Size of the last checkpoint written", labels=g
    )
    checkpoint, add_checkpoint = histogram(
        "hastream_checkpoint_seconds", "Writing a checkpoint (data files fsynced first)", g
    )
    queue = GaugeMetricFamily(
        "hastream_publish_queue_depth", "Publishes waiting for group commit", labels=g
    )
    for group, status in statuses:
        labels = [str(group.group_id)]
        state = status["health"]["state"]
        for name in HEALTH_STATES:
            health.add_metric([*labels, name], int(state == name))
        for key, family in counters.items():
            family.add_metric(labels, int(status.get(key, 0)))
        checkpoint_bytes.add_metric(labels, status.get("checkpoint_bytes_last", 0))
        queue.add_metric(labels, status["publish_queue_depth"])
        latencies = group.latencies()
        if "checkpoint" in latencies:
            add_checkpoint(labels, latencies["checkpoint"])
    yield health
    yield from counters.values()
    yield from (checkpoint_bytes, checkpoint, queue)


def _table_families(statuses: list[tuple[Group, dict[str, Any]]]) -> Iterator[Metric]:
    t = ["group", "table"]
    rows = GaugeMetricFamily("hastream_table_rows", "Rows in the table (its next offset)", labels=t)
    earliest = GaugeMetricFamily(
        "hastream_table_earliest_offset", "Earliest row still retained", labels=t
    )
    window = GaugeMetricFamily(
        "hastream_dedup_window_rows", "Keys held in the table's dedup window", labels=t
    )
    requests = CounterMetricFamily(
        "hastream_publish_requests", "Publishes acknowledged by this node", labels=t
    )
    published = CounterMetricFamily(
        "hastream_publish_rows", "Rows acknowledged (after dedup) by this node", labels=t
    )
    payload = CounterMetricFamily(
        "hastream_publish_bytes", "Arrow payload bytes acknowledged by this node", labels=t
    )
    ack, add_ack = histogram(
        "hastream_publish_ack_seconds", "Publish arrival to acknowledgement, on the leader", t
    )
    for group, status in statuses:
        group_label = str(group.group_id)
        for table, stats in sorted(status["table_stats"].items()):
            rows.add_metric([group_label, table], stats["row_count"])
            earliest.add_metric([group_label, table], stats["earliest_offset"])
        for table, size in sorted(group.applier.key_window_rows().items()):
            window.add_metric([group_label, table], size)
        for table, snapshot in group.publish_stats.snapshot().items():
            if table not in status["table_stats"]:
                continue  # dropped since
            labels = [group_label, table]
            requests.add_metric(labels, snapshot.requests)
            published.add_metric(labels, snapshot.rows)
            payload.add_metric(labels, snapshot.payload_bytes)
            add_ack(labels, snapshot.ack_latency)
    yield from (rows, earliest, window, requests, published, payload, ack)


def _topic_families(statuses: list[tuple[Group, dict[str, Any]]]) -> Iterator[Metric]:
    labels = ["group", "table", "topic"]
    lag = GaugeMetricFamily(
        "hastream_subscriber_lag_rows",
        "Rows published after the topic's persisted offset (rows - 1 - offset)",
        labels=labels,
    )
    offset = GaugeMetricFamily(
        "hastream_topic_persisted_offset",
        "Last processed offset the topic persisted",
        labels=labels,
    )
    connections = GaugeMetricFamily(
        "hastream_subscriber_connections",
        "Open subscriptions to the topic on this node",
        labels=labels,
    )
    for group, status in statuses:
        group_label = str(group.group_id)
        tables = status["table_stats"]
        for topic, persisted in sorted(group.topics().items()):
            table = topic.rpartition("/")[0]
            if table not in tables:
                continue  # a topic of a dropped table
            values = [group_label, table, topic]
            lag.add_metric(values, subscriber_lag(tables[table]["row_count"], persisted))
            offset.add_metric(values, persisted)
        for topic, count in sorted(status["subscriptions"].items()):
            connections.add_metric([group_label, topic.rpartition("/")[0], topic], count)
    yield from (lag, offset, connections)
