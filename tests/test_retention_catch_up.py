"""A brand-new replica catches up a table whose first rows its peers already removed by
retention: it starts at the peers' earliest offset instead of waiting for rows no node has."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from proto import hastream_pb2 as pb
from raftstore.storage.segments import SEGMENT_NAME_PATTERN
from tests.harness import (
    AckedPublisher,
    LocalCluster,
    checkpoint_counts,
    read_stream,
    wait_until,
)

pytestmark = pytest.mark.cluster

SCHEMA = pa.schema([("id", pa.int64()), ("sym", pa.string()), ("price", pa.float64())])
BATCH_ROWS = 200_000


def _segments(root: Path, alias: str, table: str) -> list[Path]:
    found = [
        path
        for path in (root / alias / "persistence").rglob("seg-*.dat")
        if path.parent.name.split(".")[0] == table
        and SEGMENT_NAME_PATTERN.fullmatch(path.name)
        and not path.parent.parent.name.startswith(".")
    ]
    return sorted(found)


def _first_offset(segment: Path) -> int:
    match = SEGMENT_NAME_PATTERN.fullmatch(segment.name)
    assert match is not None
    return int(match.group(1))


def _ids_from(cluster: LocalCluster, alias: str, offset: int) -> list[int]:
    ids: list[int] = []
    request = pb.ReadRequest(table="ticks", offset_from=offset, offset_to=-1)
    for message in cluster.stub(alias).Read(request, timeout=120):
        ids.extend(read_stream(message.payload).column("id").to_pylist())
    return ids


def test_new_replica_starts_where_the_peers_retained_rows_begin(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", purge_interval_s=1.0).start()
    try:
        cluster.create_table("ticks", SCHEMA)
        publisher = AckedPublisher(cluster, "ticks", SCHEMA)
        key = 0
        # Past one 64 MiB data segment, so the peers have a sealed first segment to lose.
        while len(_segments(cluster.root, "node2", "ticks")) < 2:
            publisher.publish(key, BATCH_ROWS)
            key += BATCH_ROWS
            assert key < 10_000_000, "no second data segment"
        # Either peer may lead after the restart and send node1 its checkpoint: both must
        # hold every row in a durable one (and have purged the log before it). An older
        # checkpoint is legitimate too, but then node1 replays the log entries after it and
        # keeps rows from there, before where the peers' data begins. A checkpoint is taken
        # only when entries were applied since the last one: small appends go on meanwhile.
        wait_until(
            lambda: all(cluster.row_count(alias, "ticks") == key for alias in cluster.nodes),
            timeout_s=60,
            message="every replica applied the rows",
        )
        written = {alias: checkpoint_counts(cluster, alias) for alias in ("node2", "node3")}

        def checkpointed() -> bool:
            nonlocal key
            publisher.publish(key, 1)
            key += 1
            return all(checkpoint_counts(cluster, a)[1] > written[a][0] for a in written)

        wait_until(checkpointed, timeout_s=60, message="a checkpoint of every row on both peers")
        total = key
        wait_until(
            lambda: all(cluster.row_count(alias, "ticks") == total for alias in cluster.nodes),
            timeout_s=60,
            message="every replica has the rows",
        )
        cluster.stop()

        # What retention does on the peers: the oldest sealed segment is deleted. node1 is
        # replaced by an empty machine (no data, no Raft log).
        starts = set()
        for alias in ("node2", "node3"):
            first, second, *_ = _segments(cluster.root, alias, "ticks")
            first.unlink()
            starts.add(_first_offset(second))
        (retained_from,) = starts
        shutil.rmtree(cluster.root / "node1")
        assert 0 < retained_from < total

        cluster.start()
        wait_until(
            lambda: cluster.row_count("node1", "ticks") == total,
            timeout_s=120,
            message="the new replica caught up",
        )
        assert (
            cluster.stub("node1")
            .GetTableInfo(pb.TableRequest(table="ticks"), timeout=5)
            .earliest_offset
            == retained_from
        )
        ids = _ids_from(cluster, "node1", retained_from)
        assert ids == list(range(retained_from, total))
        for alias in ("node2", "node3"):
            assert _ids_from(cluster, alias, retained_from) == ids
        # The group goes on with the new replica in it.
        publisher.publish(total, 1000)
        wait_until(
            lambda: all(cluster.row_count(a, "ticks") == total + 1000 for a in cluster.nodes),
            timeout_s=60,
            message="a publish after the catch-up reaches every replica",
        )
    finally:
        cluster.stop()
