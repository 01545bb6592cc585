"""A cluster whose nodes start with HASTREAM_TUNING (raftstore/tuning.py), as bench.experiment
starts them: every knob takes effect on real node processes, publishes are served, and each
node writes its trace (raftstore/trace.py) and its timeline when it stops, which
bench/timeline.py lines up. A bad knob refuses the start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from api_clients import Publisher, Session
from bench import timeline
from deploy.local_cluster import REPO
from tests.harness import LocalCluster, assert_replicas_hold_exactly

pytestmark = pytest.mark.cluster
_TRACE_FILES = (".json", "-timeline.json")  # a node's summary and its timeline

SCHEMA = pa.schema([("id", pa.int64()), ("price", pa.float64())])


def test_tuned_nodes_serve_publishes_and_write_their_traces(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    knobs = (
        "proposals_in_flight=1,switch_interval_ms=0.5,yield_after_ack=off,"
        f"trace_file={traces}/<ALIAS>.json"
    )
    cluster = LocalCluster(tmp_path / "cluster", environment={"HASTREAM_TUNING": knobs})
    cluster.start()
    try:
        cluster.create_table("tuned", SCHEMA)
        sites = [f"127.0.0.1:{node.port}" for node in cluster.nodes.values()]
        with Session(sites, deadline_s=60) as session:
            publisher = Publisher(session, "tuned")
            for first in range(0, 200, 10):  # unary: the Publish handler's stage is traced
                ids = list(range(first, first + 10))
                publisher.append(pa.table({"id": ids, "price": [1.0] * 10}, SCHEMA))
            leader = cluster.leader()
        assert_replicas_hold_exactly(cluster, "tuned", list(range(200)))
    finally:
        cluster.stop()
    for node in cluster.nodes.values():  # each node read every knob, the switch too
        assert "yield_after_ack=False" in node.log_path.read_text(), node.alias
    written = sorted(path.name for path in traces.iterdir())
    assert written == sorted(f"{alias}{end}" for alias in cluster.nodes for end in _TRACE_FILES)
    summaries = {
        alias: json.loads((traces / f"{alias}.json").read_text()) for alias in cluster.nodes
    }
    ours = summaries[leader]
    for stage in (
        "leader: propose -> journal add (queue, tick wake-up)",
        "leader: journal add -> first follower ack",
        "leader: journal add -> apply start (commit)",
        "gRPC Publish handler (total)",
        "fdatasync (journal)",
    ):
        assert ours[stage]["count"] >= 20, (stage, ours.get(stage))
    followers = [summary for alias, summary in summaries.items() if alias != leader]
    for summary in followers:
        assert summary["follower: entries received"]["count"] >= 20, summary
    # Beside each summary, the node's timeline (bench/timeline.py lines them up).
    timelines = timeline.load({alias: traces / f"{alias}.json" for alias in cluster.nodes})
    for kind in ("sent", "added", "durable", "acked", "apply"):
        assert len(timelines[leader][kind]) >= 20, kind
    hops = timeline.hops(timelines[leader], [timelines[a] for a in cluster.nodes if a != leader])
    assert all(len(seconds) >= 15 for seconds in hops.values()), hops  # of 20 publishes
    assert all(seconds >= 0 for seconds in hops["leader add -> apply start (all of it)"])


def test_a_bad_knob_refuses_the_start_naming_it(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster")  # writes its cluster.cfg; starts nothing
    done = subprocess.run(
        [sys.executable, "-m", "raftstore", "--config", str(cluster.config_path), "--node",
         "node1"],
        cwd=REPO,
        env={"HASTREAM_TUNING": "proposals_in_flight=64", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "HASTREAM_TUNING" in done.stderr
    assert "proposals_in_flight='64'" in done.stderr
