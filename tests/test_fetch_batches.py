"""FetchRecordBatches: a peer's data-file records for repair and catch-up, packed many per
gRPC message under FETCH_BATCH_BYTES_MAX, the same records in the same order as
FetchRecords; and PeerClient falling back to FetchRecords for a peer of an earlier version,
which answers the new method UNIMPLEMENTED."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pyarrow as pa
import pytest

from deploy.local_cluster import LocalCluster, ipc_stream, wait_until
from hastream.errors import NodeUnavailable
from hastream.model import NodeAddress
from proto import hastream_pb2 as pb
from raftstore import limits
from raftstore.peer_auth import METADATA_KEY, PeerSigner, peer_key
from raftstore.peers import PeerClient
from raftstore.service import record_batches
from raftstore.storage.segments import DataRecord
from tests.harness import ManualClock

SCHEMA = pa.schema([("id", pa.int64()), ("ts", pa.timestamp("ms")), ("temp", pa.float64())])
GROUP = 2
SMALL_RECORDS = 3000
# One record of more rows than fit FETCH_BATCH_BYTES_MAX (24 bytes a row): it goes alone.
LARGE_ROWS = limits.FETCH_BATCH_BYTES_MAX // 24 + 10_000
# The secret deploy/local_cluster.py writes into the test clusters' cluster.cfg.
CLUSTER_SECRET = "test-cluster-secret"

Fields = tuple[int, int, int, int, bytes]


def _fields(record: DataRecord | pb.DataRecord) -> Fields:
    return (
        record.lsn,
        record.first_offset,
        record.row_count,
        record.timestamp_ms,
        bytes(record.payload),
    )


@pytest.mark.unit
def test_records_are_packed_in_order_under_the_bound_and_a_larger_one_goes_alone() -> None:
    sizes = [100] * 5000 + [limits.FETCH_BATCH_BYTES_MAX + 1] + [100] * 3 + [300_000] * 10
    records = [
        DataRecord(lsn=index + 1, first_offset=index, row_count=1, timestamp_ms=7, payload=b"x" * n)
        for index, n in enumerate(sizes)
    ]
    messages = list(record_batches(records))
    unpacked = [_fields(record) for message in messages for record in message.records]
    assert unpacked == [_fields(record) for record in records]
    large = [message for message in messages if message.ByteSize() > limits.FETCH_BATCH_BYTES_MAX]
    assert [len(message.records) for message in large] == [1]
    for message in messages:
        assert message.ByteSize() <= limits.FETCH_BATCH_BYTES_MAX or len(message.records) == 1
    # 5,000 small records in one message, the large one alone, 3 small and 3 of 300 KB
    # (a fourth would pass 1 MiB), 3 of 300 KB, and the last: as few as the bound allows.
    assert [len(message.records) for message in messages] == [5000, 1, 6, 3, 3, 1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A table of SMALL_RECORDS one-row records (one publish per Raft entry, so one data-file
    record each), then one record larger than the bound, then a few small ones again."""
    cluster = LocalCluster(tmp_path_factory.mktemp("fetch") / "cluster")
    try:
        cluster.start()
        cluster.create_table("small", SCHEMA)
        stub = cluster.stub(cluster.leader())
        sizes = [1] * SMALL_RECORDS + [LARGE_ROWS] + [1] * 5
        key = 0
        for rows in sizes:
            batch = pa.table(
                {
                    "id": range(key, key + rows),
                    "ts": range(key, key + rows),
                    "temp": [key * 0.5] * rows,
                },
                schema=SCHEMA,
            )
            stub.Publish(pb.PublishRequest(table="small", payload=ipc_stream(batch)), timeout=15)
            key += rows
        wait_until(
            lambda: all(cluster.row_count(alias, "small") == key for alias in cluster.nodes),
            timeout_s=60,
            message="every replica holds the rows",
        )
        yield cluster
    finally:
        cluster.stop()


def _peer(cluster: LocalCluster, alias: str) -> NodeAddress:
    node = cluster.nodes[alias]
    return NodeAddress(node.host, node.port, alias)


def _request(rows: int) -> pb.FetchRecordsRequest:
    return pb.FetchRecordsRequest(raft_group=GROUP, table="small", offset_from=0, offset_to=rows)


def _signer() -> PeerSigner:
    return PeerSigner(peer_key(CLUSTER_SECRET), "tester")


def _one_by_one(cluster: LocalCluster, alias: str, rows: int) -> list[Fields]:
    """FetchRecords' answer, a signed call as a node of an earlier version makes it."""
    calls = cluster.stub(alias).FetchRecords(
        _request(rows), metadata=_signer().metadata("FetchRecords"), timeout=60
    )
    return [_fields(message) for message in calls]


@pytest.mark.cluster
def test_fetch_record_batches_packs_the_records_fetch_records_sends(
    cluster: LocalCluster,
) -> None:
    alias = sorted(cluster.nodes)[0]
    rows = cluster.row_count(alias, "small")
    expected = _one_by_one(cluster, alias, rows)
    assert len(expected) == SMALL_RECORDS + 6
    assert [first for _, first, *_ in expected] == sorted({first for _, first, *_ in expected})

    messages = list(
        cluster.stub(alias).FetchRecordBatches(
            _request(rows), metadata=_signer().metadata("FetchRecordBatches"), timeout=60
        )
    )
    assert [_fields(record) for message in messages for record in message.records] == expected
    # A few messages, not one per record; each within the bound but the large record's,
    # which goes alone.
    assert len(messages) < len(expected) / 100
    for message in messages:
        assert message.ByteSize() <= limits.FETCH_BATCH_BYTES_MAX or len(message.records) == 1
    assert any(message.ByteSize() > limits.FETCH_BATCH_BYTES_MAX for message in messages)

    peers = PeerClient(_signer())
    try:
        fetched = peers.fetch_records(_peer(cluster, alias), GROUP, "small", 0, rows, 0)
        assert [_fields(record) for record in fetched] == expected
        # From an offset inside a record of this replica: the first record is cut there.
        fetched = peers.fetch_records(_peer(cluster, alias), GROUP, "small", 1, rows, 0)
        assert [_fields(record)[1] for record in fetched][:2] == [1, 2]
    finally:
        peers.close()


class EarlierVersion(grpc.GenericRpcHandler):
    """A node of the version before FetchRecordBatches, as far as fetching goes: it serves
    FetchRecords only (forwarded, with the caller's signature, to a real node) and gRPC
    answers any other method UNIMPLEMENTED. Remembers the methods it was asked."""

    def __init__(self, node: grpc.Channel) -> None:
        self.asked: list[str] = []
        self._fetch = node.unary_stream(
            "/hastream.v1.StreamTable/FetchRecords",
            request_serializer=pb.FetchRecordsRequest.SerializeToString,
            response_deserializer=pb.DataRecord.FromString,
        )
        self._handler = grpc.unary_stream_rpc_method_handler(
            self._forward,
            request_deserializer=pb.FetchRecordsRequest.FromString,
            response_serializer=pb.DataRecord.SerializeToString,
        )

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method.rsplit("/", 1)[-1]
        self.asked.append(method)
        return self._handler if method == "FetchRecords" else None

    def _forward(self, request: pb.FetchRecordsRequest, context: Any) -> Iterator[pb.DataRecord]:
        signature = [(k, v) for k, v in context.invocation_metadata() if k == METADATA_KEY]
        yield from self._fetch(request, metadata=signature, timeout=60)


@pytest.mark.cluster
def test_a_peer_of_an_earlier_version_is_asked_fetch_records_and_remembered(
    cluster: LocalCluster,
) -> None:
    alias = sorted(cluster.nodes)[1]
    rows = cluster.row_count(alias, "small")
    expected = _one_by_one(cluster, alias, rows)
    channel = grpc.insecure_channel(cluster.nodes[alias].site)
    earlier = EarlierVersion(channel)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[earlier])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    clock = ManualClock()
    peers = PeerClient(_signer(), clock=clock)
    old_node = NodeAddress("127.0.0.1", port, "old")
    try:
        fetched = peers.fetch_records(old_node, GROUP, "small", 0, rows, 0)
        assert [_fields(record) for record in fetched] == expected
        assert earlier.asked == ["FetchRecordBatches", "FetchRecords"]
        # Remembered: the next fetch asks FetchRecords at once.
        fetched = peers.fetch_records(old_node, GROUP, "small", 0, 10, 0)
        assert [_fields(record)[1] for record in fetched] == list(range(10))
        assert earlier.asked[2:] == ["FetchRecords"]
        # ... for a while: it may have been upgraded since.
        clock.now += 3600
        assert len(list(peers.fetch_records(old_node, GROUP, "small", 0, 10, 0))) == 10
        assert earlier.asked[3:] == ["FetchRecordBatches", "FetchRecords"]
    finally:
        peers.close()
        server.stop(grace=None)
        channel.close()


@pytest.mark.cluster
def test_a_fetch_from_a_frozen_peer_is_given_up_once_it_sends_nothing(
    cluster: LocalCluster,
) -> None:
    """A peer SIGSTOPped after this client connected to it: its fetch is cancelled once it
    waited `fetch_idle_s` for a message (NodeUnavailable, so the repair asks the next
    peer), not after the fetch's 600 s deadline; the consumer's own time between messages
    does not count; once the peer runs again, the same client fetches from it."""
    alias = sorted(cluster.nodes)[2]
    rows = cluster.row_count(alias, "small")
    peer = _peer(cluster, alias)
    idle_s = 2.0
    peers = PeerClient(_signer(), fetch_idle_s=idle_s)
    try:
        # A consumer slower than the idle limit between messages (the repair's writes and
        # syncs): no message is late, so nothing is given up.
        consumed = 0
        for consumed, _ in enumerate(peers.fetch_records(peer, GROUP, "small", 0, rows, 0), 1):
            if consumed == 1:
                # The consumer holds the stream past the limit: what it waits for is that
                # moment itself, then it reads on.
                holds_until = time.monotonic() + idle_s * 1.5
                wait_until(
                    lambda until=holds_until: time.monotonic() >= until,
                    timeout_s=idle_s * 3,
                    message="the consumer's hold",
                )
        assert consumed == SMALL_RECORDS + 6
        cluster.signal(alias, signal.SIGSTOP)  # the connection stays open
        try:
            started = time.monotonic()
            with pytest.raises(NodeUnavailable, match=f"sent nothing for {idle_s:.0f} s"):
                list(peers.fetch_records(peer, GROUP, "small", 0, rows, 0))
            assert time.monotonic() - started < idle_s + 5
        finally:
            cluster.signal(alias, signal.SIGCONT)
        fetched = wait_until(
            lambda: list(peers.fetch_records(peer, GROUP, "small", 0, rows, 0)),
            timeout_s=30,
            message="fetched again",
        )
        assert len(fetched) == SMALL_RECORDS + 6
    finally:
        peers.close()
