"""Composition root: builds the groups, their replicas and the gRPC server; owns shutdown.

Each group is built in order, every part from parts already built: role signal, repairer,
applier, replica (which calls the applier), group commit, group. pysyncobj's tick thread
stops when the thread that built its SyncObj exits, so `run()` builds every replica on the
calling (main) thread and keeps that thread alive until a signal asks the node to stop.

Threads: every long-lived thread of the node (group commit, the local replica, repair jobs,
housekeeping, watch, scrub, slow consumers, the status port, hand-over) is started through
one `threads.Threads`, whose `start` each component is given, and joined by `stop()` within
`_THREADS_JOIN_S` once everything has been told to stop. pysyncobj's own threads belong to
replication.py; request-scoped threads (gRPC's pool, a stream's reader) to their request.

Ready means ready: NODE READY is printed once every group has replayed its local log and
is not in doubt (no repair running), with the gRPC server already up (peers repairing from
this node, and operators asking for status, need it before then).
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from hastream.errors import RaftStoreError, UnknownGroup
from hastream.model import LOCAL_GROUP, NodeAddress
from raftstore import allocator, checked_payload, identity, limits, node_tls, passwords, trace
from raftstore.apply import REPAIR_DIR, Applier, ApplierSettings
from raftstore.auth import Authenticator, Tokens, bootstrap_password, token_key
from raftstore.batcher import Batcher
from raftstore.cache_budget import CacheBudget
from raftstore.catalog import Catalog
from raftstore.catch_up import Repairer
from raftstore.config import ClusterConfig
from raftstore.digest import DigestChecker
from raftstore.group import Group, GroupSettings, Member
from raftstore.leadership import PreferredLeader, hand_over
from raftstore.local_replica import LOCAL_ADDRESS, LocalReplica
from raftstore.peer_auth import PeerSigner, PeerVerifier, peer_key
from raftstore.peers import PeerClient
from raftstore.publish_port import PublishPort
from raftstore.replica import RoleSignal
from raftstore.replication import HOLD_FOLLOWERS_S, RaftReplica, RaftSettings
from raftstore.retention import Retention
from raftstore.scrub import Scrubber
from raftstore.service import start_server
from raftstore.slow_consumers import SlowConsumers
from raftstore.stats import subscriber_lag
from raftstore.status_http import StatusServer
from raftstore.storage.files import REAL_FILES, ensure_dir, raise_fd_soft_limit
from raftstore.threads import Threads
from raftstore.tuning import DEFAULT as DEFAULT_TUNING
from raftstore.tuning import Tuning, yields_after_ack

log = logging.getLogger(__name__)


class DirectoryLocked(RuntimeError):
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        super().__init__(f"{directory} is in use by another node process")


READY_LINE = "NODE READY alias={alias} port={port}"
# How often the housekeeping thread reconciles the catalog of table names.
_HOUSEKEEPING_S = 5.0
# How often the watch thread updates the gRPC health status and checks preferred leaders.
_WATCH_S = 0.5
# stop() waits this long in all for the node's threads, once told to stop (they are daemons:
# one that misses it is logged, and does not hold the process).
_THREADS_JOIN_S = 10.0
# The gRPC health service names (grpc.health.v1): "" is the whole server.
HEALTH_SERVICES = ("", "hastream.v1.StreamTable")


class Node:
    def __init__(
        self,
        cluster: ClusterConfig,
        alias: str,
        *,
        rejoin: frozenset[int] = frozenset(),
        tuning: Tuning = DEFAULT_TUNING,
    ) -> None:
        """`rejoin`: groups whose lost or damaged Raft state the operator lets this node
        rebuild from its peers (identity.py). `tuning`: measurement knobs (tuning.py)."""
        self._rejoin = rejoin
        self._tuning = tuning
        self._yield_after_ack = yields_after_ack(tuning)  # read from the machine once
        self.cluster = cluster
        self.config = cluster.node(alias)
        self.alias = alias
        self._groups: dict[int, Group] = {}
        key = peer_key(cluster.raft_secret)
        self.peer_verifier = PeerVerifier(key)
        self._seal_key = checked_payload.seal_key(key)
        self.authenticator = Authenticator(
            enabled=cluster.authentication,
            tokens=Tokens(token_key(cluster.raft_secret)),
            access=lambda: self.catalog.access_control(),
            leader_access=lambda: self.catalog.leader_access_control(fresh=True),
            peers=self.peer_verifier,
        )
        # First: every part below that runs a thread is given its `start`.
        self._threads = Threads()
        # One memory bound for the row caches of every table of every group on this node.
        self._cache_budget = CacheBudget()
        self.slow_consumers = SlowConsumers(
            cluster.slow_consumer_timeout_s, spawn=self._threads.start
        )
        # The first admin's password, while the cluster may have no user (None after).
        self._admin_password = (
            bootstrap_password(cluster.admin_password_file, os.environ)
            if cluster.authentication
            else None
        )
        tls = self.config.tls
        self._tls_pem = None if tls is None else node_tls.load(tls, str(cluster.path))
        self._peers = PeerClient(
            PeerSigner(key, alias),
            None if self._tls_pem is None else node_tls.peer_credentials(self._tls_pem),
        )
        self._stopping = threading.Event()
        self._server: grpc.Server | None = None
        self._lock_fds: list[int] = []
        self.catalog: Catalog
        self._digests = DigestChecker(self._peers)
        self._next_digest_at = time.monotonic() + cluster.digest_interval_s
        self._scrubber = (
            Scrubber(self.groups, cluster.scrub_rate_mb_s) if cluster.scrub_rate_mb_s > 0 else None
        )
        self._health = health.HealthServicer()
        for service in HEALTH_SERVICES:
            self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._status_server: StatusServer | None = None
        self._publish_port: PublishPort | None = None
        self._preferred = PreferredLeader(
            alias,
            {
                group.group_id: group.preferred_leader
                for group in cluster.groups
                if group.preferred_leader is not None
            },
            self._peers.transfer_leadership,
        )

    # --- NodeView for the servicer ---

    def groups(self) -> list[Group]:
        return [self._groups[group_id] for group_id in sorted(self._groups)]

    def group(self, group_id: int) -> Group:
        group = self._groups.get(group_id)
        if group is None:
            raise UnknownGroup(group_id)
        return group

    def group_sites(self, group_id: int) -> list[str]:
        """The members' advertised addresses: these are handed to clients."""
        members = self.cluster.group(group_id).members
        return [str(self.cluster.node(alias).advertised_address) for alias in members]

    # --- lifecycle (main thread) ---

    def start(self) -> None:
        """Raises StartRefused when the node's directories do not match its identity."""
        raise_fd_soft_limit()
        self._apply_tuning()
        for directory in (self.config.persistence_dir, self.config.ha_dir):
            self._lock_directory(directory)
        identity.check_and_record(
            self.alias,
            self.config.ha_dir,
            self.config.persistence_dir,
            [group.group_id for group in self.cluster.groups_of(self.alias)],
            rejoin=self._rejoin,
            auto_rejoin=self.cluster.auto_rejoin,
        )
        self._start_local_group()
        for group_config in self.cluster.groups_of(self.alias):
            self._start_raft_group(group_config.group_id)
        self.catalog = self._build_catalog()
        self._start_server()
        self._start_publish_port()
        self._start_status_server()
        self._threads.start("housekeeping", self._housekeeping)
        self._threads.start("malloc-trim", lambda: allocator.trim_until(self._stopping))
        self._threads.start("watch", self._watch)
        self.slow_consumers.start(self._stopping)
        if self._scrubber is not None:
            scrubber = self._scrubber
            self._threads.start("scrub", lambda: scrubber.run(self._stopping))

    def _lock_directory(self, directory: Path) -> None:
        """Two processes must never write one node's files: hold an exclusive lock."""
        ensure_dir(REAL_FILES, directory, root=directory)
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryLocked(directory) from None
        self._lock_fds.append(fd)

    def _member(self, alias: str) -> Member:
        node = self.cluster.node(alias)
        return Member(address=node.address, advertised=node.advertised_address)

    def _build_applier(self, group_id: int, data_dir: Path, peers: list[NodeAddress]) -> Applier:
        repairer = Repairer(
            group_id,
            data_dir / REPAIR_DIR,
            self._peers.fetch_records,
            peers,
            spawn=self._threads.start,
        )
        settings = ApplierSettings(group_id=group_id, data_dir=data_dir, seal_key=self._seal_key)
        return Applier(settings, repairer, Retention(), cache_budget=self._cache_budget)

    def _start_local_group(self) -> None:
        settings = GroupSettings(
            group_id=LOCAL_GROUP,
            data_dir=self.config.persistence_dir / "local",
            self_address=self.config.advertised_address,
            members={LOCAL_ADDRESS: self._member(self.alias)},
        )
        role = RoleSignal()
        applier = self._build_applier(LOCAL_GROUP, settings.data_dir, [])
        replica = LocalReplica(
            self.config.ha_dir / "local",
            applier,
            role,
            self.cluster.purge_interval_s,
            spawn=self._threads.start,
        )
        batcher = Batcher(
            LOCAL_GROUP,
            replica.propose,
            spawn=self._threads.start,
            in_flight_max=self._tuning.proposals_in_flight,
        )
        self._groups[LOCAL_GROUP] = Group(settings, applier, replica, role, batcher)

    def _start_raft_group(self, group_id: int) -> None:
        aliases = self.cluster.group(group_id).members
        members = {
            self.cluster.raft_address(alias, group_id): self._member(alias) for alias in aliases
        }
        settings = GroupSettings(
            group_id=group_id,
            data_dir=self.config.persistence_dir / f"group-{group_id}",
            self_address=self.config.advertised_address,
            members=members,
        )
        peers = [self.cluster.node(alias).address for alias in aliases if alias != self.alias]
        raft = RaftSettings(
            group_id=group_id,
            self_address=self.cluster.raft_address(self.alias, group_id),
            peer_addresses=self.cluster.raft_peers(self.alias, group_id),
            directory=self.config.ha_dir / f"group-{group_id}",
            secret=self.cluster.raft_secret,
            election_timeout_s=self.cluster.election_timeout_s,
            checkpoint_interval_s=self.cluster.purge_interval_s,
            yield_after_ack=self._yield_after_ack,
            kernel_syncs=self._tuning.kernel_syncs,
            journal_segment_bytes=self._tuning.journal_segment_bytes,
            journal_resident_bytes=self._tuning.journal_resident_bytes,
            hold_followers_s=self._hold_followers_s(),
        )
        role = RoleSignal()
        applier = self._build_applier(group_id, settings.data_dir, peers)
        replica = RaftReplica(raft, applier, role)
        batcher = Batcher(
            group_id,
            replica.propose,
            spawn=self._threads.start,
            in_flight_max=self._tuning.proposals_in_flight,
        )
        self._groups[group_id] = Group(settings, applier, replica, role, batcher)

    def _hold_followers_s(self) -> float:
        held_ms = self._tuning.hold_followers_ms
        return HOLD_FOLLOWERS_S if held_ms is None else held_ms / 1000

    def _build_catalog(self) -> Catalog:
        """Table names are claimed in the lowest configured group's log (catalog.py)."""
        catalog_id = min(group.group_id for group in self.cluster.groups)
        members = {
            alias: self.cluster.node(alias).address
            for alias in self.cluster.group(catalog_id).members
        }
        return Catalog(catalog_id, self._groups.get(catalog_id), members, self._peers)

    def _housekeeping(self) -> None:  # the node's housekeeping loop: runs until stop()
        """Reconcile the catalog of table names; compare replica digests when due."""
        interval_s = min(_HOUSEKEEPING_S, self.cluster.digest_interval_s or _HOUSEKEEPING_S)
        while not self._stopping.wait(timeout=interval_s):
            digests_due = (
                self.cluster.digest_interval_s > 0 and time.monotonic() >= self._next_digest_at
            )
            if digests_due:
                self._next_digest_at = time.monotonic() + self.cluster.digest_interval_s
            for group in self.groups():
                if group.group_id == LOCAL_GROUP:
                    continue
                try:
                    self.catalog.reconcile(group)
                    if digests_due:
                        self._digests.check(group, self._peer_members(group.group_id), self.alias)
                except Exception:  # housekeeping must outlive one bad round; logged
                    log.exception("housekeeping failed group=%d", group.group_id)

    def _peer_members(self, group_id: int) -> dict[str, NodeAddress]:
        return {
            alias: self.cluster.node(alias).address
            for alias in self.cluster.group(group_id).members
        }

    def housekeeping_status(self) -> dict[str, Any]:
        return {
            "scrub": None if self._scrubber is None else self._scrubber.status(),
            "digest_comparisons": self._digests.comparisons,
            "digest_mismatches": self._digests.mismatches,
            "publish_port": None if self._publish_port is None else self._publish_port.status(),
        }

    def group_statuses(self) -> list[dict[str, Any]]:
        """Every group's status (role, indexes, health...) without its per-table figures."""
        return [
            {key: value for key, value in group.status().items() if key != "table_stats"}
            for group in self._groups.values()
        ]

    def streaming_stat(self) -> dict[str, Any]:
        """getStreamingStat: per table publish figures, per topic subscriptions and lag, and
        every group's status, as this node sees them."""
        groups = list(self._groups.values())
        publish, subscriptions = [], []
        for group in groups:
            status = group.status()
            tables = status.pop("table_stats")
            for table, stats in tables.items():
                publish.append({"raft_group": group.group_id, "table": table, **stats})
            topics = group.topics()
            for topic, count in status["subscriptions"].items():
                rows = tables.get(topic.rpartition("/")[0], {}).get("row_count", 0)
                offset = topics.get(topic, -1)
                subscriptions.append(
                    {
                        "topic": topic,
                        "connections": count,
                        "persisted_offset": offset,
                        "lag": subscriber_lag(rows, offset),
                    }
                )
        return {
            "alias": self.alias,
            "tables": publish,
            "subscriptions": subscriptions,
            "topics": {topic: o for group in groups for topic, o in group.topics().items()},
            "groups": self.group_statuses(),
        }

    def ready(self) -> bool:
        """Every group has replayed its local log and none is in doubt."""
        return all(group.ready() for group in self._groups.values())

    def serving(self) -> bool:
        """Ready, and every Raft group knows its leader: what grpc.health.v1 says SERVING
        for (and the Docker health check asks)."""
        if self._stopping.is_set() or not self.ready():
            return False
        return all(
            group.leader() is not None
            for group_id, group in self._groups.items()
            if group_id != LOCAL_GROUP
        )

    def _bootstrap_admin(self) -> None:
        """Create the first admin once this node leads the catalog group of a cluster
        without users (access.py: a no-op if another leader's came first)."""
        password = self._admin_password
        if password is None:
            return
        try:
            if self.catalog.bootstrap_admin(lambda: passwords.hash_password(password)):
                self._admin_password = None  # users exist: never needed again
        except RaftStoreError as error:
            log.warning("creating the first admin failed (retried): %s", error)

    def _watch(self) -> None:  # the node's watch loop: runs until stop()
        """Keep the gRPC health status current; ask for preferred leaderships back."""
        serving: bool | None = None
        while not self._stopping.wait(timeout=_WATCH_S):
            now_serving = self.serving()
            if now_serving != serving:
                serving = now_serving
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if serving
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                for service in HEALTH_SERVICES:
                    self._health.set(service, status)
                log.info("health serving=%s", serving)
            self._bootstrap_admin()
            try:
                self._preferred.check(self.groups())
            except Exception:  # the watch must outlive one bad round; logged
                log.exception("preferred leader check failed")

    def _start_status_server(self) -> None:
        port = self.config.metrics_port
        if port is None:
            return
        self._status_server = StatusServer(self, self.config.host, port, spawn=self._threads.start)
        self._status_server.start()
        log.info("metrics and status page on http://%s:%d/", self.config.host, port)

    def _start_publish_port(self) -> None:
        port = self.config.publish_port
        if port is None:
            return
        tls = self.config.tls
        self._publish_port = PublishPort(
            self,
            self.config.host,
            port,
            spawn=self._threads.start,
            connections_max=limits.PUBLISH_PORT_CONNECTIONS_MAX,
            tls=None
            if tls is None or self._tls_pem is None
            else node_tls.server_ssl_context(tls, self._tls_pem, str(self.cluster.path)),
        )
        self._publish_port.start()
        log.info("publish port on %s:%d", self.config.host, port)

    @property
    def publish_port(self) -> int:
        """The port clients may publish on (publish_port.py); 0 when not served."""
        return 0 if self._publish_port is None else self._publish_port.port

    def _start_server(self) -> None:
        tls = self.config.tls
        credentials = (
            None
            if tls is None or self._tls_pem is None
            else node_tls.server_credentials(self._tls_pem, client_auth=tls.client_auth)
        )
        self._server = start_server(
            self,
            f"{self.config.host}:{self.config.port}",
            health=self._health,
            credentials=credentials,
        )

    def _apply_tuning(self) -> None:
        """The process-wide knobs (tuning.py), before any thread of the write path runs."""
        log.info("followers yield after acknowledging: %s", self._yield_after_ack)
        if self._tuning == DEFAULT_TUNING:
            return
        log.warning("measurement knobs on (HASTREAM_TUNING) tuning=%s", self._tuning)
        if self._tuning.switch_interval_ms is not None:
            sys.setswitchinterval(self._tuning.switch_interval_ms / 1000)
        if self._tuning.trace_file is not None:
            trace.install(trace.RecordingTrace(self._tuning.trace_file))

    def run(self) -> None:
        """Start, announce readiness, and block until SIGTERM/SIGINT (main thread)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.start()
        while not self.ready():  # polls cheap in-memory state; the signal may end it
            if self._stopping.wait(timeout=0.05):
                self.stop()
                return
        print(
            READY_LINE.format(alias=self.alias, port=self.config.port), file=sys.stderr, flush=True
        )
        log.info(
            "node ready alias=%s address=%s advertised=%s",
            self.alias,
            self.config.address,
            self.config.advertised_address,
        )
        while not self._stopping.wait(timeout=1.0):
            pass
        self.stop()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.info("signal received signum=%d", signum)
        self._stopping.set()

    def stop(self) -> None:
        """Hand every group this node leads to a follower (bounded), then stop serving,
        then close the groups, then join the node's threads (bounded)."""
        self._stopping.set()
        self._health.enter_graceful_shutdown()
        if self._server is not None:  # started: groups may lead, and clients are connected
            hand_over(self.groups(), limits.SHUTDOWN_TRANSFER_TIMEOUT_S, self._threads.start)
        if self._status_server is not None:
            self._status_server.close()
        if self._publish_port is not None:
            self._publish_port.close()
        if self._server is not None:
            self._server.stop(grace=2).wait()
        for group in self._groups.values():
            group.close()
        # Everything has been told to stop (_stopping, each close): this only waits.
        self._threads.join(_THREADS_JOIN_S)
        self._peers.close()
        if self._tuning.trace_file is not None:
            trace.current().close()  # writes the stage summary bench.experiment reads
        log.info("node stopped alias=%s", self.alias)
