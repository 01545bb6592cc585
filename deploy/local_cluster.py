"""An ephemeral local cluster: `python -m raftstore` processes on loopback ports picked at
run time, readiness from their log line, kill -9 / SIGSTOP of real processes, raw gRPC.

Used by the tests, the benchmark and the main job. Nothing here mocks the cluster: every
call crosses a real socket to a real node process.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pyarrow as pa

from api_clients.login import Login, TokenInterceptor
from deploy.dev_tls import DevCA
from deploy.ports import free_ports as free_ports  # re-exported for the tests and benchmarks
from hastream.files import write_atomic
from hastream.tls import ClientTls
from proto import hastream_pb2 as pb
from proto import hastream_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger(__name__)
T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    *,
    timeout_s: float,
    interval_s: float = 0.05,
    message: str = "",
    fatal: tuple[type[Exception], ...] = (),
) -> T:
    """Poll `predicate` until it returns a truthy value; fail the test at the deadline. An
    exception of a `fatal` type ends the wait at once (others are retried)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except fatal:
            raise
        except Exception as error:
            last_error = error
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s}s: {message} (last error: {last_error})"
            )
        time.sleep(interval_s)


def _nofile_prefix(limit: int) -> list[str]:
    """`prlimit` arguments that run a command under an open-files limit of `limit`, soft and
    hard (a node raises its soft limit to the hard one at start: only a hard limit holds)."""
    prlimit = shutil.which("prlimit")
    assert prlimit is not None, "prlimit (util-linux) is needed to start a node under a limit"
    return [prlimit, f"--nofile={limit}:{limit}"]


def ipc_stream(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    payload: bytes = sink.getvalue().to_pybytes()
    return payload


def read_stream(payload: bytes) -> pa.Table:
    return pa.ipc.open_stream(payload).read_all()


class NodeExited(AssertionError):
    """A node process exited while the caller waited for it."""


_AUTHENTICATION_OFF = "authentication=off"
_PUBLISH_PORT = "publishPort"


@dataclass
class NodeProcess:
    alias: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    log_offset: int = 0  # where this incarnation's log begins
    host: str = "127.0.0.1"  # what it binds and is dialled on (cluster.cfg `<alias>.host`)

    @property
    def site(self) -> str:
        """`host:port`, as a client dials it."""
        return f"{self.host}:{self.port}"


@dataclass
class LocalCluster:
    root: Path
    size: int = 3
    groups: tuple[int, ...] = (2,)
    purge_interval_s: float = 300.0
    election_timeout_s: float = 1.0
    extra_config: tuple[str, ...] = ()  # more cluster.cfg lines, e.g. "streamingTablesMax=3"
    # alias -> host it binds (default 127.0.0.1), e.g. its address in its network namespace
    hosts: dict[str, str] = field(default_factory=dict)
    # alias -> what its command starts with, e.g. ("ip", "netns", "exec", "NS"); it must
    # exec the node (so the process is the node itself: signals reach it)
    launch_prefix: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # more environment variables for every node process, e.g. raftstore.tuning's
    # HASTREAM_TUNING for an A/B run (bench.experiment)
    environment: dict[str, str] = field(default_factory=dict)
    # the checkout the nodes run from (bench.checkouts_ab starts one cluster per checkout)
    repo: Path = REPO
    # every node serves waited publishes on a publish port too (raftstore/publish_port.py);
    # off for a checkout from before it (an unknown key stops a node)
    publish_ports: bool = True
    nodes: dict[str, NodeProcess] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # enable_metrics()
    # enable_tls(): what the harness's own channels (stub) connect with
    client_tls: ClientTls | None = None
    # enable_authentication(): the user the harness's own channels (stub) log in as
    client_login: tuple[str, str] | None = None
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)
    _logins: dict[str, Login] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        ports = free_ports(self.size * (2 + len(self.groups)))
        aliases = [f"node{number}" for number in range(1, self.size + 1)]
        lines = [
            "streamingHAMode=raft",
            "streamingRaftGroups="
            + ",".join(f"{group}:" + ":".join(aliases) for group in self.groups),
            f"persistenceDir={self.root}/<ALIAS>/persistence",
            f"streamingHADir={self.root}/<ALIAS>/raftlog",
            f"streamingHAPurgeInterval={self.purge_interval_s}",
            f"streamingRaftElectionTimeout={self.election_timeout_s}",
            "streamingRaftSecret=test-cluster-secret",
            *self.extra_config,
        ]
        for number, alias in enumerate(aliases):
            port = ports[number]
            raft = ",".join(
                f"{group}:{ports[self.size * (1 + index) + number]}"
                for index, group in enumerate(self.groups)
            )
            host = self.hosts.get(alias, "127.0.0.1")
            lines += [
                f"{alias}.host={host}",
                f"{alias}.port={port}",
                f"{alias}.raftPorts={raft}",
            ]
            if self.publish_ports:
                publish_port = ports[self.size * (1 + len(self.groups)) + number]
                lines.append(f"{alias}.{_PUBLISH_PORT}={publish_port}")
            self.nodes[alias] = NodeProcess(alias, port, self.root / f"{alias}.log", host=host)
        if any(not host.startswith("127.") for host in self.hosts.values()):
            # Off-loopback hosts (network namespaces) turn logins on by default; the
            # harness's clients log in only after enable_authentication().
            lines.append(_AUTHENTICATION_OFF)
        self.config_path = self.root / "cluster.cfg"
        self._config_lines = lines
        self.config_path.write_text("\n".join(lines) + "\n")

    def advertise(self, alias: str, host: str, port: int) -> None:
        """Set the node's `advertisedHost`/`advertisedPort` (what it is called to clients);
        it still binds 127.0.0.1:<its port>. Only before the node first starts."""
        assert self.nodes[alias].process is None, f"{alias} already started"
        self._config_lines += [f"{alias}.advertisedHost={host}", f"{alias}.advertisedPort={port}"]
        self.config_path.write_text("\n".join(self._config_lines) + "\n")

    def enable_metrics(self) -> dict[str, int]:
        """Give every node a `metricsPort` (HTTP metrics and status page on 127.0.0.1);
        alias -> port. Only before the nodes first start."""
        # Picked while the cfg's ports are not bound yet: free_ports does not hand out again
        # a port it handed out lately (deploy/ports.py), so these are not the cfg's.
        ports = dict(zip(self.nodes, free_ports(len(self.nodes)), strict=True))
        self.add_config_lines(*(f"{alias}.metricsPort={port}" for alias, port in ports.items()))
        self.metrics_ports = ports
        return ports

    def enable_tls(self, *, client_auth: bool = False) -> DevCA:
        """TLS on every node's client port, with a development CA under `root/tls` and one
        certificate per node; `client_auth`: mutual TLS (tlsClientAuth=require). The
        harness's channels then use a client certificate of the same CA. Only before the
        nodes first start."""
        ca = DevCA.create(self.root / "tls")
        for alias, node in self.nodes.items():
            issued = ca.issue(alias, (node.host,))
            self.add_config_lines(
                f"{alias}.tlsCertFile={issued.cert_file}", f"{alias}.tlsKeyFile={issued.key_file}"
            )
        self.add_config_lines(f"tlsCAFile={ca.ca_file}")
        if client_auth:
            self.add_config_lines("tlsClientAuth=require")
        self.client_tls = ca.client("harness")
        return ca

    def enable_authentication(self, admin_password: str = "harness-admin-password") -> Path:
        """Logins on every node (authentication=on), the first admin's password in a file
        under `root` (mode 0600); the harness's channels log in as that admin. Returns the
        password file. Only before the nodes first start."""
        password_file = self.root / "admin.password"
        write_atomic(password_file, (admin_password + "\n").encode(), mode=0o600)
        self._config_lines = [line for line in self._config_lines if line != _AUTHENTICATION_OFF]
        self.add_config_lines("authentication=on", f"adminPasswordFile={password_file}")
        self.client_login = ("admin", admin_password)
        return password_file

    def add_config_lines(self, *lines: str) -> None:
        """Append `key=value` lines to the cluster.cfg. Only before the nodes first start."""
        assert all(node.process is None for node in self.nodes.values()), "already started"
        self._config_lines += list(lines)
        self.config_path.write_text("\n".join(self._config_lines) + "\n")

    # --- processes ---

    def start(self) -> LocalCluster:
        for alias in self.nodes:
            self.start_node(alias, wait=False)
        for alias in self.nodes:
            self.wait_node_ready(alias)
        return self

    def start_node(self, alias: str, *, wait: bool = True, nofile: int | None = None) -> None:
        """Start node `alias` (its log is appended to). With `nofile`, the process starts
        under that limit of open files, soft and hard (`prlimit`)."""
        node = self.nodes[alias]
        node.log_offset = node.log_path.stat().st_size if node.log_path.exists() else 0
        env = {**os.environ, "PYTHONPATH": str(self.repo), **self.environment}
        command = [sys.executable, "-m", "raftstore", "--config", str(self.config_path)]
        command += ["--node", alias]
        if nofile is not None:
            command = [*_nofile_prefix(nofile), *command]
        command = [*self.launch_prefix.get(alias, ()), *command]
        with node.log_path.open("ab") as log_file:
            node.process = subprocess.Popen(
                command,
                cwd=self.repo,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        if wait:
            self.wait_node_ready(alias)

    def wait_node_ready(self, alias: str, timeout_s: float = 60) -> None:
        """Wait for the node's ready line; fail at once if the process exits first."""
        node = self.nodes[alias]

        def ready() -> bool:
            assert node.process is not None
            if node.process.poll() is not None:
                raise NodeExited(f"{alias} exited: {self.log_tail(alias)}")
            with node.log_path.open("rb") as log_file:
                log_file.seek(node.log_offset)
                return f"NODE READY alias={alias}".encode() in log_file.read()

        # Not wait_until: it retries a predicate that raises, and an exit is final.
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s: {alias} ready")
            time.sleep(0.05)

    def log_tail(self, alias: str, lines: int = 30) -> str:
        text = self.nodes[alias].log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def signal(self, alias: str, signum: int) -> None:
        process = self.nodes[alias].process
        assert process is not None
        os.kill(process.pid, signum)

    def kill(self, alias: str) -> None:
        """SIGKILL and reap."""
        node = self.nodes[alias]
        if node.process is not None and node.process.poll() is None:
            node.process.kill()
            node.process.wait(timeout=30)
        self._drop_channel(alias)

    def terminate(self, alias: str, timeout_s: float = 30) -> int | None:
        """SIGCONT (in case it is stopped), SIGTERM, and wait up to `timeout_s` for the exit;
        SIGKILL if it does not exit in time. Returns the exit code of a SIGTERM exit, None if
        it had to be killed or was not running."""
        node = self.nodes[alias]
        self._drop_channel(alias)
        if node.process is None or node.process.poll() is not None:
            return None
        os.kill(node.process.pid, signal.SIGCONT)
        node.process.terminate()
        try:
            return node.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit on SIGTERM within %.0fs; SIGKILL", alias, timeout_s)
            node.process.kill()
            node.process.wait(timeout=30)
            return None

    def pid(self, alias: str) -> int:
        process = self.nodes[alias].process
        assert process is not None, f"{alias} never started"
        return process.pid

    def exit_code(self, alias: str) -> int | None:
        """The exit code of the node's last process; None while it runs (or never ran)."""
        process = self.nodes[alias].process
        return None if process is None else process.poll()

    def persistence_dir(self, alias: str) -> Path:
        """The node's `persistenceDir` (data files)."""
        return self.root / alias / "persistence"

    def ha_dir(self, alias: str) -> Path:
        """The node's `streamingHADir` (Raft journal, raft.meta, checkpoints)."""
        return self.root / alias / "raftlog"

    def log_since_start(self, alias: str) -> str:
        """The log of the node's current (or last) process."""
        node = self.nodes[alias]
        with node.log_path.open("rb") as log_file:
            log_file.seek(node.log_offset)
            return log_file.read().decode(errors="replace")

    def alive(self) -> list[str]:
        return [
            alias
            for alias, node in self.nodes.items()
            if node.process is not None and node.process.poll() is None
        ]

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.process is None or node.process.poll() is not None:
                continue
            try:
                os.kill(node.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                continue
            node.process.terminate()
        for node in self.nodes.values():
            if node.process is None:
                continue
            try:
                node.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait(timeout=10)
        for alias in list(self._channels):
            self._drop_channel(alias)

    # --- gRPC ---

    def _drop_channel(self, alias: str) -> None:
        channel = self._channels.pop(alias, None)
        if channel is not None:
            channel.close()

    def stub(self, alias: str) -> hastream_pb2_grpc.StreamTableStub:
        channel = self._channels.get(alias)
        if channel is None:
            options = [
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
                # Its own connection: a channel made anew after a failed poll (`leader`) must
                # not share the old one's connection state, as gRPC's shared pool would.
                ("grpc.use_local_subchannel_pool", 1),
            ]
            if self.client_tls is None:
                channel = grpc.insecure_channel(self.nodes[alias].site, options=options)
            else:
                pem = self.client_tls.read()
                credentials = grpc.ssl_channel_credentials(pem.ca, pem.private_key, pem.cert_chain)
                channel = grpc.secure_channel(self.nodes[alias].site, credentials, options)
            self._channels[alias] = channel
        if self.client_login is not None:
            login = self._logins.setdefault(alias, Login(*self.client_login))
            channel = grpc.intercept_channel(channel, TokenInterceptor(login, channel))
        return hastream_pb2_grpc.StreamTableStub(channel)

    def alias_of(self, address: str) -> str:
        return address.rsplit(":", 1)[1]

    def status(self, alias: str) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(
            self.stub(alias).GetNodeStatus(pb.Empty(), timeout=5).json
        )
        return document

    def group_status(self, alias: str, group: int) -> dict[str, Any]:
        for entry in self.status(alias)["groups"]:
            if entry["raft_group"] == group:
                return dict(entry)
        raise AssertionError(f"{alias} has no group {group}")

    def highest_term(self, group: int = 2) -> int:
        """The highest Raft term of `group` among the live nodes: its change over a stretch
        of time counts the elections in it."""
        return max(int(self.group_status(alias, group)["term"]) for alias in self.alive())

    def leader(self, group: int = 2, timeout_s: float = 30) -> str:
        """The alias every live node agrees leads `group`, once it can take writes."""

        def agreed() -> str | None:
            leaders = set()
            for alias in self.alive():
                try:
                    reply = self.stub(alias).GetStreamingLeader(
                        pb.GroupRequest(raft_group=group), timeout=2
                    )
                except grpc.RpcError:
                    # The next poll dials on a fresh channel: a connect to a node restarted
                    # a moment ago was seen to time out again and again on one channel for
                    # 30 s while the node served. The old channel is not closed: a stub
                    # another thread holds keeps working until it lets go.
                    self._channels.pop(alias, None)
                    raise
                leaders.add(reply.leader)
            if len(leaders) != 1 or "" in leaders:
                return None
            alias = self.alias_of(leaders.pop())
            status = self.group_status(alias, group)
            return alias if status["role"] == "leader" else None

        leader = wait_until(
            agreed, timeout_s=timeout_s, interval_s=0.1, message=f"leader of group {group}"
        )
        assert leader is not None  # wait_until returns only a truthy value
        return leader

    def create_table(
        self,
        table: str,
        schema: pa.Schema,
        *,
        group: int = 2,
        key_column: str = "",
        cache_limit: int = 100_000,
    ) -> None:
        def create() -> bool:
            leader = self.leader(group)
            try:
                self.stub(leader).HaStreamTable(
                    pb.CreateTableRequest(
                        raft_group=group,
                        table=table,
                        schema_ipc=schema.serialize().to_pybytes(),
                        cache_limit=cache_limit,
                        key_column=key_column,
                    ),
                    timeout=15,
                )
            except grpc.RpcError as error:
                if dict(error.trailing_metadata() or ()).get("hastream-error") == "TableExists":
                    return True
                raise
            return True

        wait_until(create, timeout_s=60, interval_s=0.2, message=f"create {table}")

    def caught_up(self, alias: str, timeout_s: float = 10.0) -> bool:
        """Waits until `alias` applied every entry the leaders of its groups had committed
        when asked: a follower learns the commit index with the leader's next entry or a
        heartbeat brought forward, a few ms after the leader answered. False at the timeout
        (e.g. a replica cut off on purpose): the caller then sees what it holds."""
        committed: dict[int, int] = {}
        for other in self.alive():
            if other == alias:
                continue
            try:
                groups = self.status(other)["groups"]
            except grpc.RpcError:
                continue
            for group in groups:
                if group["role"] == "leader":  # a node's local group leads itself: skipped below
                    number = int(group["raft_group"])
                    committed[number] = max(committed.get(number, 0), int(group["commit_index"]))

        def applied() -> bool:
            for group in self.status(alias)["groups"]:
                wanted = committed.get(int(group["raft_group"]))
                lagging = wanted is not None and int(group["last_applied"]) < wanted
                if group["role"] != "leader" and lagging:
                    return False
            return True

        deadline = time.monotonic() + timeout_s
        while True:  # Bounded by the deadline.
            try:
                if applied():
                    return True
            except grpc.RpcError:
                return False
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def read_table(self, alias: str, table: str) -> pa.Table:
        """Every row `alias` holds of `table`, once it applied what was committed."""
        self.caught_up(alias)
        batches: list[pa.RecordBatch] = []
        for message in self.stub(alias).Read(
            pb.ReadRequest(table=table, offset_from=0, offset_to=-1), timeout=120
        ):
            batches.extend(read_stream(message.payload).to_batches())
        return pa.Table.from_batches(batches) if batches else pa.table({})

    def row_count(self, alias: str, table: str) -> int:
        return int(self.stub(alias).GetTableInfo(pb.TableRequest(table=table), timeout=5).row_count)
