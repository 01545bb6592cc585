"""Reused Raft journal segments on real nodes: a cluster whose journals roll every 256 KiB and
checkpoint every second frees and reuses segments within seconds, while its leader is
killed (-9) and restarted and the next one frozen, and then every node is killed at once
and restarted; and a node whose journal's disk fills up gives its spares back. Every
acknowledged row is there exactly once, in order, on every replica."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from raftstore.storage.journal import FILE_VERSION_REUSED, SPARE_PREFIX, segment_paths
from tests.chaos import faults
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
        seen += _spares(cluster, alias)
        seen += sum(_reused(path) for path in segment_paths(directory))
    return seen


def _reused(segment: Path) -> bool:
    """Whether a journal segment's header says it is a reused spare."""
    with segment.open("rb") as file:
        return file.read(5)[4:] == bytes([FILE_VERSION_REUSED])


def _newest_segment_reused(cluster: LocalCluster) -> bool:
    """Whether a live node's group journal writes to a reused segment now: killed, it
    recovers one whose earlier use's records follow its own."""
    for alias in cluster.alive():
        paths = segment_paths(cluster.ha_dir(alias) / "group-2")
        if paths and _reused(paths[-1]):
            return True
    return False


def _spares(cluster: LocalCluster, alias: str) -> int:
    directory = cluster.ha_dir(alias) / "group-2"
    if not directory.exists():
        return 0
    return sum(1 for path in directory.iterdir() if path.name.startswith(SPARE_PREFIX))


def test_reused_journal_segments_keep_every_acknowledged_row_through_kills(
    tmp_path: Path,
) -> None:
    # With 256 KiB segments a journal keeps spares while 16 of them (4 MiB) are free.
    if shutil.disk_usage(tmp_path).free < 64 * faults.MIB:
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
        assert acked == publisher.acked  # every key once, in order: the next one follows

        # Not by chance (a loaded machine once had every journal's newest segment fresh):
        # appends go on until one is reused, so that a restart recovers one.
        def newest_reused() -> bool:
            if _newest_segment_reused(cluster):
                return True
            publisher.publish(publisher.acked[-1] + 1, ROWS)
            return False

        wait_until(newest_reused, timeout_s=60, message="a journal writing a reused segment")
        acked = list(publisher.acked)
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


def test_a_node_whose_journal_disk_fills_up_gives_its_spares_back_and_catches_up(
    tmp_path: Path,
) -> None:
    """node3's Raft journals on a small disk of their own (a real tmpfs): its group journal
    keeps spares; then the disk is filled to the last block by someone else. Within a few
    seconds node3 has removed them (its tick's look at the room left), the others go on
    acknowledging, and once the disk is grown node3 catches up."""
    cluster = LocalCluster(
        tmp_path / "cluster",
        groups=(2,),
        purge_interval_s=1.0,
        environment={"HASTREAM_TUNING": f"journal_segment_bytes={SEGMENT_BYTES}"},
    )
    disk = faults.Tmpfs(cluster.ha_dir("node3"), 32 * faults.MIB).mount_or_skip()
    try:
        cluster.start()
        cluster.create_table("full", SCHEMA, key_column="id")
        publisher = AckedPublisher(cluster, "full", SCHEMA)

        def publish() -> None:
            publisher.publish(len(publisher.acked), ROWS)

        def spares_kept() -> bool:
            publish()
            return _spares(cluster, "node3") > 0

        wait_until(spares_kept, timeout_s=60, message="node3 keeps journal spares")
        disk.fill()
        full_at = len(publisher.acked)

        def spares_given_back() -> bool:
            publish()  # node1 and node2 acknowledge
            return _spares(cluster, "node3") == 0

        wait_until(spares_given_back, timeout_s=30, message="node3 gave its spares back")
        # Removed, not reused by a roll (its log is on another disk). The node logs the
        # removal after the files are gone: on a busy machine the count can be read between.
        wait_until(
            lambda: "journal spares removed" in cluster.log_since_start("node3"),
            timeout_s=10,
            message="node3 logs that it removed its spares",
        )
        assert "node3" in cluster.alive()
        for _ in range(10):
            publish()
        assert len(publisher.acked) > full_at
        disk.free()  # grown, and the filler removed
        assert_replicas_hold_exactly(cluster, "full", publisher.acked)
    finally:
        cluster.stop()
        disk.unmount()
