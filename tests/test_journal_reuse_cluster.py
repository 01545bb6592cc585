"""Reused Raft journal segments on real nodes: a cluster whose journals roll every 64 KiB and
checkpoint every second frees and reuses segments within seconds, while its leader is
killed (-9) and restarted and the next one frozen, and then every node is killed at once
and restarted. Every acknowledged row is there exactly once, in order, on every replica."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from raftstore import limits
from raftstore.storage.journal import FILE_VERSION_REUSED, SPARE_PREFIX, segment_paths
from tests.harness import (
    AckedPublisher,
    LocalCluster,
    assert_replicas_hold_exactly,
    publish_through_faults,
    wait_until,
)

pytestmark = pytest.mark.cluster

SCHEMA = pa.schema([("id", pa.int64()), ("note", pa.string())])
SEGMENT_BYTES = 256 * 1024
ROWS = 200  # per publish: an entry of a few KiB, a segment every fifty or so


def _reuse_seen(cluster: LocalCluster) -> int:
    """Spares and reused segments in the nodes' group journals."""
    seen = 0
    for alias in cluster.nodes:
        directory = cluster.ha_dir(alias) / "group-2"
        if not directory.exists():
            continue
        seen += sum(1 for path in directory.iterdir() if path.name.startswith(SPARE_PREFIX))
        for path in segment_paths(directory):
            with path.open("rb") as file:
                seen += file.read(5)[4:] == bytes([FILE_VERSION_REUSED])
    return seen


def test_reused_journal_segments_keep_every_acknowledged_row_through_kills(
    tmp_path: Path,
) -> None:
    if shutil.disk_usage(tmp_path).free < 2 * limits.RAFT_JOURNAL_SPARES_FREE_BYTES_MIN:
        pytest.skip("the disk has too little room free for a node to keep journal spares")
    cluster = LocalCluster(
        tmp_path / "cluster",
        purge_interval_s=1.0,
        environment={"HASTREAM_TUNING": f"journal_segment_bytes={SEGMENT_BYTES}"},
    )
    cluster.start()
    try:
        # Keyed: a batch retried after a lost acknowledgement (the leader killed) is dropped.
        cluster.create_table("reused", SCHEMA, key_column="id")
        publisher = AckedPublisher(cluster, "reused", SCHEMA)

        warm_rows = 40 * ROWS  # at least; then the keys the warm-up published

        def publish(stop: threading.Event, acked: list[int], failures: list[BaseException]) -> None:
            key = warm_rows  # after the warm-up's keys
            try:
                while not stop.is_set():
                    publisher.publish(key, ROWS)
                    acked.extend(range(key, key + ROWS))
                    key += ROWS
            except BaseException as error:  # reported by publish_through_faults
                failures.append(error)

        # Segments freed and reused before the first kill: the restarts open reused ones.
        def warm_up() -> bool:
            first = len(publisher.acked)
            publisher.publish(first, ROWS)
            return _reuse_seen(cluster) > 0 and first >= warm_rows

        wait_until(warm_up, timeout_s=60, message="a segment reused")
        warm_rows = len(publisher.acked)
        acked = list(range(warm_rows)) + publish_through_faults(cluster, publish, step=10 * ROWS)
        for alias in list(cluster.alive()):  # all at once: every journal recovered
            cluster.kill(alias)
        for alias in cluster.nodes:
            cluster.start_node(alias)
        assert_replicas_hold_exactly(cluster, "reused", acked)
        opened = sum(
            cluster.nodes[alias].log_path.read_text().count("reused journal segment ends")
            for alias in cluster.nodes
        )
        assert opened > 0  # a restart recovered a reused segment, its old records after
    finally:
        cluster.stop()
