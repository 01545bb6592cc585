"""Operations, without a cluster: latency histograms and publish counters, the metrics
exporter's families and names, the status page, preferred leaders, the restart order, the
`hastream` command's parsing, rendering and help, and the shipped monitoring files."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml
from click.testing import CliRunner
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deploy import rolling
from hastream.errors import TransferFailed, from_wire, to_wire
from hastream.model import NodeAddress
from hastream_cli import render
from hastream_cli.main import cli, parse_schema, resolve_sites
from hastream_cli.since import since_ms
from raftstore import config
from raftstore.leadership import PreferredLeader
from raftstore.metrics import registry_for
from raftstore.stats import ACK_BUCKETS_S, LatencyHistogram, PublishStats
from raftstore.status_page import RateTracker, render_fragment, render_page, status_document

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
MONITORING = REPO / "deploy" / "docker" / "monitoring"


# --- stats ---------------------------------------------------------------------------------


def test_histogram_counts_cumulatively_with_bounds_inclusive() -> None:
    histogram = LatencyHistogram((0.01, 0.1, 1.0))
    for seconds in (0.005, 0.01, 0.05, 0.5, 3.0):
        histogram.observe(seconds)
    snapshot = histogram.snapshot()
    assert snapshot.buckets == ((0.01, 2), (0.1, 3), (1.0, 4), (float("inf"), 5))
    assert snapshot.count == 5
    assert snapshot.sum_s == pytest.approx(3.565)


def test_publish_stats_count_per_table_and_forget_a_dropped_one() -> None:
    stats = PublishStats()
    stats.record("a", rows=10, payload_bytes=100, latency_s=0.002)
    stats.record("a", rows=5, payload_bytes=50, latency_s=0.2)
    stats.record("b", rows=1, payload_bytes=8, latency_s=0.001)
    snapshot = stats.snapshot()
    assert (snapshot["a"].requests, snapshot["a"].rows, snapshot["a"].payload_bytes) == (2, 15, 150)
    assert snapshot["a"].ack_latency.count == 2
    assert stats.rows_total() == 16
    stats.forget("a")
    assert list(stats.snapshot()) == ["b"]


def test_transfer_failed_crosses_the_wire_with_its_fields() -> None:
    error = TransferFailed(2, "127.0.0.1:8902:node2", "the target did not catch up in time")
    rebuilt = from_wire(dict(to_wire(error)))
    assert isinstance(rebuilt, TransferFailed)
    assert (rebuilt.group_id, rebuilt.target, rebuilt.reason) == (2, error.target, error.reason)
    assert not rebuilt.retryable


# --- the metrics exporter, on a node made of fakes -------------------------------------


class FakeApplier:
    def key_window_rows(self) -> dict[str, int]:
        return {"ticks": 1000}


class FakeGroup:
    """What the exporter and the status page read of a group (group.py)."""

    def __init__(self, group_id: int, role: str) -> None:
        self.group_id = group_id
        self.role = role
        self.applier = FakeApplier()
        self.publish_stats = PublishStats()
        self.publish_stats.record("ticks", 100, 4096, 0.004)
        fsync = LatencyHistogram((0.001, 0.01))
        fsync.observe(0.002)
        self._latencies = {
            "fsync": fsync.snapshot(),
            "checkpoint": LatencyHistogram((1.0,)).snapshot(),
        }

    def status(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "leader": "127.0.0.1:8901:node1",
            "term": 7,
            "commit_index": 120,
            "last_applied": 118,
            "last_log_index": 121,
            "leader_changes": 3,
            "slow_ticks": 1,
            "pre_votes": 2,
            "journal_bytes": 65536,
            "log_len": 121,
            "transfer_target": None,
            "match_index": {"node2": 121, "node3": 100},
            "health": {"state": "healthy", "reason": ""},
            "apply_stalls": 1,
            "repairs_completed": 0,
            "corruptions_repaired": 0,
            "entries_applied": 118,
            "checkpoints_written": 2,
            "checkpoint_bytes_last": 2048,
            "publish_queue_depth": 0,
            "table_stats": {"ticks": {"row_count": 5000, "earliest_offset": 0}},
            "subscriptions": {"ticks/agg": 1},
        }

    def latencies(self) -> dict[str, Any]:
        return self._latencies

    def topics(self) -> dict[str, int]:
        return {"ticks/agg": 3999, "gone/x": 5}


class FakeNode:
    alias = "node1"

    def __init__(self, role: str = "leader") -> None:
        self._groups = [FakeGroup(2, role)]

    def groups(self) -> list[Any]:
        return self._groups

    def ready(self) -> bool:
        return True

    def serving(self) -> bool:
        return True

    def housekeeping_status(self) -> dict[str, Any]:
        return {"scrub": {"findings": [{}], "bytes_verified": 10}, "digest_mismatches": 1}


def exported(node: FakeNode) -> dict[str, Any]:
    text = generate_latest(registry_for(node)).decode()  # type: ignore[arg-type]
    return {family.name: family for family in text_string_to_metric_families(text)}


def values(families: dict[str, Any], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in families.values()
        for sample in family.samples
        if sample.name == name
    }


def test_exported_names_follow_prometheus_conventions() -> None:
    families = exported(FakeNode())
    for name, family in families.items():
        assert name.startswith(("hastream_", "process_")), name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), name
        if "seconds" in name or "bytes" in name:
            assert name.endswith(("_seconds", "_bytes", "_bytes_total")), name
    assert families["hastream_raft_fsync_seconds"].type == "histogram"
    assert families["hastream_publish_ack_seconds"].type == "histogram"
    buckets = values(families, "hastream_publish_ack_seconds_bucket")
    assert len(buckets) == len(ACK_BUCKETS_S) + 1


def test_leader_exports_follower_lag_and_subscriber_lag_from_offsets() -> None:
    families = exported(FakeNode("leader"))
    lag = values(families, "hastream_raft_follower_match_lag_entries")
    assert lag == {
        (("follower", "node2"), ("group", "2")): 0.0,
        (("follower", "node3"), ("group", "2")): 21.0,
    }
    subscriber = values(families, "hastream_subscriber_lag_rows")
    # 5000 rows, persisted offset 3999: rows 4000..4999 are behind. A dropped table's topic
    # has no series.
    assert subscriber == {(("group", "2"), ("table", "ticks"), ("topic", "ticks/agg")): 1000.0}
    assert values(families, "hastream_raft_role")[(("group", "2"), ("role", "leader"))] == 1.0
    assert values(families, "hastream_scrub_findings_total") == {(): 1.0}


def test_a_follower_exports_no_follower_lag() -> None:
    families = exported(FakeNode("follower"))
    assert values(families, "hastream_raft_follower_match_lag_entries") == {}


# --- the status page -----------------------------------------------------------------------


def test_status_page_escapes_names_and_shows_rates() -> None:
    node = FakeNode()
    node._groups[0].status = lambda: {  # type: ignore[method-assign]
        **FakeGroup(2, "leader").status(),
        "table_stats": {"<b>x</b>": {"row_count": 10, "earliest_offset": 0}},
    }
    document = status_document(node)  # type: ignore[arg-type]
    page = render_page(document, {"2/<b>x</b>": 1234.5})
    assert "<b>x</b>" not in page
    assert "&lt;b&gt;x&lt;/b&gt;" in page
    assert "1,234.5" in page
    assert "setInterval(refresh, 2000)" in page
    assert "node3: 21" in render_fragment(status_document(FakeNode()), {})  # type: ignore[arg-type]


def test_rate_tracker_needs_two_samples_a_second_apart() -> None:
    tracker = RateTracker()
    assert tracker.update({"t": 100}, now_s=10.0) == {}
    assert tracker.update({"t": 150}, now_s=10.5) == {}
    assert tracker.update({"t": 300}, now_s=12.0) == {"t": 100.0}


# --- preferred leaders and the restart order -------------------------------------------


class BalancedGroup:
    def __init__(self, *, leading: bool = False, applied: int = 10, commit: int = 10) -> None:
        self.group_id = 2
        self.leading = leading
        self.applied = applied
        self.commit = commit

    def is_leader(self) -> bool:
        return self.leading

    def leader_peer(self) -> NodeAddress | None:
        return None if self.leading else NodeAddress("127.0.0.1", 8902, "node2")

    def ready(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        role = "leader" if self.leading else "follower"
        return {"role": role, "last_applied": self.applied, "commit_index": self.commit}


def test_preferred_leader_asks_back_only_once_settled_and_not_too_often() -> None:
    now = [0.0]
    asked: list[tuple[str, int, str]] = []
    balancer = PreferredLeader(
        "node1",
        {2: "node1", 3: "node2"},
        lambda peer, group, alias, timeout: asked.append((peer.alias, group, alias)) or "",
        settle_s=5.0,
        clock=lambda: now[0],
    )
    group = BalancedGroup()
    for moment in (0.0, 4.9):
        now[0] = moment
        balancer.check([group])  # type: ignore[list-item]
    assert asked == []
    now[0] = 5.0
    balancer.check([group])  # type: ignore[list-item]
    assert asked == [("node2", 2, "node1")]
    now[0] = 6.0
    balancer.check([group])  # type: ignore[list-item]
    assert len(asked) == 1, "at most once per settle period"
    behind = BalancedGroup(applied=5)
    now[0] = 20.0
    balancer.check([behind])  # type: ignore[list-item]
    assert len(asked) == 1, "not while behind (the settle clock restarts)"


def test_restart_order_puts_followers_first() -> None:
    order = rolling.restart_order(["node1", "node2", "node3"], {"node1": [2, 3], "node3": [4]})
    assert order == ["node2", "node3", "node1"]


# --- the command line ----------------------------------------------------------------------


def test_schema_option_takes_arrow_type_names() -> None:
    schema = parse_schema("id:int64, ts:timestamp[ms],price:double,sym:string")
    assert schema == pa.schema(
        [
            ("id", pa.int64()),
            ("ts", pa.timestamp("ms")),
            ("price", pa.float64()),
            ("sym", pa.string()),
        ]
    )


def test_sites_come_from_the_option_or_the_config(tmp_path: Path) -> None:
    assert resolve_sites("a:1, b:2", None) == ["a:1", "b:2"]
    shipped = REPO / "cluster.cfg"
    assert resolve_sites(None, str(shipped)) == [
        "127.0.0.1:8901",
        "127.0.0.1:8902",
        "127.0.0.1:8903",
    ]


def test_every_command_has_an_example_in_its_help() -> None:
    runner = CliRunner()
    for name in cli.commands:  # type: ignore[attr-defined]
        result = runner.invoke(cli, [name, "--help"])
        assert result.exit_code == 0, result.output
        assert "Example:" in result.output, name
        assert "--sites" in result.output, name
        assert "--json" in result.output, name


def test_tables_render_aligned() -> None:
    text = render.table(("A", "LONGER"), [(1, None), ("wide value", ["x", "y"])])
    assert text.splitlines() == ["A           LONGER", "1           -", "wide value  x,y"]


def test_tail_renders_offsets_and_json_rows() -> None:
    data = pa.table({"id": [7, 8]})
    assert render.rows_text(data, 40, header=True) == ["OFFSET  id", "40      7", "41      8"]
    assert [json.loads(line) for line in render.rows_json(data, 40)] == [
        {"_offset": 40, "id": 7},
        {"_offset": 41, "id": 8},
    ]


def test_since_takes_durations_iso_times_and_epoch_ms() -> None:
    now = 1_800_000_000_000
    assert since_ms("90s", now) == now - 90_000
    assert since_ms("5m", now) == now - 300_000
    assert since_ms("1.5h", now) == now - 5_400_000
    assert since_ms("1d", now) == now - 86_400_000
    assert since_ms("1700000000000", now) == 1_700_000_000_000
    assert since_ms("2023-11-14T22:13:20Z", now) == 1_700_000_000_000
    assert since_ms("2023-11-14T22:13:20", now) == 1_700_000_000_000  # UTC
    assert since_ms("2023-11-15T00:13:20+02:00", now) == 1_700_000_000_000
    for bad in ("last week", "5 minutes", "", "-5m"):
        with pytest.raises(ValueError, match="is not a time"):
            since_ms(bad, now)


# --- monitoring files ------------------------------------------------------------------


def exported_names() -> set[str]:
    names = set()
    for family in exported(FakeNode("leader")).values():
        names.update(sample.name for sample in family.samples)
    return names


def test_grafana_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    expressions = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    assert len(expressions) >= 20
    used = {
        name for expr in expressions for name in re.findall(r"\b(?:hastream|process)_\w+", expr)
    }
    assert used - exported_names() == set()


def test_prometheus_scrapes_every_compose_node_on_its_metrics_port() -> None:
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = {
        t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    }
    cluster = config.load(REPO / "deploy" / "docker" / "cluster.cfg")
    assert targets == {f"{node.host}:{node.metrics_port}" for node in cluster.nodes}
    compose = (REPO / "deploy" / "docker" / "docker-compose.yml").read_text()
    for node in cluster.nodes:
        assert f':{node.metrics_port}:{node.metrics_port}"' in compose, node.alias
