"""Composition root: builds the groups, their replicas and the gRPC server; owns shutdown.

pysyncobj's tick thread stops when the thread that built its SyncObj exits, so `run()`
builds every replica on the calling (main) thread and keeps that thread alive until a
signal asks the node to stop.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from types import FrameType

import grpc

from proto import hastream_pb2_grpc
from raftstore import limits
from raftstore.config import ClusterConfig
from raftstore.errors import UnknownGroup
from raftstore.group import Group, GroupSettings, Member
from raftstore.local_replica import LOCAL_ADDRESS, LocalReplica
from raftstore.model import LOCAL_GROUP
from raftstore.peers import PeerClient
from raftstore.replication import RaftReplica, RaftSettings
from raftstore.service import StreamTableService

log = logging.getLogger(__name__)


class DirectoryLocked(RuntimeError):
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        super().__init__(f"{directory} is in use by another node process")


READY_LINE = "NODE READY alias={alias} port={port}"
GRPC_WORKERS = 64


class Node:
    def __init__(self, cluster: ClusterConfig, alias: str) -> None:
        self.cluster = cluster
        self.config = cluster.node(alias)
        self.alias = alias
        self._groups: dict[int, Group] = {}
        self._peers = PeerClient()
        self._stopping = threading.Event()
        self._server: grpc.Server | None = None
        self._lock_fds: list[int] = []

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
        for directory in (self.config.persistence_dir, self.config.ha_dir):
            self._lock_directory(directory)
        self._start_local_group()
        for group_config in self.cluster.groups_of(self.alias):
            self._start_raft_group(group_config.group_id)
        self._start_server()

    def _lock_directory(self, directory: Path) -> None:
        """Two processes must never write one node's files: hold an exclusive lock."""
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryLocked(directory) from None
        self._lock_fds.append(fd)

    def _start_local_group(self) -> None:
        settings = GroupSettings(
            group_id=LOCAL_GROUP,
            data_dir=self.config.persistence_dir / "local",
            self_address=self.config.advertised_address,
            members={LOCAL_ADDRESS: self._member(self.alias)},
        )
        group = Group(settings, self._peers.fetch_records)
        replica = LocalReplica(self.config.ha_dir / "local", group, self.cluster.purge_interval_s)
        group.attach(replica)
        self._groups[LOCAL_GROUP] = group

    def _member(self, alias: str) -> Member:
        node = self.cluster.node(alias)
        return Member(address=node.address, advertised=node.advertised_address)

    def _start_raft_group(self, group_id: int) -> None:
        members = {
            self.cluster.raft_address(alias, group_id): self._member(alias)
            for alias in self.cluster.group(group_id).members
        }
        settings = GroupSettings(
            group_id=group_id,
            data_dir=self.config.persistence_dir / f"group-{group_id}",
            self_address=self.config.advertised_address,
            members=members,
        )
        group = Group(settings, self._peers.fetch_records)
        raft = RaftSettings(
            group_id=group_id,
            self_address=self.cluster.raft_address(self.alias, group_id),
            peer_addresses=self.cluster.raft_peers(self.alias, group_id),
            directory=self.config.ha_dir / f"group-{group_id}",
            secret=self.cluster.raft_secret,
            election_timeout_s=self.cluster.election_timeout_s,
            checkpoint_interval_s=self.cluster.purge_interval_s,
        )
        group.attach(RaftReplica(raft, group))
        self._groups[group_id] = group

    def _start_server(self) -> None:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=GRPC_WORKERS, thread_name_prefix="grpc"),
            options=[
                ("grpc.max_receive_message_length", limits.GRPC_MESSAGE_BYTES_MAX),
                ("grpc.max_send_message_length", limits.GRPC_MESSAGE_BYTES_MAX),
                ("grpc.so_reuseport", 0),
                # Let clients probe idle streams (a subscriber must notice a frozen leader).
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 2_000),
                ("grpc.http2.max_ping_strikes", 0),
            ],
            maximum_concurrent_rpcs=GRPC_WORKERS - 4,
        )
        hastream_pb2_grpc.add_StreamTableServicer_to_server(StreamTableService(self), server)
        address = f"{self.config.host}:{self.config.port}"
        if server.add_insecure_port(address) == 0:
            raise OSError(f"cannot bind gRPC port {address}")
        server.start()
        self._server = server

    def run(self) -> None:
        """Start, announce readiness, and block until SIGTERM/SIGINT (main thread)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.start()
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
        if self._server is not None:
            self._server.stop(grace=2).wait()
        for group in self._groups.values():
            group.close()
        self._peers.close()
        log.info("node stopped alias=%s", self.alias)
