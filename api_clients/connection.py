"""An HA session over a list of sites: leader following, bounded retries, admin calls.

`Session.call` sends one unary request and follows the cluster: a NotLeader answer that
names the leader sends it there; a NotLeader without a leader (an election is running), an
unreachable node, or any other retryable error sends it to the next site after a capped,
jittered backoff. Everything is bounded by a deadline (default 30 s, longer than an election).
The leader that answered for a table or group is remembered, so later calls go straight there.
Where each retry goes is decided by `call_policy.decide` (pure); `call` only performs it.
Failures arrive typed from `transport` (the gRPC boundary). An idempotent call whose attempt
goes unanswered past `hedge_delay_s` asks the other sites who leads, and once they agree on
another leader it is ended and resent there (`call_policy.hedge`; the session's
`hedge.AttemptMonitor` closes the silent site's channel): a leader cut off by the network
or frozen is left about as fast as a killed one.

Threads: a Session is shared by publishers and subscribers on any number of threads. The
site list, channels and leader memory are guarded by one lock that is never held across
a network call. gRPC channels are thread-safe.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import grpc
import pyarrow as pa
from grpc_health.v1 import health_pb2, health_pb2_grpc

from api_clients import admin, times, transport
from api_clients.call_policy import (
    Action,
    AttemptState,
    Decision,
    decide_after,
    hedgeable,
    leader_named,
)
from api_clients.dials import Dial, Dials
from api_clients.hedge import HEDGE_DELAY_S_DEFAULT, AttemptMonitor, LeaderWatch
from api_clients.login import Login, TokenInterceptor
from api_clients.publish_port import PortRefused, PublishPorts, client_context
from api_clients.reader import read_range
from api_clients.retry import BACKOFF_INITIAL_S, BACKOFF_MAX_S, Backoff
from api_clients.subscriber import Subscription, subscription_filter, subscription_handler
from api_clients.types import Filter, OffsetForTime, TableInfo
from hastream import wire
from hastream.errors import InvalidArgument, RaftStoreError
from hastream.model import LOCAL_GROUP, topic_name
from hastream.tls import ClientTls
from proto import hastream_pb2, hastream_pb2_grpc

log = logging.getLogger(__name__)

DEADLINE_S_DEFAULT: Final = 30.0
# One attempt may wait for a proposal to commit (wire.PROPOSAL_TIMEOUT_S) and then some.
ATTEMPT_TIMEOUT_S_DEFAULT: Final = wire.PROPOSAL_TIMEOUT_S + 5.0
# How long a session waits to hear whether a site serves a publish port (its node status).
PORT_ASK_S: Final = 2.0
SITES_MAX: Final = 64
HEALTH_TIMEOUT_S: Final = 5.0
# A retry is not started with less of the call's deadline left than this: no node answers
# that fast on a loaded machine, and its timeout would replace the last error seen (a
# typed one, say NodeUnavailable) with an "outcome unknown" of its own.
ATTEMPT_S_MIN: Final = 0.02

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
        "TransferLeadership",
    }
)

CHANNEL_OPTIONS: Final[tuple[tuple[str, int], ...]] = (
    ("grpc.max_send_message_length", wire.GRPC_MESSAGE_BYTES_MAX),
    ("grpc.max_receive_message_length", wire.GRPC_MESSAGE_BYTES_MAX),
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
    # A session's channels keep their connections to themselves. gRPC otherwise shares one
    # subchannel (connection and reconnect state) among all channels of a process with the
    # same target and options, so a new session inherits an older one's state. A channel
    # made before a node was killed was seen failing to connect to it once restarted, for
    # seconds, while a new session's own channel connected at once (docs/client.md).
    ("grpc.use_local_subchannel_pool", 1),
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


class Session:
    """A connection to the cluster through any of `sites` (`host:port[:alias]` strings).

    `timeout_s` bounds one attempt; `deadline_s` bounds a whole call with its retries.
    `hedge_delay_s`: how long an attempt of an idempotent call (or a publish stream, or a
    subscription that hears nothing) waits before the other sites are asked who leads, to
    leave a silent leader once they agree on another (None: never; see `call_policy`).
    Keep it below the cluster's election timeout: the followers name the new leader only
    after an election anyway, and asking earlier costs a few cheap calls.
    `userid`/`password`: log in (api_clients/login.py): the first call, or `login()`, gets
    a token that every later call carries; a cluster with `authentication=off` accepts any.
    `tls`: connect over TLS (the nodes' `tlsCertFile`...; see hastream.tls.ClientTls); the
    files are read here, so a wrong path fails now, naming the option.
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
        hedge_delay_s: float | None = HEDGE_DELAY_S_DEFAULT,
        tls: ClientTls | None = None,
    ) -> None:
        if (userid is None) != (password is None):
            raise InvalidArgument("userid/password", "give both or neither")
        self._login = None if userid is None or password is None else Login(userid, password)
        parsed = list(dict.fromkeys(parse_site(site) for site in sites))
        if not parsed:
            raise InvalidArgument("sites", "at least one site is needed")
        if len(parsed) > SITES_MAX:
            raise InvalidArgument("sites", f"{len(parsed)} sites > {SITES_MAX}")
        if timeout_s <= 0 or deadline_s <= 0:
            raise InvalidArgument("timeout_s/deadline_s", "must be > 0")
        if hedge_delay_s is not None and hedge_delay_s <= 0:
            raise InvalidArgument("hedge_delay_s", f"must be > 0 or None, got {hedge_delay_s}")
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise InvalidArgument(
                "backoff_initial_s/backoff_max_s",
                f"need 0 < initial <= max, got {backoff_initial_s} and {backoff_max_s}",
            )
        self.userid = userid
        self._timeout_s = timeout_s
        self._deadline_s = deadline_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._hedge_delay_s = hedge_delay_s
        self._channel_options: tuple[tuple[str, Any], ...] = (*CHANNEL_OPTIONS, *channel_options)
        self._credentials = None if tls is None else _channel_credentials(tls)
        if tls is not None and tls.server_name is not None:
            self._channel_options += (("grpc.ssl_target_name_override", tls.server_name),)
        self._lock = threading.Lock()
        self._sites: list[str] = parsed
        self._dials = Dials(self._new_dial)
        self._table_leaders: dict[str, str] = {}
        self._group_leaders: dict[int, str] = {}
        self._table_groups: dict[str, int] = {}
        self._preferred: str = parsed[0]
        self._subscriptions: dict[str, Subscription] = {}
        self._closed = False
        self._monitor: AttemptMonitor | None = None
        # Publishes over the nodes' publish ports (TLS as on the client port).
        self._ports = (
            PublishPorts()
            if tls is None
            else PublishPorts(tls=client_context(tls), server_name=tls.server_name)
        )
        if hedge_delay_s is not None:
            self._monitor = AttemptMonitor(self, hedge_delay_s, self._drop_channel)

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Stops this session's subscriptions (committing their offsets), then closes every
        channel. Idempotent."""
        with self._lock:
            subscriptions = list(self._subscriptions.values())
        for subscription in subscriptions:
            subscription.stop()
        if self._monitor is not None:
            self._monitor.close()
        self._ports.close()
        with self._lock:
            self._closed = True
        self._dials.close()

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

    def group_leader(self, group: int) -> str | None:
        """The leader this session remembers for Raft group `group` (`host:port`), if any."""
        with self._lock:
            return self._group_leaders.get(group)

    def next_site(self, site: str) -> str:
        """The site after `site` in the list, wrapping around."""
        with self._lock:
            if site not in self._sites:
                return self._sites[0]
            return self._sites[(self._sites.index(site) + 1) % len(self._sites)]

    def redirect_target(self, error: RaftStoreError, site: str) -> str | None:
        """For a NotLeader that names another node (or an `Unresponsive` attempt, with the
        leader the other sites agreed on): that node's `host:port`, added to the site list
        if new. None when there is no usable hint."""
        leader = leader_named(error)  # NotLeader's, or the leader a silent site was left for
        if leader is None:
            return None
        target = self.learn_site(leader)
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

    def table_group(self, table: str) -> int | None:
        """The raft group of `table`, if this session has learned it."""
        with self._lock:
            return self._table_groups.get(table)

    def leader_watch(
        self,
        site: str,
        *,
        table: str | None = None,
        group: int | None = None,
        delay_s: float | None = None,
    ) -> LeaderWatch | None:
        """A watch over one attempt on `site` that tells when to leave it for the leader the
        other sites agree on (see `hedge.LeaderWatch`), asking after `hedge_delay_s` (or
        `delay_s` if longer). None when this session does not hedge."""
        if self._hedge_delay_s is None or (table is None and group is None):
            return None
        delay = self._hedge_delay_s if delay_s is None else max(delay_s, self._hedge_delay_s)
        return LeaderWatch(self, site, table=table, group=group, delay_s=delay)

    def forget_leader(self, site: str, *, table: str | None, group: int | None) -> None:
        """Stop routing the table (and its group) to `site`, after it failed or refused."""
        with self._lock:
            if table is not None:
                if self._table_leaders.get(table) == site:
                    del self._table_leaders[table]
                group = self._table_groups.get(table, group)
            if group is not None and self._group_leaders.get(group) == site:
                del self._group_leaders[group]

    def hold_stub(self, site: str) -> tuple[hastream_pb2_grpc.StreamTableStub, Callable[[], None]]:
        """The stub of `site`'s current channel (api_clients/dials.py), dialled on first
        use, and the release of the one call it counts on that channel: a channel retired
        meanwhile stays open until it is called (the hedge's probes, which are futures).
        Raises SessionClosed (a RuntimeError) after `close()`."""
        dial, release = self._dials.hold(site)
        return dial.stub, release

    def _new_dial(self, site: str) -> Dial:
        channel = (
            grpc.insecure_channel(site, options=self._channel_options)
            if self._credentials is None
            else grpc.secure_channel(site, self._credentials, self._channel_options)
        )
        calls = channel
        if self._login is not None:
            calls = grpc.intercept_channel(channel, TokenInterceptor(self._login, channel))
        return Dial(site, channel, hastream_pb2_grpc.StreamTableStub(calls))

    # -- calls -----------------------------------------------------------------------

    def login(self) -> None:
        """Log in now (connect() does, so a wrong password fails there, not at the first
        call): raises Unauthenticated. A session without a userid does nothing."""
        if self._login is not None:
            self._login.accept(self.call("Login", self._login.request()))

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
        passes, raises the last error seen. Failures without a typed error from the node are
        raised as the client's transport errors (`api_clients.transport`: SiteUnavailable,
        DeadlineExceeded, RpcFailed). Where each retry goes: `api_clients.call_policy`.

        TableNotFound is only believed once every known site said so: a follower that has
        not applied the table's creation yet answers it (for any call, even Publish) before
        it looks at leadership, so the call goes on to each site not asked yet, at once.
        With `gone_after_unknown_ok` (a drop), a TableNotFound that follows an attempt whose
        outcome is unknown (a timeout, a lost leadership) means that attempt did it: None is
        returned.
        """
        backoff = self.new_backoff(deadline_s)
        pinned = site is not None
        target = parse_site(site) if site is not None else self.route(table=table, group=group)
        memory = AttemptState(
            target=target,
            sites=(),
            time_left=True,
            pinned=pinned,
            table_lookup=table is not None and not pinned,
            gone_ok=gone_after_unknown_ok,
        )
        hedged = hedgeable(
            method_name,
            pinned=pinned,
            routed=table is not None or group is not None,
            with_producer=bool(getattr(request, "producer_id", b"")),
        )
        # The first unreachable-site error that told why (a TLS mismatch): the last attempt's
        # own may only say that its connect ran out of time.
        telling: transport.SiteUnavailable | None = None
        while True:  # Bounded: see call_policy (every retry waits, or moves on, at most once).
            timeout_s = min(self._timeout_s, backoff.remaining_s())
            try:
                response = self._attempt(
                    method_name, request, target, timeout_s, hedged, table=table, group=group
                )
            except RaftStoreError as error:
                raised: RaftStoreError = error
                if isinstance(error, transport.SiteUnavailable):
                    hinted = transport.with_tls_hint(error, self._credentials is not None)
                    telling = telling or (hinted if hinted is not error else None)
                    raised = telling or error
                decision = self.after_failure(
                    memory, target, error, backoff, table=table, group=group, pinned=pinned
                )
                if decision.action is Action.DONE:
                    return None
                if decision.target is None or (decision.backoff and not backoff.wait()):
                    raise raised from None
                if backoff.remaining_s() < ATTEMPT_S_MIN:
                    raise raised from None
                memory, target = decision.state, decision.target
            else:
                if method_name in LEADER_METHODS:
                    self.remember_leader(target, table=table, group=group)
                else:
                    self._remember_alive(target)
                return response

    def after_failure(
        self,
        memory: AttemptState,
        target: str,
        error: RaftStoreError,
        backoff: Backoff,
        *,
        table: str | None,
        group: int | None,
        pinned: bool = False,
    ) -> Decision:
        """Where the attempt after `error` on `target` goes (`call_policy.decide`, with the
        hint the error gives unless the call is `pinned` to one site); forgets `target` as
        the leader when the policy says so. The one retry step of `call` and of the
        streaming calls that retry by the same rules (`reader.read_range`); the caller
        raises when `decision.target` is None or its backoff runs out."""
        decision = decide_after(
            memory,
            error,
            target=target,
            sites=tuple(self.sites),
            time_left=backoff.remaining_s() > 0,
            hint=None if pinned else self.redirect_target(error, target),
        )
        log.debug(
            "attempt failed site=%s table=%s error=%s next=%s",
            target,
            table,
            error,
            decision.action.value,
        )
        if decision.forget_leader:
            self.forget_leader(target, table=table, group=group)
        return decision

    def _attempt(
        self,
        method_name: str,
        request: Any,
        target: str,
        timeout_s: float,
        hedged: bool,
        *,
        table: str | None = None,
        group: int | None = None,
    ) -> Any:
        """One attempt of a unary call on `target`. A hedged one is watched by the session's
        monitor: once the other sites agree that another node leads, the silent site's
        channel is closed and the attempt raises `Unresponsive`."""
        if not hedged or self._monitor is None:
            return self._unary(method_name, request, target, timeout_s)
        ticket = self._monitor.begin(target, table=table, group=group)
        try:
            return self._unary(method_name, request, target, timeout_s)
        except RaftStoreError:
            if ticket.moved is not None:
                raise ticket.moved from None
            raise
        finally:
            self._monitor.end(ticket)

    def _unary(self, method_name: str, request: Any, target: str, timeout_s: float) -> Any:
        """One unary call on `target`: a Publish over the site's publish port when it has one
        (api_clients/publish_port.py), else, and for every other method, over gRPC."""
        if method_name == "Publish" and self._ports.usable(target, len(request.payload)):
            token = "" if self._login is None else self._login.token()
            if token is not None:  # None: a login is due, which gRPC's interceptor makes
                try:
                    return self._ports.publish(target, request, token, timeout_s)
                except PortRefused:
                    pass  # nothing was sent: gRPC it is
        with self._dials.call(target) as dial:
            try:
                response = transport.unary(dial.stub, method_name, request, target, timeout_s)
            except transport.SiteUnavailable as error:
                if transport.never_connected(error):
                    self._dials.retire(dial)
                raise
        if method_name == "Publish":
            self._ports.learn(target, response.publish_port)
        return response

    def _drop_channel(self, site: str) -> None:
        """Closes `site`'s channel (every call in flight on it fails CANCELLED) and forgets
        it: the next use opens a fresh one. The monitor's thread, leaving a silent site."""
        self._ports.drop(site)
        if self._dials.drop(site):
            log.info("closing the channel of a silent site site=%s", site)

    def open_stream(
        self, site: str, method_name: str, request: Any, *, timeout_s: float | None = None
    ) -> transport.Stream:
        """Starts a streaming RPC on `site`, with no deadline unless `timeout_s` (a
        subscription is long-lived); `request` is a message, or an iterator of messages for
        a bidirectional call. Iterating the stream yields the responses and raises a failure
        typed (see `api_clients.transport`); `cancel()` ends it. A PublishStream goes over
        the site's publish port when it has one (api_clients/publish_port.py)."""
        if method_name == "PublishStream" and timeout_s is None:
            stream = self._port_stream(site, request)
            if stream is not None:
                return stream
        dial, release = self._dials.hold(site)
        try:
            stream = transport.open_stream(dial.stub, method_name, request, site, timeout_s)
        except BaseException:
            release()
            raise
        stream.when_ended(release)
        return stream

    def _port_stream(self, site: str, requests: Any) -> transport.Stream | None:
        """A PublishStream over `site`'s publish port; None when it has none (or it cannot
        be used now): nothing was sent. Whether the site has one is asked once (its node
        status), as a pipeline, unlike waited publishes, sees no Publish answer first."""
        if not self._ports.streams:
            return None
        if not self._ports.known(site):
            try:
                with self._dials.call(site) as dial:
                    answer = transport.unary(
                        dial.stub, "GetNodeStatus", hastream_pb2.Empty(), site, PORT_ASK_S
                    )
                status = json.loads(answer.json)
            except (RaftStoreError, ValueError):
                return None  # asked again at the next stream
            self._ports.learn(site, int((status.get("publish_port") or {}).get("port", 0)))
        if not self._ports.usable(site, 0):
            return None
        token = "" if self._login is None else self._login.token()
        if token is None:
            return None  # a login is due, which gRPC's interceptor makes
        try:
            return self._ports.open_stream(site, requests, token)
        except PortRefused:
            return None

    # -- admin calls (DolphinDB names) -----------------------------------------------

    def haStreamTable(
        self,
        raftGroup: int,
        schema: pa.Schema | pa.Table | Any,
        tableName: str,
        cacheLimit: int,
        keyColumn: str | None = None,
        retentionMinutes: int = admin.RETENTION_MINUTES_DEFAULT,
    ) -> TableInfo:
        """Creates an HA stream table on every replica of Raft group `raftGroup` (>= 2).
        `schema`: a pyarrow Schema, or a template whose columns it takes (a pyarrow Table,
        a pandas DataFrame)."""
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
        schema: pa.Schema | pa.Table | Any,
        tableName: str,
        cacheLimit: int,
        keyColumn: str | None = None,
        retentionMinutes: int = admin.RETENTION_MINUTES_DEFAULT,
    ) -> TableInfo:
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

    # -- users and grants (DolphinDB's names; admins only) -----------------------------

    def createUser(self, userId: str, password: str, isAdmin: bool = False) -> None:
        """A new user (UserExists if the name is taken); the password needs 8+ characters."""
        self.call("ManageAccess", admin.create_user_request(userId, password, isAdmin))

    def deleteUser(self, userId: str) -> None:
        """Removes the user and its grants; its tokens stop working at once."""
        self.call("ManageAccess", admin.delete_user_request(userId))

    def resetPwd(self, userId: str, newPwd: str) -> None:
        """A new password; the user's sessions must log in again."""
        self.call("ManageAccess", admin.reset_password_request(userId, newPwd))

    def grant(self, userId: str, accessType: str, objs: str | Sequence[str] = "*") -> None:
        """Grant TABLE_READ or TABLE_WRITE on tables (`objs`: one name, names, or "*")."""
        for request in admin.rule_requests("grant", userId, accessType, objs):
            self.call("ManageAccess", request)

    def deny(self, userId: str, accessType: str, objs: str | Sequence[str] = "*") -> None:
        """Deny TABLE_READ or TABLE_WRITE on tables: a denial beats any grant."""
        for request in admin.rule_requests("deny", userId, accessType, objs):
            self.call("ManageAccess", request)

    def revoke(self, userId: str, accessType: str, objs: str | Sequence[str] = "*") -> None:
        """Remove the grant or denial of `accessType` on exactly these tables."""
        for request in admin.rule_requests("revoke", userId, accessType, objs):
            self.call("ManageAccess", request)

    def getUserAccess(self) -> list[dict[str, Any]]:
        """Every user with its admin flag and rules (never a password hash)."""
        return admin.users_from_access(self.call("GetAccess", hastream_pb2.Empty()))

    def getUserList(self) -> list[str]:
        return [entry["user"] for entry in self.getUserAccess()]

    def getTableInfo(self, tableName: str, *, deadline_s: float | None = None) -> TableInfo:
        """The table as the cluster describes it (any node answers; see `call` for a
        follower that does not know the table yet)."""
        request = hastream_pb2.TableRequest(table=tableName)
        response = self.call("GetTableInfo", request, table=tableName, deadline_s=deadline_s)
        return self._table_info(response)

    def _table_info(self, message: hastream_pb2.TableInfo) -> TableInfo:
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

    def transferLeadership(
        self, groupId: int, to: str | None = None, *, timeout_s: float | None = None
    ) -> str:
        """Hands Raft group `groupId`'s leadership to node `to` (an alias; None: any
        follower that holds every entry) and returns the new leader as `host:port:alias`.

        The leader stops taking writes (they are refused and retried by the clients, at the
        new leader), waits until the target holds every entry, then tells it to take over
        (Raft's TimeoutNow): the pause is a round trip and an election, not a timeout.
        `timeout_s` bounds the leader's attempt (default `wire.TRANSFER_TIMEOUT_S_DEFAULT`).
        Raises TransferFailed when the target did not take over in time (the old leader
        takes writes again), InvalidArgument for a node that is not a member."""
        timeout = wire.TRANSFER_TIMEOUT_S_DEFAULT if timeout_s is None else timeout_s
        if not 0 < timeout <= min(wire.TRANSFER_TIMEOUT_S_MAX, self._timeout_s - 1.0):
            limit = min(wire.TRANSFER_TIMEOUT_S_MAX, self._timeout_s - 1.0)
            raise InvalidArgument("timeout_s", f"must be in (0, {limit}] seconds")
        request = hastream_pb2.TransferLeadershipRequest(
            raft_group=groupId, to_node=to or "", timeout_s=timeout
        )
        response = self.call("TransferLeadership", request, group=groupId)
        learned = self.learn_site(response.leader) if response.leader else None
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

    def commit_offset(
        self, tableName: str, actionName: str, offset: int, *, deadline_s: float | None = None
    ) -> None:
        """Persists `offset`, the last processed row, as topic `tableName/actionName`'s
        processed offset (through Raft, at the table's leader). Raises the typed errors of
        `call`; `deadline_s` bounds it (default: the session's deadline)."""
        request = hastream_pb2.CommitOffsetRequest(
            table=tableName, action_name=actionName, offset=offset
        )
        self.call("CommitOffset", request, table=tableName, deadline_s=deadline_s)

    def removeTopicOffset(self, topic: str) -> None:
        request = hastream_pb2.TopicRequest(topic=topic)
        self.call("RemoveTopicOffset", request, table=admin.topic_table(topic))

    def getNodeStatus(self, site: str | None = None) -> dict[str, Any]:
        """The status document of one node: `site` (`host:port[:alias]`), or any site."""
        return admin.json_document(self.call("GetNodeStatus", hastream_pb2.Empty(), site=site))

    def checkHealth(self, site: str, service: str = "") -> str:
        """The node's answer to the standard gRPC health check (grpc.health.v1) for
        `service` ("" = the whole node): "SERVING" once it has replayed its log, is not in
        doubt and knows every group's leader; "NOT_SERVING" before; "UNREACHABLE" when it
        does not answer within HEALTH_TIMEOUT_S."""
        target = parse_site(site)
        channel = self._dials.current(target).channel  # refuses a closed session
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            timeout_s = min(self._timeout_s, HEALTH_TIMEOUT_S)
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s)
        except grpc.RpcError:
            return "UNREACHABLE"
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def read(
        self,
        tableName: str,
        offsetFrom: int,
        offsetTo: int = -1,
        *,
        includeMetadata: bool = False,
        deadline_s: float | None = None,
    ) -> pa.Table:
        """The rows `[offsetFrom, offsetTo)` of a table as one pyarrow Table (`offsetTo=-1`:
        up to the end); with `includeMetadata`, also each row's `_offset` and `_ingest_time`
        (api_clients/times.py). Complete or raising; see `api_clients.reader.read_range`."""
        return read_range(
            self,
            tableName,
            offsetFrom,
            offsetTo,
            deadline_s=deadline_s,
            include_metadata=includeMetadata,
        )

    def offsetForTime(self, tableName: str, when: object) -> OffsetForTime:
        """The first retained row stamped at or after `when` (ms since the epoch, or a
        datetime; naive is UTC), answered by the table's leader; see `OffsetForTime`."""
        request = hastream_pb2.OffsetForTimeRequest(
            table=tableName, timestamp_ms=times.epoch_ms(when, "when")
        )
        response = self.call("GetOffsetForTime", request, table=tableName)
        return OffsetForTime(
            table=response.table,
            found=response.found,
            offset=response.offset,
            timestamp_ms=response.timestamp_ms,
        )

    # -- subscriptions ---------------------------------------------------------------

    def subscribe(
        self,
        tableName: str,
        handler: Callable[..., object],
        offset: int = -1,
        actionName: str = "default",
        batchSize: int = 0,
        throttle: float = 1.0,
        # DolphinDB's parameter name, shadowing the builtin: a callable, or key values.
        filter: Filter | Iterable[Any] | None = None,
        reconnect: bool = True,
        persistOffset: bool = True,
        msgAsTable: bool = True,
        resub: bool | None = None,
        startTime: object = None,
    ) -> Subscription:
        """Starts a background subscription to topic `tableName/actionName`; see
        `api_clients.subscriber.Subscription` for the delivery contract.

        Checked before it starts (so nothing fails later in the background): the table
        exists (TableNotFound once every site says so), `handler` takes `(msg)` as in
        DolphinDB's API or `(msg, first_offset)`, and `filter` is a callable or, as in
        DolphinDB, a list of values of the table's key column to keep. `resub` is
        DolphinDB's name for `reconnect`.

        `startTime` (ms since the epoch, or a datetime; naive is UTC) starts at the first
        row stamped at or after it (`offsetForTime`), or with the next new row when every
        retained row is older; it replaces `offset`, so give one or the other."""
        if resub is not None:  # DolphinDB's name for `reconnect`
            reconnect = resub
        topic = topic_name(tableName, actionName)
        checked_handler = subscription_handler(handler)  # local checks before the network
        if startTime is not None and offset != -1:
            raise InvalidArgument("startTime", f"give offset={offset} or startTime, not both")
        if startTime is not None:
            times.epoch_ms(startTime, "startTime")  # refused before the network
        info = self.getTableInfo(tableName)
        if startTime is not None:
            offset = self.offsetForTime(tableName, startTime).offset
        subscription = Subscription(
            self,
            tableName,
            checked_handler,
            offset=offset,
            action_name=actionName,
            batch_size=batchSize,
            throttle_s=throttle,
            filter=subscription_filter(filter, info),
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

    def getSubscriptionTopics(self) -> list[str]:
        """The topics (`table/actionName`) this session subscribes to (DolphinDB's name)."""
        with self._lock:
            return sorted(self._subscriptions)

    def unsubscribe(self, tableName: str, actionName: str = "default") -> None:
        """Stops the subscription to `tableName/actionName` (committing its offset)."""
        topic = topic_name(tableName, actionName)
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
    highAvailability: bool = True,
    tls: bool = False,
    caFile: str | None = None,
    certFile: str | None = None,
    keyFile: str | None = None,
) -> Session:
    """DolphinDB's `connect`: a session on `host:port`, failing over to
    `highAvailabilitySites` (`host:port[:alias]` strings; `highAvailability=False`, as in
    DolphinDB's API, uses `host:port` alone). Connects lazily: no network call happens
    until the first request, unless `userid` is given: then it logs in now, so a wrong
    password fails here (Unauthenticated). `tls=True` (implied by any of the files):
    TLS, trusting `caFile` (default: the system's roots), presenting `certFile`/`keyFile`
    to nodes that require a client certificate."""
    sites = [f"{host}:{port}", *((highAvailabilitySites or ()) if highAvailability else ())]
    wants_tls = tls or any(path is not None for path in (caFile, certFile, keyFile))
    session = Session(
        sites,
        userid=userid,
        password=password,
        timeout_s=timeout_s,
        deadline_s=deadline_s,
        tls=ClientTls(caFile, certFile, keyFile) if wants_tls else None,
    )
    if userid is not None:
        try:
            session.login()
        except BaseException:
            session.close()
            raise
    return session


def _channel_credentials(tls: ClientTls) -> grpc.ChannelCredentials:
    pem = tls.read()
    return grpc.ssl_channel_credentials(pem.ca, pem.private_key, pem.cert_chain)
