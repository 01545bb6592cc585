"""gRPC calls from one node to another: fetching data-file records for catch-up."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc

from proto import hastream_pb2, hastream_pb2_grpc
from raftstore import errors, limits
from raftstore.errors import NodeUnavailable
from raftstore.model import NodeAddress
from raftstore.storage.segments import DataRecord

_FETCH_TIMEOUT_S = 600.0


class PeerClient:
    """One cached channel per peer. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stubs: dict[NodeAddress, hastream_pb2_grpc.StreamTableStub] = {}
        self._channels: list[grpc.Channel] = []

    def _stub(self, peer: NodeAddress) -> hastream_pb2_grpc.StreamTableStub:
        with self._lock:
            stub = self._stubs.get(peer)
            if stub is None:
                channel = grpc.insecure_channel(
                    f"{peer.host}:{peer.port}",
                    options=[
                        ("grpc.max_receive_message_length", limits.GRPC_MESSAGE_BYTES_MAX),
                        ("grpc.max_send_message_length", limits.GRPC_MESSAGE_BYTES_MAX),
                    ],
                )
                self._channels.append(channel)
                stub = self._stubs[peer] = hastream_pb2_grpc.StreamTableStub(channel)
            return stub

    def fetch_records(
        self, peer: NodeAddress, group_id: int, table: str, offset_from: int, offset_to: int
    ) -> Iterator[DataRecord]:
        """Records covering [offset_from, offset_to) as the peer stores them."""
        request = hastream_pb2.FetchRecordsRequest(
            raft_group=group_id, table=table, offset_from=offset_from, offset_to=offset_to
        )
        try:
            for message in self._stub(peer).FetchRecords(request, timeout=_FETCH_TIMEOUT_S):
                yield DataRecord(
                    lsn=message.lsn,
                    first_offset=message.first_offset,
                    row_count=message.row_count,
                    timestamp_ms=message.timestamp_ms,
                    payload=message.payload,
                )
        except grpc.RpcError as error:
            call: Any = error  # a raised RpcError is also the call: it has trailing metadata
            metadata = {k: v for k, v in call.trailing_metadata() or () if isinstance(v, str)}
            typed = errors.from_wire(metadata)
            if typed is not None:  # e.g. OffsetOutOfRange: the peer no longer holds the rows
                raise typed from None
            raise NodeUnavailable(f"peer {peer}: {error.code().name} {error.details()}") from None

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._stubs.clear()
