"""An asyncio client: the Session's calls on `grpc.aio`, for asyncio programs.

    session = await api_clients.aio.connect("db1", 8901, highAvailabilitySites=[...])
    await session.haStreamTable(2, schema, "ticks", 100_000, keyColumn="id")
    result = await session.append("ticks", rows)          # committed on a majority
    table = await session.read("ticks", 0)
    async for first_offset, rows in session.subscribe("ticks", offset=0):
        ...

The same contract as the threaded client (connection.py), kept small: every call follows
the leader within a deadline, by the threaded client's own retry decision
(`call_policy.decide`: a NotLeader that names the leader goes there at once; an election,
an unreachable node or any other retryable error tries the next site after a capped
backoff; a TableNotFound is believed once every site said so). `append` carries a
producer id and a sequence per request, so a retry after a lost answer is answered from the
cluster's producer window, never appended twice. `subscribe` is an async iterator that
resumes after a failure from the row after the last one it yielded, on whichever node leads
then. Errors are the same typed errors (hastream.errors and api_clients.transport).

With `userid`/`password` it logs in at `connect` and sends the token with every call
(login.py). Appends go over a node's publish port once its answer over gRPC named one
(aio_port.py), as the threaded client's waited appends do. No hedging of silent leaders: a
frozen leader is left by gRPC keepalive (about 15 s), as the threaded client's backstop
does, or, over the port, when the attempt's timeout passes.

Not thread-safe: one event loop owns a session.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final, TypeVar

import grpc
import grpc.aio
import pyarrow as pa

from api_clients import admin, batches
from api_clients.aio_port import AioPublishPorts
from api_clients.call_policy import AttemptState, decide_after, leader_named
from api_clients.connection import (
    ATTEMPT_TIMEOUT_S_DEFAULT,
    CHANNEL_OPTIONS,
    DEADLINE_S_DEFAULT,
    parse_site,
)
from api_clients.dials import Dial, Dials
from api_clients.login import TOKEN_METADATA_KEY, Login
from api_clients.pipeline import append_result
from api_clients.publish_port import PortRefused, client_context
from api_clients.retry import BACKOFF_INITIAL_S, BACKOFF_MAX_S, Backoff
from api_clients.transport import SiteUnavailable, StreamBroken, never_connected, typed_error
from api_clients.types import AppendResult, TableInfo
from hastream.errors import InvalidArgument, RaftStoreError, SchemaMismatch, TableNotFound
from hastream.model import OFFSET_LATEST
from hastream.tls import ClientTls
from proto import hastream_pb2, hastream_pb2_grpc

T = TypeVar("T")

# Calls a group's leader answers: the site that answers one is remembered for the table.
_LEADER_METHODS: Final = frozenset({"Publish", "HaStreamTable", "DropStreamTable"})
# Tables whose schema, producer id and sequence a session remembers (the oldest is forgotten
# beyond: its next append asks for the schema again, under a new producer id).
TABLES_REMEMBERED_MAX: Final = 1024


class AioSession:
    """A connection to the cluster through any of `sites` (see the module docstring)."""

    def __init__(
        self,
        sites: Sequence[str],
        *,
        userid: str | None = None,
        password: str | None = None,
        tls: ClientTls | None = None,
        timeout_s: float = ATTEMPT_TIMEOUT_S_DEFAULT,
        deadline_s: float = DEADLINE_S_DEFAULT,
    ) -> None:
        self._sites = list(dict.fromkeys(parse_site(site) for site in sites))
        if not self._sites:
            raise InvalidArgument("sites", "at least one site is needed")
        if (userid is None) != (password is None):
            raise InvalidArgument("userid/password", "give both or neither")
        self._login = None if userid is None or password is None else Login(userid, password)
        self._tls = tls
        self._credentials = None
        if tls is not None:
            pem = tls.read()
            self._credentials = grpc.ssl_channel_credentials(
                pem.ca, pem.private_key, pem.cert_chain
            )
        self._timeout_s = timeout_s
        self._deadline_s = deadline_s
        self._dials = Dials(self._new_dial, self._close_later, self._close_later)
        self._closing: set[asyncio.Task[None]] = set()  # channels' closes under way
        self._leaders: dict[str, str] = {}  # table -> site that answered as its leader
        self._preferred = self._sites[0]
        self._publishers: dict[str, tuple[bytes, int]] = {}  # table -> producer id, sequence
        # table -> its schema as last fetched: an append asked the cluster for it every time,
        # a second round trip as long as the publish itself.
        self._schemas: dict[str, pa.Schema] = {}
        # Publishes over the nodes' publish ports (TLS as on the client port).
        self._ports = (
            AioPublishPorts()
            if tls is None
            else AioPublishPorts(tls=client_context(tls), server_name=tls.server_name)
        )

    # -- lifecycle -------------------------------------------------------------------

    async def close(self) -> None:
        await self._ports.close()
        self._dials.close()
        await asyncio.gather(*self._closing)

    async def __aenter__(self) -> AioSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _new_dial(self, site: str) -> Dial:
        options: list[tuple[str, Any]] = list(CHANNEL_OPTIONS)
        if self._tls is not None and self._tls.server_name is not None:
            options.append(("grpc.ssl_target_name_override", self._tls.server_name))
        channel = (
            grpc.aio.insecure_channel(site, options=options)
            if self._credentials is None
            else grpc.aio.secure_channel(site, self._credentials, options=options)
        )
        return Dial(site, channel, hastream_pb2_grpc.StreamTableStub(channel))

    def _close_later(self, dial: Dial) -> None:
        """Closes `dial`'s channel on this loop (an aio channel's close is awaited)."""
        task = asyncio.get_running_loop().create_task(dial.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _typed(
        self, rpc_error: grpc.aio.AioRpcError, dial: Dial, timeout_s: float | None
    ) -> RaftStoreError:
        """The typed error of a failed call on `dial`; a site it could not connect to at all
        gets a new channel for the calls after it (api_clients/dials.py)."""
        error = typed_error(rpc_error, dial.site, timeout_s)
        if isinstance(error, SiteUnavailable) and never_connected(error):
            self._dials.retire(dial)
        return error

    async def _metadata(self) -> tuple[tuple[str, str], ...]:
        if self._login is None:
            return ()
        token = self._login.token()
        if token is None:
            token = await self.login()
        return ((TOKEN_METADATA_KEY, token),) if token else ()

    async def login(self) -> str:
        """Log in now (connect does): raises Unauthenticated. Returns the token."""
        if self._login is None:
            return ""
        return self._login.accept(await self.call("Login", self._login.request()))

    # -- calls -----------------------------------------------------------------------

    def _backoff(self) -> Backoff:
        return Backoff(BACKOFF_INITIAL_S, BACKOFF_MAX_S, self._deadline_s)

    async def _retry_at(
        self,
        memory: AttemptState,
        target: str,
        error: RaftStoreError,
        backoff: Backoff,
        table: str | None,
    ) -> tuple[AttemptState, str]:
        """Where the next attempt goes after `error` on `target`: the threaded client's own
        decision (`call_policy.decide`), with an asyncio wait. Raises `error` when the call
        ends."""
        hint = self._learn(leader_named(error))
        decision = decide_after(
            memory,
            error,
            target=target,
            sites=tuple(self._sites),
            time_left=backoff.remaining_s() > 0,
            hint=None if hint == target else hint,
        )
        if decision.forget_leader and table is not None:
            self._leaders.pop(table, None)
        if decision.target is None or (decision.backoff and not await backoff.wait_async()):
            raise error
        return decision.state, decision.target

    async def call(self, method_name: str, request: Any, *, table: str | None = None) -> Any:
        """Send the unary `request`, following the leader (see the module docstring)."""
        backoff = self._backoff()
        target = self._leaders.get(table or "", self._preferred)
        memory = AttemptState(
            target=target, sites=(), time_left=True, table_lookup=table is not None
        )
        while True:
            timeout_s = max(0.01, min(self._timeout_s, backoff.remaining_s()))
            metadata = () if method_name == "Login" else await self._metadata()
            with self._dials.call(target) as dial:
                try:
                    if method_name == "Publish":
                        reply = await self._publish_once(dial, request, timeout_s, metadata)
                    else:
                        method = getattr(dial.stub, method_name)
                        reply = await method(request, timeout=timeout_s, metadata=metadata)
                    error: RaftStoreError | None = None
                except grpc.aio.AioRpcError as rpc_error:
                    error = self._typed(rpc_error, dial, timeout_s)
                except RaftStoreError as failed:  # the publish port's, typed as gRPC's are
                    error = failed
            if error is not None:
                memory, target = await self._retry_at(memory, target, error, backoff, table)
                continue
            self._preferred = target
            if table is not None and method_name in _LEADER_METHODS:
                self._leaders[table] = target
            return reply

    async def _publish_once(
        self,
        dial: Dial,
        request: hastream_pb2.PublishRequest,
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...],
    ) -> hastream_pb2.PublishResponse:
        """One Publish attempt on `dial.site`: over its publish port when it has one
        (aio_port.py), else over gRPC (`dial`), whose answer names the port."""
        target = dial.site
        if self._ports.usable(target, len(request.payload)):
            token = dict(metadata).get(TOKEN_METADATA_KEY, "")
            with contextlib.suppress(PortRefused):  # nothing was sent: gRPC it is
                return await self._ports.publish(target, request, token, timeout_s)
        reply: hastream_pb2.PublishResponse = await dial.stub.Publish(
            request, timeout=timeout_s, metadata=metadata
        )
        self._ports.learn(target, reply.publish_port)
        return reply

    def _learn(self, address: str | None) -> str | None:
        if address is None:
            return None
        try:
            site = parse_site(address)
        except InvalidArgument:
            return None
        if site not in self._sites:
            self._sites.append(site)
        return site

    # -- tables ----------------------------------------------------------------------

    async def haStreamTable(
        self,
        raftGroup: int,
        schema: pa.Schema | pa.Table | Any,
        tableName: str,
        cacheLimit: int,
        keyColumn: str | None = None,
        retentionMinutes: int = 1440,
    ) -> TableInfo:
        request = admin.create_table_request(
            raft_group=raftGroup,
            schema=schema,
            table=tableName,
            cache_limit=cacheLimit,
            key_column=keyColumn,
            retention_minutes=retentionMinutes,
        )
        reply = await self.call("HaStreamTable", request, table=tableName)
        return admin.table_info_from_proto(reply)

    async def dropStreamTable(self, tableName: str, force: bool = False) -> None:
        request = hastream_pb2.DropTableRequest(table=tableName, force=force)
        await self.call("DropStreamTable", request, table=tableName)
        self._forget(tableName)

    async def getTableInfo(self, tableName: str) -> TableInfo:
        request = hastream_pb2.TableRequest(table=tableName)
        return admin.table_info_from_proto(await self.call("GetTableInfo", request))

    async def getStreamingLeader(self, groupId: int) -> str:
        request = hastream_pb2.GroupRequest(raft_group=groupId)
        return str((await self.call("GetStreamingLeader", request)).leader)

    # -- users and grants (DolphinDB's names; admins only) -----------------------------

    async def createUser(self, userId: str, password: str, isAdmin: bool = False) -> None:
        """A new user (UserExists if the name is taken); the password needs 8+ characters."""
        await self.call("ManageAccess", admin.create_user_request(userId, password, isAdmin))

    async def deleteUser(self, userId: str) -> None:
        """Removes the user and its grants; its tokens stop working at once."""
        await self.call("ManageAccess", admin.delete_user_request(userId))

    async def resetPwd(self, userId: str, newPwd: str) -> None:
        """A new password; the user's sessions must log in again."""
        await self.call("ManageAccess", admin.reset_password_request(userId, newPwd))

    async def grant(self, userId: str, accessType: str, objs: str | Sequence[str] = "*") -> None:
        """Grant TABLE_READ or TABLE_WRITE on tables (`objs`: one name, names, or "*")."""
        for request in admin.rule_requests("grant", userId, accessType, objs):
            await self.call("ManageAccess", request)

    async def deny(self, userId: str, accessType: str, objs: str | Sequence[str] = "*") -> None:
        """Deny TABLE_READ or TABLE_WRITE on tables: a denial beats any grant."""
        for request in admin.rule_requests("deny", userId, accessType, objs):
            await self.call("ManageAccess", request)

    async def revoke(self, userId: str, accessType: str, objs: str | Sequence[str] = "*") -> None:
        """Remove the grant or denial of `accessType` on exactly these tables."""
        for request in admin.rule_requests("revoke", userId, accessType, objs):
            await self.call("ManageAccess", request)

    async def getUserAccess(self) -> list[dict[str, Any]]:
        """Every user with its admin flag and rules (never a password hash)."""
        return admin.users_from_access(await self.call("GetAccess", hastream_pb2.Empty()))

    async def getUserList(self) -> list[str]:
        return [entry["user"] for entry in await self.getUserAccess()]

    # -- data ------------------------------------------------------------------------

    async def append(self, tableName: str, data: object) -> AppendResult:
        """Append `data` (a pyarrow Table, a pandas DataFrame or rows) to the table, in
        requests of at most the wire's batch size; the result of the first request, or of
        the only one. Each request is retried with its producer id and sequence.

        The table's schema is fetched once and remembered. When the data does not match it,
        or the cluster refuses the first request for its schema or no longer has the table
        (it may have been dropped and created again with another schema), the schema is
        fetched again: data that matches the new one is appended (nothing of it was), other
        data raises."""
        cached = self._schemas.get(tableName)
        table = await self._table_rows(tableName, data)
        chunks = batches.encode_chunks(table)
        try:
            first = await self._publish(tableName, chunks[0])
        except (SchemaMismatch, TableNotFound):
            self._forget(tableName)  # and its producer: a table created again starts afresh
            fresh = None if cached is None else await self._changed_schema(tableName, table.schema)
            if fresh is None:
                raise
            chunks = batches.encode_chunks(batches.to_table(data, fresh, tableName))
            first = await self._publish(tableName, chunks[0])
        for chunk in chunks[1:]:
            await self._publish(tableName, chunk)
        return first

    async def _table_rows(self, tableName: str, data: object) -> pa.Table:
        """`data` as a table of the table's schema (the remembered one, or a fresh one when
        it does not match that)."""
        cached = self._schemas.get(tableName)
        schema = cached or await self._schema(tableName)
        try:
            return batches.to_table(data, schema, tableName)
        except SchemaMismatch:
            fresh = None if cached is None else await self._changed_schema(tableName, schema)
            if fresh is None:
                raise
            return batches.to_table(data, fresh, tableName)

    def _forget(self, tableName: str) -> None:
        self._schemas.pop(tableName, None)
        self._publishers.pop(tableName, None)

    async def _changed_schema(self, tableName: str, than: pa.Schema) -> pa.Schema | None:
        """The table's schema fetched again, if it is not `than` (the schema the data was
        converted to); None when it is the same. Raises TableNotFound when the table is
        really gone."""
        fresh = await self._schema(tableName)
        return None if fresh.equals(than, check_metadata=True) else fresh

    async def _schema(self, tableName: str) -> pa.Schema:
        """The table's schema as the cluster has it now; remembered."""
        schema = (await self.getTableInfo(tableName)).schema
        _remember(self._schemas, tableName, schema)
        return schema

    async def _publish(self, tableName: str, chunk: batches.EncodedChunk) -> AppendResult:
        """One request, under the table's producer id and its next sequence."""
        producer_id, sequence = self._publishers.get(tableName, (secrets.token_bytes(16), 0))
        _remember(self._publishers, tableName, (producer_id, sequence + 1))
        request = hastream_pb2.PublishRequest(
            table=tableName, producer_id=producer_id, sequence=sequence + 1, payload=chunk.payload
        )
        return append_result(await self.call("Publish", request, table=tableName))

    async def read(self, tableName: str, offsetFrom: int, offsetTo: int = -1) -> pa.Table:
        """The rows `[offsetFrom, offsetTo)`, from any replica; `-1`: up to the end, read at
        the leader (every acknowledged row: a follower learns of the newest a few ms later,
        and answers NotLeader). A broken stream is resumed where it stopped."""
        info = await self.getTableInfo(tableName)
        parts: list[pa.Table] = []
        position = offsetFrom
        backoff = self._backoff()
        to_end = offsetTo < 0
        target = self._leaders.get(tableName, self._preferred) if to_end else self._preferred
        memory = AttemptState(target=target, sites=(), time_left=True)
        while to_end or position < offsetTo:  # Bounded: every retry takes a wait.
            request = hastream_pb2.ReadRequest(
                table=tableName,
                offset_from=position,
                offset_to=offsetTo,
                end_at_leader=to_end,
            )
            metadata = await self._metadata()
            error: RaftStoreError | None = None
            with self._dials.call(target) as dial:
                try:
                    stream = dial.stub.Read(request, timeout=self._timeout_s, metadata=metadata)
                    async for message in stream:
                        parts.append(batches.decode(message.payload))
                        position = message.first_offset + message.row_count
                except grpc.aio.AioRpcError as rpc_error:
                    error = self._typed(rpc_error, dial, self._timeout_s)
            if error is None:
                if to_end:
                    self._leaders[tableName] = target
                    break
                if position >= offsetTo:
                    break
                # A follower behind the range's end: asked again after a wait, as any failure.
                error = StreamBroken(target, f"the read ended at {position} before {offsetTo}")
            table = tableName if to_end else None
            memory, target = await self._retry_at(memory, target, error, backoff, table)
        return pa.concat_tables(parts) if parts else info.schema.empty_table()

    async def subscribe(
        self,
        tableName: str,
        offset: int = OFFSET_LATEST,
        actionName: str = "default",
        batchRows: int = 0,
    ) -> AsyncIterator[tuple[int, pa.Table]]:
        """(first offset, rows) for every batch of the table from `offset` (DolphinDB's -1:
        new rows only; -2: after the action's persisted offset; -3: the earliest retained),
        for ever, from whichever node leads; resumes after a failure from the row after the
        last one yielded. Ends with a non-retryable error, or when the caller stops."""
        await self.getTableInfo(tableName)  # TableNotFound now, not in the loop
        position = offset
        target = self._leaders.get(tableName, self._preferred)
        while True:
            # A fresh budget per outage: a subscription lasts for ever, its retries do not.
            backoff = self._backoff()
            memory = AttemptState(target=target, sites=(), time_left=True)
            request = hastream_pb2.SubscribeRequest(
                table=tableName, action_name=actionName, offset=position, batch_rows=batchRows
            )
            metadata = await self._metadata()
            error: RaftStoreError | None = None
            # The stream counts on its channel while the caller holds its rows too.
            with self._dials.call(target) as dial:
                try:
                    stream = dial.stub.Subscribe(request, metadata=metadata)
                    async for message in stream:
                        if message.row_count == 0:
                            continue  # a heartbeat
                        rows = batches.decode(message.payload)
                        position = message.first_offset + message.row_count
                        yield message.first_offset, rows
                except grpc.aio.AioRpcError as rpc_error:
                    error = self._typed(rpc_error, dial, None)
            if error is not None:
                memory, target = await self._retry_at(memory, target, error, backoff, tableName)

    async def commitOffset(self, tableName: str, offset: int, actionName: str = "default") -> None:
        """Persist `offset` as the last row the action processed (for `offset=-2`)."""
        request = hastream_pb2.CommitOffsetRequest(
            table=tableName, action_name=actionName, offset=offset
        )
        await self.call("CommitOffset", request, table=tableName)


async def connect(
    host: str,
    port: int,
    userid: str | None = None,
    password: str | None = None,
    highAvailabilitySites: Sequence[str] | None = None,
    *,
    tls: bool = False,
    caFile: str | None = None,
    certFile: str | None = None,
    keyFile: str | None = None,
    deadline_s: float = DEADLINE_S_DEFAULT,
) -> AioSession:
    """`connection.connect`'s asyncio twin: logs in now when `userid` is given."""
    wants_tls = tls or any(path is not None for path in (caFile, certFile, keyFile))
    session = AioSession(
        [f"{host}:{port}", *(highAvailabilitySites or ())],
        userid=userid,
        password=password,
        tls=ClientTls(caFile, certFile, keyFile) if wants_tls else None,
        deadline_s=deadline_s,
    )
    if userid is not None:
        try:
            await session.login()
        except BaseException:
            await session.close()
            raise
    return session


def _remember(memory: dict[str, T], table: str, value: T) -> None:
    """`memory[table] = value`, forgetting the oldest table beyond TABLES_REMEMBERED_MAX."""
    memory.pop(table, None)
    memory[table] = value
    while len(memory) > TABLES_REMEMBERED_MAX:
        del memory[next(iter(memory))]


__all__ = ["AioSession", "connect"]
