"""A repair whose first peer is frozen: a real node restarted behind its peers' checkpoints
must fetch the rows its data files lack, and the first peer it asks has been SIGSTOPped.
The fetch gives that peer up once it has sent nothing for a while and asks the next (and
the other tables' fetches ask the silent peer last), so the node is healthy again,
acknowledges, and the group (the frozen node's one live peer and it) takes writes. Every
acknowledged row is there exactly once, in order, on every replica."""

from __future__ import annotations

import signal
from pathlib import Path

import pyarrow as pa
import pytest

from raftstore import limits
from tests.harness import (
    AckedPublisher,
    LocalCluster,
    assert_replicas_hold_exactly,
    wait_until,
)

pytestmark = pytest.mark.cluster

SCHEMA = pa.schema([("id", pa.int64()), ("note", pa.string())])
ROWS = 1000
TABLES = ("frozen_a", "frozen_b", "frozen_c", "frozen_d")


def test_a_repair_gives_up_a_frozen_peer_and_the_group_takes_writes_again(tmp_path: Path) -> None:
    # node3's repairs ask its peers in the cluster's order: node1 first.
    cluster = LocalCluster(tmp_path / "cluster", purge_interval_s=1.0).start()
    try:
        publishers = []
        for table in TABLES:
            cluster.create_table(table, SCHEMA, key_column="id")
            publishers.append(AckedPublisher(cluster, table, SCHEMA))
            publishers[-1].publish(0, ROWS)
        wait_until(
            lambda: all(cluster.row_count("node3", table) == ROWS for table in TABLES),
            timeout_s=30,
            message="node3 has the first rows",
        )
        behind = int(cluster.group_status("node3", 2)["lsn_applied"])
        cluster.kill("node3")

        # Until both live nodes' journals were cut past what node3 holds: restarted, it
        # takes a checkpoint every table's files are behind, and repairs them.
        def cut_past_node3() -> bool:
            for publisher in publishers:
                publisher.publish(publisher.acked[-1] + 1, ROWS)
            for alias in ("node1", "node2"):
                status = cluster.group_status(alias, 2)
                # The journal's first entry is the last one a checkpoint holds.
                first = int(status["last_log_index"]) - int(status["log_len"]) + 1
                if first <= behind + 2:
                    return False
            return True

        wait_until(cut_past_node3, timeout_s=120, message="journals cut past node3")
        cluster.signal("node1", signal.SIGSTOP)
        try:
            cluster.start_node("node3")
            # node2 leads (with node3's vote) and can commit only once node3 is healthy.
            for publisher in publishers:
                publisher.publish(publisher.acked[-1] + 1, ROWS, deadline_s=90)
            status = cluster.group_status("node3", 2)
            assert status["checkpoints_loaded"] >= 1, "node3 took no checkpoint"
            assert status["health"]["state"] == "healthy"
            log = cluster.log_since_start("node3")
            assert "repair complete" in log
            # node1 was given up for its silence (before: gRPC's 20 s connect timeout here,
            # and on a connection made before the freeze, the fetch's 600 s deadline)...
            assert f"sent nothing for {limits.PEER_FETCH_IDLE_S:.0f} s" in log
            # ...once per repair job, not once per table: then it is asked last.
            failures = log.count(" failed table=")
            assert 1 <= failures <= log.count("repair started") < len(TABLES)
        finally:
            cluster.signal("node1", signal.SIGCONT)
        for publisher in publishers:
            assert_replicas_hold_exactly(cluster, publisher.table, publisher.acked)
    finally:
        cluster.stop()
