"""gRPC calls from one node to another: fetching data-file records for repair, and the
catalog of table names (claims go to the catalog group's leader)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import grpc

from hastream import errors
from hastream.errors import NodeUnavailable
from hastream.model import NodeAddress, TableDigest
from proto import hastream_pb2, hastream_pb2_grpc
from raftstore import limits
from raftstore.peer_auth import PeerSigner
from raftstore.storage.segments import DataRecord

log = logging.getLogger(__name__)

_FETCH_TIMEOUT_S = 600.0
# A peer that does not serve FetchRecordBatches (a node of an earlier version, during a
# rolling upgrade) is asked FetchRecords for this long, then FetchRecordBatches again: by
# then it may run the new version. Asking costs one round trip.
_WITHOUT_BATCHES_RECHECK_S: Final = 300.0
_CATALOG_TIMEOUT_S = 10.0
_DIGEST_TIMEOUT_S = 60.0


class PeerClient:
    """One cached channel per peer. Thread-safe."""

    def __init__(
        self,
        signer: PeerSigner,
        credentials: grpc.ChannelCredentials | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        fetch_idle_s: float = limits.PEER_FETCH_IDLE_S,
    ) -> None:
        """`credentials`: TLS to the peers' client ports (None: plaintext). A fetch that
        waits `fetch_idle_s` for the peer's next message is given up (NodeUnavailable)."""
        self._signer = signer
        self._credentials = credentials
        self._clock = clock
        self._idle_s = fetch_idle_s
        self._lock = threading.Lock()
        self._stubs: dict[NodeAddress, hastream_pb2_grpc.StreamTableStub] = {}
        self._channels: list[grpc.Channel] = []
        # Peers that answered FetchRecordBatches with UNIMPLEMENTED, and when.
        self._without_batches: dict[NodeAddress, float] = {}

    def _stub(self, peer: NodeAddress) -> hastream_pb2_grpc.StreamTableStub:
        with self._lock:
            stub = self._stubs.get(peer)
            if stub is None:
                target = f"{peer.host}:{peer.port}"
                options = [
                    ("grpc.max_receive_message_length", limits.GRPC_MESSAGE_BYTES_MAX),
                    ("grpc.max_send_message_length", limits.GRPC_MESSAGE_BYTES_MAX),
                ]
                channel = (
                    grpc.insecure_channel(target, options=options)
                    if self._credentials is None
                    else grpc.secure_channel(target, self._credentials, options=options)
                )
                self._channels.append(channel)
                stub = self._stubs[peer] = hastream_pb2_grpc.StreamTableStub(channel)
            return stub

    def fetch_records(
        self,
        peer: NodeAddress,
        group_id: int,
        table: str,
        offset_from: int,
        offset_to: int,
        created_lsn: int,
    ) -> Iterator[DataRecord]:
        """Records covering [offset_from, offset_to) of the incarnation created at
        `created_lsn`, as the peer stores them. Raises IncarnationDropped when the peer has
        applied its drop."""
        request = hastream_pb2.FetchRecordsRequest(
            raft_group=group_id,
            table=table,
            offset_from=offset_from,
            offset_to=offset_to,
            created_lsn=created_lsn,
        )
        if self._has_batches(peer):
            try:
                yield from self._fetch_batches(peer, request)
                return
            except _BatchesUnimplemented:
                self._lacks_batches(peer)
        yield from self._fetch_one_by_one(peer, request)

    def _fetch_batches(
        self, peer: NodeAddress, request: hastream_pb2.FetchRecordsRequest
    ) -> Iterator[DataRecord]:
        """FetchRecordBatches. Raises _BatchesUnimplemented when the peer does not serve it
        (before any record came), else the peer's typed error or NodeUnavailable."""
        received = False
        call = self._stub(peer).FetchRecordBatches(
            request, metadata=self._signer.metadata("FetchRecordBatches"), timeout=_FETCH_TIMEOUT_S
        )
        try:
            for message in self._watched(peer, call):
                received = True
                for record in message.records:
                    yield _record(record)
        except grpc.RpcError as error:
            if not received and _unimplemented(error):
                raise _BatchesUnimplemented from None
            raise _typed(peer, error) from None

    def _fetch_one_by_one(
        self, peer: NodeAddress, request: hastream_pb2.FetchRecordsRequest
    ) -> Iterator[DataRecord]:
        """FetchRecords, which every version serves: one record per message."""
        call = self._stub(peer).FetchRecords(
            request, metadata=self._signer.metadata("FetchRecords"), timeout=_FETCH_TIMEOUT_S
        )
        try:
            for message in self._watched(peer, call):
                yield _record(message)
        except grpc.RpcError as error:
            raise _typed(peer, error) from None

    def _watched(self, peer: NodeAddress, call: Any) -> Iterator[Any]:
        """The messages of a fetch `call` under a `_SilenceWatch`: NodeUnavailable once the
        peer has sent nothing for the idle limit; any other failure the call's RpcError."""
        try:
            with _SilenceWatch(call, self._idle_s) as watch:
                yield from watch.messages()
        except grpc.RpcError:
            if watch.gave_up:
                raise NodeUnavailable(
                    f"peer {peer} sent nothing for {self._idle_s:.0f} s: the next peer is asked"
                ) from None
            raise

    def _has_batches(self, peer: NodeAddress) -> bool:
        """False while `peer` is remembered to lack FetchRecordBatches."""
        with self._lock:
            since = self._without_batches.get(peer)
            if since is None:
                return True
            if self._clock() - since < _WITHOUT_BATCHES_RECHECK_S:
                return False
            del self._without_batches[peer]  # upgraded since, perhaps: ask again
            return True

    def _lacks_batches(self, peer: NodeAddress) -> None:
        with self._lock:
            self._without_batches[peer] = self._clock()
        log.info(
            "peer %s does not serve FetchRecordBatches (an earlier version): fetching one "
            "record per message from it for %.0f s",
            peer,
            _WITHOUT_BATCHES_RECHECK_S,
        )

    def claim_name(self, peer: NodeAddress, table: str, group_id: int, nonce: bytes) -> None:
        """Ask `peer` (the catalog group's leader) to claim `table` for `group_id`. Raises
        TableExists (another group owns it), NotLeader, NodeUnavailable."""
        request = hastream_pb2.NameClaim(table=table, raft_group=group_id, nonce=nonce)
        try:
            self._stub(peer).ClaimTableName(
                request,
                metadata=self._signer.metadata("ClaimTableName"),
                timeout=_CATALOG_TIMEOUT_S,
            )
        except grpc.RpcError as error:
            raise _typed(peer, error) from None

    def release_name(self, peer: NodeAddress, table: str, group_id: int, nonce: bytes) -> None:
        request = hastream_pb2.NameClaim(table=table, raft_group=group_id, nonce=nonce)
        try:
            self._stub(peer).ReleaseTableName(
                request,
                metadata=self._signer.metadata("ReleaseTableName"),
                timeout=_CATALOG_TIMEOUT_S,
            )
        except grpc.RpcError as error:
            raise _typed(peer, error) from None

    def name_claims(self, peer: NodeAddress, catalog_group: int) -> dict[str, tuple[int, bytes]]:
        """The catalog as `peer` has applied it: table -> (owning group, claim nonce)."""
        request = hastream_pb2.GroupRequest(raft_group=catalog_group)
        try:
            reply = self._stub(peer).GetTableClaims(
                request,
                metadata=self._signer.metadata("GetTableClaims"),
                timeout=_CATALOG_TIMEOUT_S,
            )
        except grpc.RpcError as error:
            raise _typed(peer, error) from None
        return {claim.table: (claim.raft_group, claim.nonce) for claim in reply.claims}

    def access_control(self, peer: NodeAddress, catalog_group: int) -> list[dict[str, Any]]:
        """The users and grants as `peer` (a catalog member) has applied them (access.py's
        `to_json`, hashes included: peer calls are signed and may be encrypted)."""
        request = hastream_pb2.GroupRequest(raft_group=catalog_group)
        try:
            reply = self._stub(peer).GetAccessControl(
                request,
                metadata=self._signer.metadata("GetAccessControl"),
                timeout=_CATALOG_TIMEOUT_S,
            )
        except grpc.RpcError as error:
            raise _typed(peer, error) from None
        document: list[dict[str, Any]] = json.loads(reply.json)
        return document

    def table_digest(
        self, peer: NodeAddress, group_id: int, table: str, offset_from: int, offset_to: int
    ) -> TableDigest:
        request = hastream_pb2.TableDigestRequest(
            raft_group=group_id, table=table, offset_from=offset_from, offset_to=offset_to
        )
        try:
            reply = self._stub(peer).GetTableDigest(
                request, metadata=self._signer.metadata("GetTableDigest"), timeout=_DIGEST_TIMEOUT_S
            )
        except grpc.RpcError as error:
            raise _typed(peer, error) from None
        return TableDigest(
            offset_from=reply.offset_from,
            offset_to=reply.offset_to,
            records=reply.records,
            digest=reply.digest,
            earliest_offset=reply.earliest_offset,
            row_count=reply.row_count,
        )

    def repair_table(self, peer: NodeAddress, group_id: int, table: str, reason: str) -> None:
        request = hastream_pb2.RepairTableRequest(raft_group=group_id, table=table, reason=reason)
        try:
            self._stub(peer).RepairTable(
                request, metadata=self._signer.metadata("RepairTable"), timeout=_CATALOG_TIMEOUT_S
            )
        except grpc.RpcError as error:
            raise _typed(peer, error) from None

    def transfer_leadership(
        self, peer: NodeAddress, group_id: int, to_alias: str, timeout_s: float
    ) -> str:
        """Ask `peer` (the group's leader) to hand the group to `to_alias`; the new leader
        (`host:port:alias`, advertised). Raises the peer's typed error (NotLeader,
        TransferFailed...) or NodeUnavailable."""
        request = hastream_pb2.TransferLeadershipRequest(
            raft_group=group_id, to_node=to_alias, timeout_s=timeout_s
        )
        try:
            reply = self._stub(peer).TransferLeadership(
                request,
                metadata=self._signer.metadata("TransferLeadership"),
                timeout=timeout_s + 5.0,
            )
        except grpc.RpcError as error:
            raise _typed(peer, error) from None
        return str(reply.leader)

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._stubs.clear()


class _SilenceWatch:
    """Cancels a server-streaming `call` once it has waited `idle_s` for the next message
    (the first one included: it covers connecting). Only the wait counts: the time the
    consumer spends on a message (writing and syncing fetched records) does not. One
    request-scoped thread per call, ended with it."""

    def __init__(self, call: Any, idle_s: float) -> None:
        self._call = call
        self._idle_s = idle_s
        self._waiting_since: float | None = None
        self._done = threading.Event()
        self.gave_up = False

    def __enter__(self) -> _SilenceWatch:
        threading.Thread(target=self._watch, name="peer-fetch-watch", daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._call.cancel()  # a consumer that stopped early leaves nothing running

    def messages(self) -> Iterator[Any]:
        """The call's messages, each waited for under the watch."""
        while True:
            self._waiting_since = time.monotonic()
            try:
                message = next(self._call)
            except StopIteration:
                return
            finally:
                self._waiting_since = None
            yield message

    def _watch(self) -> None:
        while True:
            since = self._waiting_since
            left = self._idle_s if since is None else since + self._idle_s - time.monotonic()
            if left <= 0:
                self.gave_up = True
                self._call.cancel()  # the waiting next() raises CANCELLED
                return
            if self._done.wait(left):
                return


class _BatchesUnimplemented(Exception):
    """The peer answered FetchRecordBatches with UNIMPLEMENTED: it runs an earlier version."""


def _unimplemented(error: grpc.RpcError) -> bool:
    """gRPC's own answer to a method the server does not know (not a typed error)."""
    call: Any = error
    metadata = {k: v for k, v in call.trailing_metadata() or () if isinstance(v, str)}
    return bool(call.code() == grpc.StatusCode.UNIMPLEMENTED and errors.from_wire(metadata) is None)


def _record(message: hastream_pb2.DataRecord) -> DataRecord:
    return DataRecord(
        lsn=message.lsn,
        first_offset=message.first_offset,
        row_count=message.row_count,
        timestamp_ms=message.timestamp_ms,
        payload=message.payload,
    )


def _typed(peer: NodeAddress, error: grpc.RpcError) -> errors.RaftStoreError:
    """The peer's typed error (from trailing metadata), or NodeUnavailable."""
    call: Any = error  # a raised RpcError is also the call: it has trailing metadata
    metadata = {k: v for k, v in call.trailing_metadata() or () if isinstance(v, str)}
    typed = errors.from_wire(metadata)
    if typed is not None:  # e.g. OffsetOutOfRange: the peer no longer holds the rows
        return typed
    return NodeUnavailable(f"peer {peer}: {error.code().name} {error.details()}")
