"""An HA session over a list of sites: leader following, bounded retries, admin calls.

`Session.call` sends one unary request and follows the cluster: a NotLeader answer that
names the leader sends it there; a NotLeader without a leader (an election is running), an
unreachable node, or any other retryable error sends it to the next site after a capped,
jittered backoff. Everything is bounded by a deadline (default 30 s, longer than an election).
The leader that answered for a table or group is remembered, so later calls go straight there.

Threads: a Session is shared by publishers and subscribers on any number of threads. The
site list, channels and leader memory are guarded by one lock that is never held across
a network call. gRPC channels are thread-safe.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final

import grpc
import pyarrow as pa

from api_clients import admin
from api_clients.retry import BACKOFF_INITIAL_S, BACKOFF_MAX_S, Backoff
from proto import hastream_pb2, hastream_pb2_grpc
from raftstore import errors, limits
from raftstore.errors import (
    InvalidArgument,
    LeadershipLost,
    NodeUnavailable,
    NotLeader,
    Overloaded,
    ProposalTimeout,
    RaftStoreError,
    TableNotFound,
)
from raftstore.model import LOCAL_GROUP

if TYPE_CHECKING:
    from api_clients.subscriber import Filter, Handler, Subscription

log = logging.getLogger(__name__)

DEADLINE_S_DEFAULT: Final = 30.0
# One attempt may wait for a proposal to commit (limits.PROPOSAL_TIMEOUT_S) and then some.
ATTEMPT_TIMEOUT_S_DEFAULT: Final = limits.PROPOSAL_TIMEOUT_S + 5.0
SITES_MAX: Final = 64

# Calls only a group's leader answers: the site that answers one of these for a table is
# remembered as the table's (and its group's) leader. Other calls may be served by any node.
LEADER_METHODS: Final = frozenset(
    {
        "Publish",
        "Subscribe",
        "CommitOffset",
        "HaStreamTable",
        "DropStreamTable",
        "RemoveTopicOffset",
    }
)

# Transport failures after which another site may answer.
_RETRYABLE_CODES: Final = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
)

CHANNEL_OPTIONS: Final[tuple[tuple[str, int], ...]] = (
    ("grpc.max_send_message_length", limits.GRPC_MESSAGE_BYTES_MAX),
    ("grpc.max_receive_message_length", limits.GRPC_MESSAGE_BYTES_MAX),
    # gRPC's own reconnect backoff grows to 120 s by default; a node that comes back after a
    # restart must be reachable again within our retry budget.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Keepalive: a frozen (SIGSTOPped) or silently gone leader sends nothing, and an idle
    # subscription stream would wait on it forever. A ping every 10 s that is not answered
    # within 5 s ends the connection, so the stream fails UNAVAILABLE and the subscriber
    # moves to the new leader. The nodes permit it (keepalive_time 10 s, min ping interval
    # 2 s, no ping strikes); pings are sent even when no data flows on the stream.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # Recent gRPC cores time a ping's answer out by this one (default 60 s), not by the
    # keepalive timeout above: without it a frozen leader is noticed only after 70 s.
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
)


def parse_site(text: str) -> str:
    """`host:port` or `host:port:alias` -> `host:port` (the alias is only a label)."""
    parts = text.strip().split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1].isdigit():
        raise InvalidArgument("site", f"{text!r} is not host:port or host:port:alias")
    port = int(parts[1])
    if not 0 < port < 65536:
        raise InvalidArgument("site", f"{text!r} has port {port} outside 1..65535")
    return f"{parts[0]}:{port}"


def _outcome_unknown(error: RaftStoreError) -> bool:
    """Whether the failed attempt may have been applied anyway."""
    if isinstance(error, ProposalTimeout | LeadershipLost):
        return True
    return isinstance(error, NodeUnavailable) and "DEADLINE_EXCEEDED" in error.reason


def rebuild_error(rpc_error: grpc.RpcError, site: str) -> RaftStoreError | None:
    """The typed error the server raised, or NodeUnavailable for a transport failure after
    which another site may answer; None for any other gRPC failure (a bug or a refusal that
    the caller should see as it is)."""
    call: Any = rpc_error  # Raised RpcErrors are also grpc.Call objects.
    metadata = call.trailing_metadata() if hasattr(call, "trailing_metadata") else None
    typed = errors.from_wire(
        {key: value for key, value in metadata or () if isinstance(value, str)}
    )
    if typed is not None:
        return typed
    code = call.code() if hasattr(call, "code") else None
    if code is not None and code in _RETRYABLE_CODES:
        details = call.details() if hasattr(call, "details") else ""
        return NodeUnavailable(f"{site}: {code.name}: {details}")
    return None


class Session:
    """A connection to the cluster through any of `sites` (`host:port[:alias]` strings).

    `timeout_s` bounds one attempt; `deadline_s` bounds a whole call with its retries.
    `userid`/`password` are accepted for DolphinDB compatibility; the cluster has no
    authentication yet, so they are not sent (and the password is not kept).
    """

    def __init__(
        self,
        sites: Sequence[str],
        *,
        userid: str | None = None,
        password: str | None = None,
        timeout_s: float = ATTEMPT_TIMEOUT_S_DEFAULT,
        deadline_s: float = DEADLINE_S_DEFAULT,
        backoff_initial_s: float = BACKOFF_INITIAL_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        channel_options: Iterable[tuple[str, Any]] = (),
    ) -> None:
        del password  # Never kept: see the class docstring.
        parsed = list(dict.fromkeys(parse_site(site) for site in sites))
        if not parsed:
            raise InvalidArgument("sites", "at least one site is needed")
        if len(parsed) > SITES_MAX:
            raise InvalidArgument("sites", f"{len(parsed)} sites > {SITES_MAX}")
        if timeout_s <= 0 or deadline_s <= 0:
            raise InvalidArgument("timeout_s/deadline_s", "must be > 0")
        self.userid = userid
        self._timeout_s = timeout_s
        self._deadline_s = deadline_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._channel_options = (*CHANNEL_OPTIONS, *channel_options)
        self._lock = threading.Lock()
        self._sites: list[str] = parsed
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, hastream_pb2_grpc.StreamTableStub] = {}
        self._table_leaders: dict[str, str] = {}
        self._group_leaders: dict[int, str] = {}
        self._table_groups: dict[str, int] = {}
        self._preferred: str = parsed[0]
        self._subscriptions: dict[str, Subscription] = {}
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Stops this session's subscriptions (committing their offsets), then closes every
        channel. Idempotent."""
        with self._lock:
            subscriptions = list(self._subscriptions.values())
        for subscription in subscriptions:
            subscription.stop()
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
            self._channels.clear()
            self._stubs.clear()
        for channel in channels:
            channel.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def sites(self) -> list[str]:
        """The known sites (`host:port`), including leaders learned from redirects."""
        with self._lock:
            return list(self._sites)

    @property
    def deadline_s(self) -> float:
        return self._deadline_s

    def new_backoff(
        self, deadline_s: float | None = None, *, sleep: Callable[[float], object] | None = None
    ) -> Backoff:
        """A retry budget with this session's backoff settings."""
        deadline = self._deadline_s if deadline_s is None else deadline_s
        if sleep is None:
            return Backoff(self._backoff_initial_s, self._backoff_max_s, deadline)
        return Backoff(self._backoff_initial_s, self._backoff_max_s, deadline, sleep=sleep)

    # -- routing ---------------------------------------------------------------------

    def route(self, *, table: str | None = None, group: int | None = None) -> str:
        """The site to try first: the remembered leader of the table or its group, else the
        site that answered last."""
        with self._lock:
            if table is not None:
                if table in self._table_leaders:
                    return self._table_leaders[table]
                group = self._table_groups.get(table, group)
            if group is not None and group in self._group_leaders:
                return self._group_leaders[group]
            return self._preferred

    def next_site(self, site: str) -> str:
        """The site after `site` in the list, wrapping around."""
        with self._lock:
            if site not in self._sites:
                return self._sites[0]
            return self._sites[(self._sites.index(site) + 1) % len(self._sites)]

    def _next_site_except(self, site: str, skip: set[str]) -> str:
        """The first site after `site` (wrapping around) that is not in `skip`."""
        candidate = site
        for _ in range(len(self.sites) + 1):
            candidate = self.next_site(candidate)
            if candidate not in skip:
                return candidate
        return self.next_site(site)

    def redirect_target(self, error: RaftStoreError, site: str) -> str | None:
        """For a NotLeader that names another node: that node's `host:port`, added to the
        site list if new. None when there is no usable hint."""
        if not isinstance(error, NotLeader) or error.leader is None:
            return None
        target = self.learn_site(error.leader)
        if target == site:
            return None  # The node names itself while it is not (yet) leader: an election.
        return target

    def learn_site(self, address: str) -> str | None:
        """Adds `host:port[:alias]` to the site list if new; returns it as `host:port`, or
        None if it is malformed (a hint is only a hint)."""
        try:
            site = parse_site(address)
        except InvalidArgument:
            log.warning("ignoring malformed node address address=%r", address)
            return None
        with self._lock:
            if site not in self._sites and len(self._sites) < SITES_MAX:
                log.info("learned site site=%s", site)
                self._sites.append(site)
        return site

    def remember_leader(self, site: str, *, table: str | None, group: int | None) -> None:
        with self._lock:
            self._preferred = site
            if table is not None:
                self._table_leaders[table] = site
                group = self._table_groups.get(table, group)
            if group is not None and group != LOCAL_GROUP:
                self._group_leaders[group] = site

    def _remember_alive(self, site: str) -> None:
        with self._lock:
            self._preferred = site

    def remember_table_group(self, table: str, group: int) -> None:
        with self._lock:
            self._table_groups[table] = group

    def forget_leader(self, site: str, *, table: str | None, group: int | None) -> None:
        """Stop routing the table (and its group) to `site`, after it failed or refused."""
        with self._lock:
            if table is not None:
                if self._table_leaders.get(table) == site:
                    del self._table_leaders[table]
                group = self._table_groups.get(table, group)
            if group is not None and self._group_leaders.get(group) == site:
                del self._group_leaders[group]

    def stub(self, site: str) -> hastream_pb2_grpc.StreamTableStub:
        """The cached stub of `site`; its channel is created on first use."""
        with self._lock:
            if self._closed:
                raise RuntimeError("session is closed")
            stub = self._stubs.get(site)
            if stub is None:
                channel = grpc.insecure_channel(site, options=self._channel_options)
                stub = hastream_pb2_grpc.StreamTableStub(channel)
                self._channels[site] = channel
                self._stubs[site] = stub
            return stub

    # -- calls -----------------------------------------------------------------------

    def call(
        self,
        method_name: str,
        request: Any,
        *,
        table: str | None = None,
        group: int | None = None,
        site: str | None = None,
        deadline_s: float | None = None,
        gone_after_unknown_ok: bool = False,
    ) -> Any:
        """Sends `request` to the unary RPC `method_name`, following the leader of `table`
        (or of raft `group`); with `site`, only that site is tried. The same request object
        is resent on every retry (so a publish keeps its idempotency token).

        Raises the server's typed error at once unless it is retryable; when the deadline
        passes, raises the last error seen (NodeUnavailable for transport failures). Other
        gRPC failures are raised as the original grpc.RpcError.

        TableNotFound is only believed once every known site said so: a follower that has
        not applied the table's creation yet answers it (for any call, even Publish) before
        it looks at leadership, so the call goes on to each site not asked yet, at once.
        With `gone_after_unknown_ok` (a drop), a TableNotFound that follows an attempt whose
        outcome is unknown (a timeout, a lost leadership) means that attempt did it: None is
        returned.
        """
        backoff = self.new_backoff(deadline_s)
        target = parse_site(site) if site is not None else self.route(table=table, group=group)
        redirected = False
        # A leader hint that could not be reached in this call (e.g. a container host name
        # that does not resolve here) is not followed again: the call goes on with the site
        # after the one that redirected to it, so every listed site still gets its turn.
        hint_origin: str | None = None
        unreachable_hints: set[str] = set()
        not_found: set[str] = set()  # Sites that answered TableNotFound to this call.
        outcome_unknown = False  # An attempt failed after the request may have been applied.
        while True:  # Bounded: every retry path takes a wait from `backoff` or a new site.
            timeout_s = min(self._timeout_s, backoff.remaining_s())
            try:
                response = getattr(self.stub(target), method_name)(request, timeout=timeout_s)
            except grpc.RpcError as rpc_error:
                error = rebuild_error(rpc_error, target)
                if error is None:
                    raise
                if isinstance(error, TableNotFound) and gone_after_unknown_ok and outcome_unknown:
                    return None
                if isinstance(error, TableNotFound) and table is not None and site is None:
                    not_found.add(target)
                    untried = [known for known in self.sites if known not in not_found]
                    if untried and backoff.remaining_s() > 0:
                        log.debug("table not found site=%s, asking site=%s", target, untried[0])
                        self.forget_leader(target, table=table, group=group)
                        target = untried[0]
                        continue
                if not error.retryable:
                    raise error from None
                log.debug("call failed method=%s site=%s error=%s", method_name, target, error)
                outcome_unknown |= _outcome_unknown(error)
                resume_after: str | None = None
                if hint_origin is not None and isinstance(error, NodeUnavailable):
                    unreachable_hints.add(target)  # `target` was a hint and is unreachable
                    resume_after = hint_origin
                hint_origin = None
                hint = self.redirect_target(error, target) if site is None else None
                if hint in unreachable_hints:
                    hint = None
                self.forget_leader(target, table=table, group=group)
                if hint is not None and not redirected and backoff.remaining_s() > 0:
                    redirected = True  # The first redirect goes at once; later ones back off.
                    hint_origin, target = target, hint
                    continue
                if not backoff.wait():
                    raise error from None
                if resume_after is not None:
                    target = self._next_site_except(resume_after, unreachable_hints)
                    continue
                next_target = self._after_failure(target, error, hint=hint, pinned=site is not None)
                if next_target == hint:
                    hint_origin = target
                target = next_target
            else:
                if method_name in LEADER_METHODS:
                    self.remember_leader(target, table=table, group=group)
                else:
                    self._remember_alive(target)
                return response

    def _after_failure(
        self, site: str, error: RaftStoreError, *, hint: str | None, pinned: bool
    ) -> str:
        if pinned or isinstance(error, Overloaded):
            return site  # The leader is busy, not gone: another site would only redirect.
        return hint if hint is not None else self.next_site(site)

    def open_stream(
        self, site: str, method_name: str, request: Any, *, timeout_s: float | None = None
    ) -> Any:
        """Starts a server-streaming RPC on `site`, with no deadline unless `timeout_s` (a
        subscription is long-lived). The returned object iterates the responses and can be
        `cancel()`led."""
        return getattr(self.stub(site), method_name)(request, timeout=timeout_s)

    # -- admin calls (DolphinDB names) -----------------------------------------------

    def haStreamTable(
        self,
        raftGroup: int,
        schema: pa.Schema,
        tableName: str,
        cacheLimit: int,
        keyColumn: str | None = None,
        retentionMinutes: int = admin.RETENTION_MINUTES_DEFAULT,
    ) -> admin.TableInfo:
        """Creates an HA stream table on every replica of Raft group `raftGroup` (>= 2)."""
        if raftGroup < 2:
            raise InvalidArgument("raftGroup", f"HA tables need a raft group >= 2, got {raftGroup}")
        request = admin.create_table_request(
            raft_group=raftGroup,
            schema=schema,
            table=tableName,
            cache_limit=cacheLimit,
            key_column=keyColumn,
            retention_minutes=retentionMinutes,
        )
        self.remember_table_group(tableName, raftGroup)
        return self._table_info(self.call("HaStreamTable", request, group=raftGroup))

    def createStreamTable(
        self,
        schema: pa.Schema,
        tableName: str,
        cacheLimit: int,
        keyColumn: str | None = None,
        retentionMinutes: int = admin.RETENTION_MINUTES_DEFAULT,
    ) -> admin.TableInfo:
        """Creates a non-HA stream table on the node this session is connected to (the first
        site, or the one that answered last); later calls for it go to that node."""
        request = admin.create_table_request(
            raft_group=LOCAL_GROUP,
            schema=schema,
            table=tableName,
            cache_limit=cacheLimit,
            key_column=keyColumn,
            retention_minutes=retentionMinutes,
        )
        site = self.route()
        response = self.call("HaStreamTable", request, site=site)
        self.remember_leader(site, table=tableName, group=None)
        return self._table_info(response)

    def dropStreamTable(self, tableName: str, force: bool = False) -> None:
        """Drops the table and its files on all replicas; refused (TableSubscribed) while
        it has subscribers unless `force`."""
        request = hastream_pb2.DropTableRequest(table=tableName, force=force)
        self.call("DropStreamTable", request, table=tableName, gone_after_unknown_ok=True)
        with self._lock:
            self._table_leaders.pop(tableName, None)
            self._table_groups.pop(tableName, None)

    def getTableInfo(self, tableName: str) -> admin.TableInfo:
        """The table as the cluster describes it (any node answers; see `call` for a
        follower that does not know the table yet)."""
        request = hastream_pb2.TableRequest(table=tableName)
        return self._table_info(self.call("GetTableInfo", request, table=tableName))

    def _table_info(self, message: hastream_pb2.TableInfo) -> admin.TableInfo:
        info = admin.table_info_from_proto(message)
        self.remember_table_group(info.table, info.raft_group)
        return info

    def getStreamingLeader(self, groupId: int) -> str:
        """The leader of Raft group `groupId` as `host:port:alias`, "" while unknown."""
        response = self.call("GetStreamingLeader", hastream_pb2.GroupRequest(raft_group=groupId))
        if response.leader:
            learned = self.learn_site(response.leader)
            if learned is not None:
                with self._lock:
                    self._group_leaders[groupId] = learned
        return str(response.leader)

    def getStreamingRaftGroups(self) -> list[dict[str, Any]]:
        """One dict per group: `id`, `sites`, `leader` (None while unknown), `tables`."""
        return admin.raft_groups_from_proto(
            self.call("GetStreamingRaftGroups", hastream_pb2.Empty())
        )

    def getStreamingStat(self) -> dict[str, Any]:
        return admin.json_document(self.call("GetStreamingStat", hastream_pb2.Empty()))

    def getTopicProcessedOffset(self, topic: str) -> int:
        """The persisted last processed offset of `topic` (`table/actionName`). Raises
        TopicNotFound if none was persisted."""
        request = hastream_pb2.TopicRequest(topic=topic)
        response = self.call("GetTopicProcessedOffset", request, table=admin.topic_table(topic))
        return int(response.offset)

    def removeTopicOffset(self, topic: str) -> None:
        request = hastream_pb2.TopicRequest(topic=topic)
        self.call("RemoveTopicOffset", request, table=admin.topic_table(topic))

    def getNodeStatus(self, site: str | None = None) -> dict[str, Any]:
        """The status document of one node: `site` (`host:port[:alias]`), or any site."""
        return admin.json_document(self.call("GetNodeStatus", hastream_pb2.Empty(), site=site))

    def read(
        self,
        tableName: str,
        offsetFrom: int,
        offsetTo: int = -1,
        *,
        deadline_s: float | None = None,
    ) -> pa.Table:
        """The rows `[offsetFrom, offsetTo)` of a table as one pyarrow Table (`offsetTo=-1`:
        up to the end). Complete or raising; see `api_clients.reader.read_range`."""
        from api_clients.reader import read_range  # Import cycle: it types Session.

        return read_range(self, tableName, offsetFrom, offsetTo, deadline_s=deadline_s)

    # -- subscriptions ---------------------------------------------------------------

    def subscribe(
        self,
        tableName: str,
        handler: Handler,
        offset: int = -1,
        actionName: str = "default",
        batchSize: int = 0,
        throttle: float = 1.0,
        filter: Filter | None = None,  # DolphinDB's parameter name, shadowing the builtin.
        reconnect: bool = True,
        persistOffset: bool = True,
        msgAsTable: bool = True,
    ) -> Subscription:
        """Starts a background subscription to topic `tableName/actionName`; see
        `api_clients.subscriber.Subscription` for the delivery contract."""
        from api_clients.subscriber import Subscription  # Import cycle: it types Session.

        topic = f"{tableName}/{actionName}"
        subscription = Subscription(
            self,
            tableName,
            handler,
            offset=offset,
            action_name=actionName,
            batch_size=batchSize,
            throttle_s=throttle,
            filter=filter,
            reconnect=reconnect,
            persist_offset=persistOffset,
            msg_as_table=msgAsTable,
            on_exit=self._subscription_ended,
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("session is closed")
            if topic in self._subscriptions:
                raise InvalidArgument("actionName", f"topic {topic!r} is already subscribed")
            self._subscriptions[topic] = subscription
        subscription.start()
        return subscription

    def unsubscribe(self, tableName: str, actionName: str = "default") -> None:
        """Stops the subscription to `tableName/actionName` (committing its offset)."""
        topic = f"{tableName}/{actionName}"
        with self._lock:
            subscription = self._subscriptions.get(topic)
        if subscription is None:
            raise InvalidArgument("topic", f"{topic!r} is not subscribed in this session")
        subscription.stop()
        self._subscription_ended(subscription)

    def _subscription_ended(self, subscription: Subscription) -> None:
        with self._lock:
            if self._subscriptions.get(subscription.topic) is subscription:
                del self._subscriptions[subscription.topic]

    def __repr__(self) -> str:
        return f"Session(sites={json.dumps(self.sites)})"


def connect(
    host: str,
    port: int,
    userid: str | None = None,
    password: str | None = None,
    highAvailabilitySites: Sequence[str] | None = None,
    *,
    timeout_s: float = ATTEMPT_TIMEOUT_S_DEFAULT,
    deadline_s: float = DEADLINE_S_DEFAULT,
) -> Session:
    """DolphinDB's `connect`: a session on `host:port`, failing over to
    `highAvailabilitySites` (`host:port[:alias]` strings). Connects lazily: no network
    call happens until the first request."""
    sites = [f"{host}:{port}", *(highAvailabilitySites or ())]
    return Session(
        sites, userid=userid, password=password, timeout_s=timeout_s, deadline_s=deadline_s
    )
