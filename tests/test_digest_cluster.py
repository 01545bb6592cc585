"""Replica digests (raftstore/digest.py) on a real three-node cluster: a replica holding
different rows that pass every CRC (what a bug in apply or a repair from a wrong peer would
leave) is found by the leader's comparison and repaired from its peers."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from api_clients import Publisher
from deploy.local_cluster import LocalCluster, wait_until
from raftstore.storage import format as storage_format
from tests.chaos import faults, verify
from tests.chaos.workload import SCHEMA, rows, session_for

pytestmark = pytest.mark.cluster

GROUP = 2


def _rewrite_record_with_other_rows(segment: Path, index: int) -> None:
    """Replace record `index` of a data segment by a well-formed record of the same rows'
    count, LSN and offsets whose ids differ, with valid CRCs: only a comparison with the
    other replicas can tell."""
    data = bytearray(segment.read_bytes())
    start, end = faults.record_spans(bytes(data))[index]
    header = storage_format.decode_header(memoryview(data)[start:])
    payload = memoryview(data)[start + storage_format.HEADER_SIZE : end]
    batch = pa.ipc.read_record_batch(pa.py_buffer(payload), SCHEMA)
    ids = pa.array([key + 1_000_000 for key in batch.column(0).to_pylist()], pa.int64())
    other = pa.RecordBatch.from_arrays([ids, *batch.columns[1:]], schema=SCHEMA)
    new_payload = other.serialize().to_pybytes()
    assert len(new_payload) == len(payload), "the same layout: the record keeps its size"
    parts = storage_format.encode_record(
        header.lsn, header.first_offset, header.row_count, header.timestamp_ms, new_payload
    )
    data[start:end] = b"".join(bytes(part) for part in parts)
    segment.write_bytes(bytes(data))


def test_a_replica_with_other_well_formed_rows_is_found_by_the_digest_and_repaired(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(
        tmp_path / "cluster", groups=(GROUP,), extra_config=("streamingDigestInterval=1",)
    )
    try:
        cluster.start()
        cluster.create_table("t", SCHEMA, group=GROUP)
        session = session_for(cluster)
        publisher = Publisher(session, "t")
        for first in (0, 100, 200):
            publisher.append(rows(first, 100))
        keys = list(range(300))
        wait_until(
            lambda: all(verify.read_keys(cluster, alias, "t") == keys for alias in cluster.nodes),
            timeout_s=30,
            message="every replica holds the rows",
        )
        leader = cluster.leader(GROUP)
        follower = next(alias for alias in sorted(cluster.nodes) if alias != leader)
        cluster.terminate(follower)
        (segment,) = faults.segment_files(cluster.persistence_dir(follower), GROUP)
        _rewrite_record_with_other_rows(segment, 1)
        cluster.start_node(follower)
        wait_until(
            lambda: verify.read_keys(cluster, follower, "t") == keys,
            timeout_s=60,
            message=f"{follower} repaired to the majority's rows",
        )
        leader = cluster.leader(GROUP)
        assert cluster.status(leader)["digest_mismatches"] >= 1
        for alias in cluster.nodes:
            assert verify.read_keys(cluster, alias, "t") == keys, alias
        session.close()
    finally:
        cluster.stop()
