"""Client threads that drive a real cluster through the real client (`api_clients`) and
record every outcome in a `Ledger`: writers that wait for each acknowledgement, writers
that pipeline (`Publisher.append_async`), a `persistOffset=True` subscriber, an offset
committer, and table churn (create / drop / re-create, one name from several clients and
in two groups).

Each thread is paced (a short random pause between calls), because the test machine is
shared; pacing is not synchronisation. A worker that hits an exception the client is not
documented to raise keeps it in `unexpected` and stops; the runner reports it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
import pyarrow as pa

from api_clients import AppendResult, Publisher, Session, aio, connect
from deploy.local_cluster import LocalCluster, read_stream
from hastream.errors import (
    BatchTooLarge,
    EmptyBatch,
    InvalidArgument,
    RaftStoreError,
    SchemaMismatch,
    TableExists,
    TableNotFound,
    TableSubscribed,
    UnknownGroup,
)
from proto import hastream_pb2, hastream_pb2_grpc
from tests.chaos.model import WRITER_SPAN, Append, Commit, Drop, Ledger, Outcome, ReadHistory

log = logging.getLogger(__name__)

SCHEMA: Final = pa.schema([("id", pa.int64()), ("writer", pa.int32()), ("note", pa.string())])
KEY_COLUMN: Final = "id"
SESSION_DEADLINE_S: Final = 20.0
CHURN_DEADLINE_S: Final = 8.0
PACE_S: Final = 0.03  # mean pause between two calls of one thread
ROWS_MAX: Final = 40  # rows per append
REFUSALS: Final = (
    SchemaMismatch,
    BatchTooLarge,
    EmptyBatch,
    InvalidArgument,
    TableExists,
    TableSubscribed,
    UnknownGroup,
)


def rows(first_key: int, count: int) -> pa.Table:
    keys = list(range(first_key, first_key + count))
    return pa.table(
        {
            "id": pa.array(keys, pa.int64()),
            "writer": pa.array([key // WRITER_SPAN for key in keys], pa.int32()),
            "note": pa.array([f"r{key % WRITER_SPAN}" for key in keys], pa.string()),
        },
        schema=SCHEMA,
    )


def sites_of(cluster: LocalCluster) -> list[str]:
    return [f"127.0.0.1:{node.port}" for node in cluster.nodes.values()]


def session_for(cluster: LocalCluster, deadline_s: float = SESSION_DEADLINE_S) -> Session:
    """A client session over every node of `cluster`, as an application would open it."""
    sites = sites_of(cluster)
    host, port = sites[0].split(":")
    return connect(host, int(port), highAvailabilitySites=sites[1:], deadline_s=deadline_s)


def outcome_of(error: BaseException) -> Outcome:
    """REFUSED only for errors a request gets before anything is proposed (validation);
    UNKNOWN for the rest. TableNotFound too: the client raises it after retries, and an
    earlier attempt of the same call may have been applied before the table was dropped."""
    if isinstance(error, REFUSALS):
        return Outcome.REFUSED
    return Outcome.UNKNOWN


@dataclass
class Worker:
    """One client thread with its own session. `run_once` does one call; the thread loops
    until `stop()`."""

    name: str
    cluster: LocalCluster
    ledger: Ledger
    rng: random.Random
    stop_event: threading.Event = field(default_factory=threading.Event)
    unexpected: list[str] = field(default_factory=list)
    pace_s: float = PACE_S  # mean pause between two calls
    calls: int = 0
    errors: int = 0
    last_error: str = ""
    _session: Session | None = None
    _thread: threading.Thread | None = None

    @property
    def session(self) -> Session:
        if self._session is None:
            self._session = session_for(self.cluster)
        return self._session

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 60) -> None:
        """Stop the thread and release the client (once; later calls do nothing)."""
        if self.stop_event.is_set():
            return
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.unexpected.append(f"{self.name}: did not stop within {timeout_s:.0f}s")
        try:
            self.close()
        except (RaftStoreError, grpc.RpcError, RuntimeError) as error:
            self.unexpected.append(f"{self.name}: close failed: {type(error).__name__}: {error}")
        if self._session is not None:
            self._session.close()

    def _main(self) -> None:
        try:
            while not self.stop_event.is_set():  # the worker's loop; ends on stop()
                self.run_once()
                self.calls += 1
                self.stop_event.wait(self.rng.uniform(0, 2 * self.pace_s))
        except Exception as error:  # reported by the runner, never swallowed
            log.exception("worker failed name=%s", self.name)
            self.unexpected.append(f"{self.name}: {type(error).__name__}: {error}")

    def run_once(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the worker holds besides its session (after the thread ended)."""

    def failed(self, error: BaseException) -> Outcome:
        """Count a failed call; returns its outcome."""
        self.errors += 1
        self.last_error = f"{type(error).__name__}: {error}"[:300]
        return outcome_of(error)

    def record_append(
        self, table: str, first: int, count: int, started: float, error: BaseException | None
    ) -> Outcome:
        """Record one append call (`error` None: acknowledged); returns its outcome."""
        outcome = Outcome.ACKED if error is None else self.failed(error)
        text = "" if error is None else self.last_error
        self.ledger.add(Append(table, first, count, started, time.monotonic(), outcome, text))
        return outcome


@dataclass
class AckedWriter(Worker):
    """Appends 1..ROWS_MAX rows per call with `Publisher.append` and waits for each answer.
    On a keyed table a failed append is sent again with the same keys (a new Publisher, so
    only the table's key dedup can stop a duplicate); otherwise new keys follow."""

    table: str = ""
    writer: int = 0
    keyed: bool = False
    _next: int = 0
    _retry: tuple[int, int] | None = None  # (first_key, count) to send again
    _publisher: Publisher | None = None

    def run_once(self) -> None:
        first, count = self._retry or (self.writer * WRITER_SPAN + self._next, self._count())
        if self._retry is None:
            self._next += count
        self._retry = None
        started = time.monotonic()
        try:
            self._append(rows(first, count))
        except (RaftStoreError, grpc.RpcError) as error:
            outcome = self.record_append(self.table, first, count, started, error)
            if self.keyed and outcome is Outcome.UNKNOWN:
                self._retry = (first, count)
                self._publisher = None
            return
        self.record_append(self.table, first, count, started, None)

    def _append(self, table: pa.Table) -> None:
        """One waited append (raises the client's typed errors)."""
        if self._publisher is None:
            self._publisher = Publisher(self.session, self.table)
        self._publisher.append(table)

    def _count(self) -> int:
        return self.rng.randint(1, ROWS_MAX)


@dataclass
class AioWriter(AckedWriter):
    """AckedWriter's appends through the asyncio client (`api_clients.aio`, over the nodes'
    publish ports once they are known), on an event loop of its own. The session keeps the
    table's producer id, so a resend of the same keys goes under its next sequence: as for
    AckedWriter, only the table's key dedup can stop a duplicate."""

    _loop: asyncio.AbstractEventLoop | None = None
    _aio: aio.AioSession | None = None

    def _append(self, table: pa.Table) -> None:
        if self._loop is None or self._aio is None:
            self._loop = asyncio.new_event_loop()
            self._aio = aio.AioSession(sites_of(self.cluster), deadline_s=SESSION_DEADLINE_S)
        self._loop.run_until_complete(self._aio.append(self.table, table))

    def close(self) -> None:
        if self._loop is None:
            return
        try:
            if self._aio is not None:
                self._loop.run_until_complete(self._aio.close())
        finally:
            self._loop.close()


@dataclass
class PipelinedWriter(Worker):
    """Appends with `Publisher.append_async` (up to `in_flight` requests in flight) and
    records each future's outcome when it completes."""

    table: str = ""
    writer: int = 0
    in_flight: int = 16
    _next: int = 0
    _publisher: Publisher | None = None
    _futures: list[Future[AppendResult]] = field(default_factory=list)

    def run_once(self) -> None:
        if self._publisher is None:
            self._publisher = Publisher(self.session, self.table, max_in_flight=self.in_flight)
        count = self.rng.randint(1, ROWS_MAX)
        first = self.writer * WRITER_SPAN + self._next
        self._next += count
        started = time.monotonic()
        future = self._publisher.append_async(rows(first, count))
        future.add_done_callback(lambda done: self._record(done, first, count, started))
        self._futures.append(future)
        self._futures = [pending for pending in self._futures if not pending.done()]

    def _record(self, future: Future[AppendResult], first: int, count: int, started: float) -> None:
        if future.cancelled():  # never answered before the writer stopped
            error: BaseException | None = TimeoutError("not answered before the writer stopped")
        else:
            error = future.exception()
        self.record_append(self.table, first, count, started, error)

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.flush(SESSION_DEADLINE_S)
            self._publisher.close()
        # Futures still pending were never answered: their rows may or may not be there.
        for future in self._futures:
            if not future.done():
                future.cancel()


@dataclass
class OffsetCommitter(Worker):
    """Commits offsets 0, 1, 2... of topic `table/action` (`CommitOffset`)."""

    table: str = ""
    action: str = "committer"
    _next: int = 0

    @property
    def topic(self) -> str:
        return f"{self.table}/{self.action}"

    def run_once(self) -> None:
        offset, self._next = self._next, self._next + 1
        request = hastream_pb2.CommitOffsetRequest(
            table=self.table, action_name=self.action, offset=offset
        )
        try:
            self.session.call("CommitOffset", request, table=self.table)
        except (RaftStoreError, grpc.RpcError) as error:
            self.ledger.add(Commit(self.topic, offset, self.failed(error)))
            return
        self.ledger.add(Commit(self.topic, offset, Outcome.ACKED))
        self.stop_event.wait(0.2)  # offsets need not be committed often


@dataclass
class TableChurn(Worker):
    """Creates (in a random group), drops and appends to tables named from `names`; several
    churn workers share the names, so one name is raced from two clients and two groups."""

    names: tuple[str, ...] = ()
    groups: tuple[int, ...] = (2, 3)
    writer: int = 0
    _next: int = 0
    _publishers: dict[str, Publisher] = field(default_factory=dict)

    @property
    def session(self) -> Session:
        if self._session is None:
            self._session = session_for(self.cluster, CHURN_DEADLINE_S)
        return self._session

    def run_once(self) -> None:
        name = self.rng.choice(self.names)
        if not self._exists(name):
            self._create(name)
        elif self.rng.random() < 0.25:
            self._drop(name)
        else:
            self._append(name)

    def _exists(self, name: str) -> bool:
        """Whether a node says the table exists (drops and appends go to existing tables:
        for an absent one the client may wait out its whole deadline, see the report)."""
        try:
            self.session.getTableInfo(name)
        except TableNotFound:
            return False
        except (RaftStoreError, grpc.RpcError) as error:
            self.failed(error)
            return self.rng.random() < 0.5
        return True

    def _create(self, name: str) -> None:
        group = self.rng.choice(self.groups)
        keyed = self.rng.random() < 0.5
        try:
            self.session.haStreamTable(group, SCHEMA, name, 1000, KEY_COLUMN if keyed else None)
        except TableExists:
            pass
        except (RaftStoreError, grpc.RpcError) as error:
            self.failed(error)

    def _drop(self, name: str) -> None:
        started = time.monotonic()
        try:
            self.session.dropStreamTable(name)
        except TableNotFound:
            self.ledger.add(Drop(name, started, time.monotonic(), Outcome.REFUSED))
            return
        except (RaftStoreError, grpc.RpcError) as error:
            self.ledger.add(Drop(name, started, time.monotonic(), self.failed(error)))
            return
        self.ledger.add(Drop(name, started, time.monotonic(), Outcome.ACKED))

    def _append(self, name: str) -> None:
        publisher = self._publishers.get(name)
        if publisher is None:
            publisher = self._publishers[name] = Publisher(self.session, name, schema=SCHEMA)
        count = self.rng.randint(1, ROWS_MAX)
        first = self.writer * WRITER_SPAN + self._next
        self._next += count
        started = time.monotonic()
        try:
            publisher.append(rows(first, count))
        except (RaftStoreError, grpc.RpcError) as error:
            self.record_append(name, first, count, started, error)
            return
        self.record_append(name, first, count, started, None)


@dataclass
class ReadProbe(Worker):
    """Reads a random stable table from a random node now and then, straight from that
    node (own channels: the runner's stubs are not shared across threads), into a
    `ReadHistory` per table."""

    tables: tuple[str, ...] = ()
    histories: dict[str, ReadHistory] = field(default_factory=dict)
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def run_once(self) -> None:
        alias = self.rng.choice(sorted(self.cluster.nodes))
        table = self.rng.choice(self.tables)
        history = self.histories.setdefault(table, ReadHistory(table))
        keys, error = self._read(alias, table)
        history.add(alias, keys, error)
        self.stop_event.wait(0.3)  # a read now and then, not a load

    def _read(self, alias: str, table: str) -> tuple[list[int] | None, str]:
        channel = self._channels.get(alias)
        if channel is None:
            address = f"127.0.0.1:{self.cluster.nodes[alias].port}"
            channel = self._channels[alias] = grpc.insecure_channel(address)
        stub = hastream_pb2_grpc.StreamTableStub(channel)
        request = hastream_pb2.ReadRequest(table=table, offset_from=0, offset_to=-1)
        keys: list[int] = []
        try:
            for message in stub.Read(request, timeout=10):
                if message.row_count:
                    keys += read_stream(message.payload).column(KEY_COLUMN).to_pylist()
        except grpc.RpcError as error:
            metadata = dict(error.trailing_metadata() or ())
            return None, metadata.get("hastream-error") or str(error.code())
        return keys, ""

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


@dataclass
class TableGroupsWatcher(Worker):
    """Polls GetStreamingRaftGroups on every node: a table listed in two groups at once is
    a violation, even when the end state is clean."""

    seen_in_two_groups: list[str] = field(default_factory=list)
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def run_once(self) -> None:
        for alias in sorted(self.cluster.nodes):
            self._watch(alias)

    def _watch(self, alias: str) -> None:
        channel = self._channels.get(alias)
        if channel is None:
            address = f"127.0.0.1:{self.cluster.nodes[alias].port}"
            channel = self._channels[alias] = grpc.insecure_channel(address)
        stub = hastream_pb2_grpc.StreamTableStub(channel)
        try:
            reply = stub.GetStreamingRaftGroups(hastream_pb2.Empty(), timeout=2)
        except grpc.RpcError:
            return  # the node is down or frozen: ask again next time
        groups_of: dict[str, list[int]] = {}
        for group in reply.groups:
            for table in group.tables:
                groups_of.setdefault(table, []).append(group.raft_group)
        for table, groups in groups_of.items():
            if len(groups) > 1:
                self.seen_in_two_groups.append(f"{table} in groups {groups} on {alias}")

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


class SubscriberProbe:
    """A `persistOffset=True` subscription from offset 0 that keeps every handler call as
    (first_offset, keys)."""

    def __init__(self, cluster: LocalCluster, table: str, action: str = "chaos") -> None:
        self.table = table
        self.deliveries: list[tuple[int, list[int]]] = []
        self._lock = threading.Lock()
        self._session = session_for(cluster)
        self._subscription = self._session.subscribe(
            table, self._handle, offset=0, actionName=action, throttle=0.2, persistOffset=True
        )

    def _handle(self, message: Any, first_offset: int) -> None:
        keys = [int(key) for key in message.column(KEY_COLUMN).to_pylist()]
        with self._lock:
            self.deliveries.append((first_offset, keys))

    def delivered_rows(self) -> int:
        with self._lock:
            return sum(len(keys) for _, keys in self.deliveries)

    def snapshot(self) -> list[tuple[int, list[int]]]:
        with self._lock:
            return list(self.deliveries)

    @property
    def error(self) -> BaseException | None:
        return self._subscription.error

    def close(self) -> None:
        self._session.close()  # stops the subscription, committing its offset
