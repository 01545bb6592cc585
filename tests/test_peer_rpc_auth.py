"""Peer-only RPCs (FetchRecords, FetchRecordBatches, the name catalog, digests, RepairTable)
accept signed calls from cluster nodes only: unit tests of the signature, and a real cluster
refusing a client."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest

from hastream.errors import Overloaded, Unauthenticated
from proto import hastream_pb2 as pb
from raftstore import limits
from raftstore.log_limits import OncePerInterval
from raftstore.peer_auth import METADATA_KEY, PeerSigner, PeerVerifier, peer_key
from tests.harness import AckedPublisher, LocalCluster, ManualClock, wait_until

KEY = b"k" * 32
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("ts", pa.timestamp("ms")),
        ("sym", pa.string()),
        ("price", pa.float64()),
        ("qty", pa.int32()),
    ]
)


@pytest.mark.unit
def test_a_signed_call_is_accepted_once() -> None:
    clock = ManualClock()
    metadata = PeerSigner(KEY, "node2", clock).metadata("FetchRecords")
    verifier = PeerVerifier(KEY, clock)
    assert verifier.verify("FetchRecords", metadata) == "node2"
    with pytest.raises(Unauthenticated, match="replayed"):
        verifier.verify("FetchRecords", metadata)


@pytest.mark.unit
def test_forged_misdirected_stale_and_missing_signatures_are_refused() -> None:
    clock = ManualClock()
    verifier = PeerVerifier(KEY, clock)
    other = PeerSigner(peer_key("another secret"), "node2", clock).metadata("FetchRecords")
    with pytest.raises(Unauthenticated, match="bad peer signature"):
        verifier.verify("FetchRecords", other)
    # A signature for one method does not open another.
    digest = PeerSigner(KEY, "node2", clock).metadata("GetTableDigest")
    with pytest.raises(Unauthenticated, match="bad peer signature"):
        verifier.verify("RepairTable", digest)
    old = PeerSigner(KEY, "node2", clock).metadata("FetchRecords")
    clock.now += limits.PEER_CLOCK_SKEW_S + 1
    with pytest.raises(Unauthenticated, match="stale"):
        verifier.verify("FetchRecords", old)
    with pytest.raises(Unauthenticated, match="no peer signature"):
        verifier.verify("FetchRecords", ())
    for garbage in ("", "a b c", "node2 x nonce tag", "x" * 10_000, "n " + "9" * 5000 + " a b"):
        with pytest.raises(Unauthenticated, match="malformed"):
            verifier.verify("FetchRecords", ((METADATA_KEY, garbage),))


@pytest.mark.unit
def test_the_replay_cache_is_bounded_and_forgets_expired_nonces() -> None:
    clock = ManualClock()
    signer, verifier = PeerSigner(KEY, "node2", clock), PeerVerifier(KEY, clock, nonces_max=3)
    for _ in range(3):
        verifier.verify("GetTableClaims", signer.metadata("GetTableClaims"))
    with pytest.raises(Overloaded):
        verifier.verify("GetTableClaims", signer.metadata("GetTableClaims"))
    clock.now += 2 * limits.PEER_CLOCK_SKEW_S + 1  # the remembered nonces expired
    verifier.verify("GetTableClaims", signer.metadata("GetTableClaims"))


@pytest.mark.unit
def test_refusals_are_logged_once_a_second_with_the_count_between() -> None:
    clock = ManualClock()
    limiter = OncePerInterval(1.0, clock)
    assert limiter.due() == 1
    assert [limiter.due() for _ in range(5)] == [None] * 5
    clock.now += 1.0
    assert limiter.due() == 6


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path / "cluster")
    yield cluster.start()
    cluster.stop()


def _refusal(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    metadata = dict(call.trailing_metadata() or ())
    return (
        call.code(),
        metadata.get("hastream-error", ""),
        json.loads(metadata.get("hastream-error-fields", "{}")),
    )


@pytest.mark.cluster
def test_a_client_cannot_call_peer_only_rpcs(cluster: LocalCluster) -> None:
    cluster.create_table("ticks", SCHEMA, key_column="id")
    publisher = AckedPublisher(cluster, "ticks", SCHEMA)
    publisher.publish(0, 100)
    leader = cluster.leader()
    stub = cluster.stub(leader)
    forged = PeerSigner(peer_key("not the cluster secret"), "node2").metadata("FetchRecords")
    calls: dict[str, Callable[[Any], object]] = {
        "FetchRecords": lambda metadata: list(
            stub.FetchRecords(
                pb.FetchRecordsRequest(raft_group=2, table="ticks", offset_to=100),
                metadata=metadata,
                timeout=10,
            )
        ),
        "FetchRecordBatches": lambda metadata: list(
            stub.FetchRecordBatches(
                pb.FetchRecordsRequest(raft_group=2, table="ticks", offset_to=100),
                metadata=metadata,
                timeout=10,
            )
        ),
        "ClaimTableName": lambda metadata: stub.ClaimTableName(
            pb.NameClaim(table="stolen", raft_group=3, nonce=b"n"), metadata=metadata, timeout=10
        ),
        "ReleaseTableName": lambda metadata: stub.ReleaseTableName(
            pb.NameClaim(table="ticks", raft_group=2, nonce=b"n"), metadata=metadata, timeout=10
        ),
        "GetTableClaims": lambda metadata: stub.GetTableClaims(
            pb.GroupRequest(raft_group=1), metadata=metadata, timeout=10
        ),
        "GetTableDigest": lambda metadata: stub.GetTableDigest(
            pb.TableDigestRequest(raft_group=2, table="ticks", offset_to=100),
            metadata=metadata,
            timeout=10,
        ),
        "RepairTable": lambda metadata: stub.RepairTable(
            pb.RepairTableRequest(raft_group=2, table="ticks", reason="x"),
            metadata=metadata,
            timeout=10,
        ),
    }
    for name, call in calls.items():
        for metadata in ((), forged):
            with pytest.raises(grpc.RpcError) as raised:
                call(metadata)
            code, error, fields = _refusal(raised.value)
            assert code == grpc.StatusCode.UNAUTHENTICATED, name
            assert error == "Unauthenticated", name
            assert "reason" in fields
    assert "refused a peer-only call" in cluster.log_tail(leader, lines=200)
    # Nothing was done: no repair started, the table still served, no stolen name.
    status = cluster.group_status(leader, 2)
    assert status["corruptions_repaired"] == 0
    assert status["health"]["state"] == "healthy"
    assert cluster.row_count(leader, "ticks") == 100
    groups = cluster.stub(leader).GetStreamingRaftGroups(pb.Empty(), timeout=10)
    assert all("stolen" not in group.tables for group in groups.groups)


@pytest.mark.cluster
def test_a_nodes_files_are_its_own(cluster: LocalCluster) -> None:
    """Data files, Raft logs and checkpoints: 0600, their directories 0700 (the node's
    umask), whatever the umask of whoever started it."""
    cluster.create_table("private", SCHEMA)
    AckedPublisher(cluster, "private", SCHEMA).publish(0, 10)
    node_root = cluster.root / "node1"
    wait_until(
        lambda: any((node_root / "persistence").rglob("seg-*.dat")), timeout_s=30, message="data"
    )
    paths = [path for path in node_root.rglob("*") if not path.is_symlink()]
    assert any(path.is_file() for path in paths)
    for path in paths:
        mode = path.stat().st_mode & 0o777
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
