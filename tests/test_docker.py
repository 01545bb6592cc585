"""A three-node cluster in real Docker containers, driven by `deploy.docker.tool`.

Every docker test runs its own deployment (unique network, volumes and containers, removed
at the end) on images built once per session (and skipped when their inputs hash has not
changed since an earlier run). Clients reach the nodes through the published ports only,
with a plain `api_clients.connect` session: the nodes advertise those published sites, so
NotLeader redirects need no address mapping.
Each test ends by reading every node directly (the raw gRPC Read on its published port) and
checking that every acknowledged row is there exactly once, in the same order everywhere.
Skipped, with the reason, when no Docker engine answers.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest

from api_clients import Publisher, Session, connect
from api_clients.login import Login, TokenInterceptor
from deploy import rolling
from deploy.docker import deployment as plans
from deploy.docker import images, tool
from deploy.docker.deployment import Deployment
from deploy.local_cluster import wait_until
from proto import hastream_pb2, hastream_pb2_grpc
from raftstore import config
from tests import ops_helpers

log = logging.getLogger(__name__)

RUN_ID = secrets.token_hex(3)
GROUP = 2
ELECTION_TIMEOUT_S = 1.0
# What raftstore/replication.py configures: a leader cut off from the majority steps down.
LEADER_FALLBACK_TIMEOUT_S = max(2 * ELECTION_TIMEOUT_S, 1.0)
SCHEMA = pa.schema([("id", pa.int64()), ("ts", pa.timestamp("ms")), ("value", pa.float64())])
BATCH_ROWS = 25
CONVERGE_TIMEOUT_S = 60.0
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[Any]:
    try:
        import docker

        engine = docker.from_env()
        engine.ping()
    except Exception as error:
        pytest.skip(f"no Docker engine answers docker.from_env().ping(): {error}")
    yield engine
    _sweep(engine)  # anything a failed teardown left behind
    engine.close()


@pytest.fixture(scope="session")
def node_image(docker_engine: Any) -> str:
    """Base and node images, built once per session (cached across runs by inputs hash)."""
    started = time.monotonic()
    images.ensure_images(docker_engine)
    log.info("images ready seconds=%.1f", time.monotonic() - started)
    return images.NODE_TAG_DEFAULT


@pytest.fixture
def deployment(docker_engine: Any, node_image: str, tmp_path: Path) -> Iterator[Deployment]:
    """A running three-node deployment with a unique name; removed with its volumes."""
    name = f"hst{RUN_ID}-{secrets.token_hex(2)}"
    planned = plans.plan(
        docker_engine,
        name=name,
        state_root=tmp_path,
        image=node_image,
        election_timeout_s=ELECTION_TIMEOUT_S,
    )
    plans.save(planned)
    try:
        tool.up(docker_engine, planned)
        yield planned
    finally:
        for alias in planned.aliases:
            print(f"--- {alias} log tail ---\n{tool.log_tail(docker_engine, planned, alias, 30)}")
        tool.down(docker_engine, planned, volumes=True)


def _sweep(engine: Any) -> None:
    """Remove every container, network and volume of this run's deployments."""
    prefix = f"hst{RUN_ID}-"

    def ours(item: Any) -> bool:
        labels = item.attrs.get("Labels") or item.attrs.get("Config", {}).get("Labels") or {}
        return str(labels.get(tool.LABEL_DEPLOYMENT, "")).startswith(prefix)

    for item in engine.containers.list(all=True, filters={"label": tool.LABEL_DEPLOYMENT}):
        if ours(item):
            item.remove(force=True)
    for network in engine.networks.list(filters={"label": tool.LABEL_DEPLOYMENT}):
        if ours(network):
            network.remove()
    for volume in engine.volumes.list(filters={"label": tool.LABEL_DEPLOYMENT}):
        if ours(volume):
            volume.remove(force=True)


# ---------------------------------------------------------------------------------------
# Helpers


def plain_session(deployment: Deployment, *, first: str | None = None) -> Session:
    """`api_clients.connect` on the published sites (`first`'s first, default node1's)."""
    first = first or deployment.aliases[0]
    host, port = deployment.site(first).rsplit(":", 1)
    others = [deployment.site(alias) for alias in deployment.aliases if alias != first]
    ca_file = plans.client_tls(deployment).ca_file
    userid, password = plans.admin_login(deployment)
    return connect(host, int(port), userid, password, highAvailabilitySites=others, caFile=ca_file)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll until `predicate` returns a truthy value; fail with `what` at the deadline."""
    return wait_until(predicate, timeout_s=timeout_s, interval_s=0.1, message=what)


def rows(first_id: int, count: int) -> pa.Table:
    ids = list(range(first_id, first_id + count))
    now_ms = int(time.time() * 1000)
    return pa.table(
        {"id": ids, "ts": [now_ms] * count, "value": [float(i) / 10 for i in ids]},
        schema=SCHEMA,
    )


def create_table(session: Session, table: str) -> None:
    session.haStreamTable(GROUP, SCHEMA, table, cacheLimit=10_000, keyColumn="id")


class BackgroundPublisher:
    """Publishes batches of fresh ids through one HA session until stopped; records the
    ids of every acknowledged batch. Failed appends (a deadline during a failover) are
    counted and the next batch goes on: their rows may or may not be committed."""

    def __init__(self, session: Session, table: str) -> None:
        self._publisher = Publisher(session, table)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._acked: list[int] = []
        self.failures: list[str] = []
        self._next_id = 1_000_000
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    def __enter__(self) -> BackgroundPublisher:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "publisher thread did not stop"

    @property
    def acked(self) -> list[int]:
        with self._lock:
            return list(self._acked)

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = rows(self._next_id, BATCH_ROWS)
            self._next_id += BATCH_ROWS
            try:
                result = self._publisher.append(batch)
            except Exception as error:  # recorded: the test decides what is acceptable
                self.failures.append(repr(error))
                continue
            assert result.row_count + result.duplicates == BATCH_ROWS, result
            with self._lock:
                self._acked.extend(batch.column("id").to_pylist())

    def wait_acked(self, count: int, timeout_s: float) -> None:
        wait_for(lambda: len(self.acked) >= count, timeout_s, f"{count} acknowledged rows")


def stub(deployment: Deployment, alias: str) -> tuple[grpc.Channel, Any]:
    ca = (plans.tls_dir(deployment) / "ca.pem").read_bytes()
    channel = grpc.secure_channel(
        deployment.site(alias),
        grpc.ssl_channel_credentials(ca),
        options=[("grpc.max_receive_message_length", 64 << 20)],
    )
    login = Login(*plans.admin_login(deployment))
    calls = grpc.intercept_channel(channel, TokenInterceptor(login, channel))
    return channel, hastream_pb2_grpc.StreamTableStub(calls)  # type: ignore[no-untyped-call]


def read_ids(deployment: Deployment, alias: str, table: str) -> list[int]:
    """Every row id node `alias` holds, in offset order, read from that node alone."""
    channel, node = stub(deployment, alias)
    ids: list[int] = []
    with channel:
        request = hastream_pb2.ReadRequest(table=table, offset_from=0, offset_to=-1)
        for message in node.Read(request, timeout=60):
            assert message.first_offset == len(ids), (alias, message.first_offset, len(ids))
            batch = pa.ipc.open_stream(message.payload).read_all()
            ids.extend(batch.column("id").to_pylist())
    return ids


def row_count(deployment: Deployment, alias: str, table: str) -> int | None:
    channel, node = stub(deployment, alias)
    with channel:
        try:
            info = node.GetTableInfo(hastream_pb2.TableRequest(table=table), timeout=2)
        except grpc.RpcError:
            return None
    return int(info.row_count)


def wait_converged(deployment: Deployment, table: str, rows_min: int) -> int:
    """Wait until every node holds the same number of rows, at least `rows_min`."""

    def converged() -> int | None:
        counts = {row_count(deployment, alias, table) for alias in deployment.aliases}
        if len(counts) != 1 or None in counts:
            return None
        (count,) = counts
        return count if count is not None and count >= rows_min else None

    return int(wait_for(converged, CONVERGE_TIMEOUT_S, f"replicas of {table} to converge"))


def ephemeral_ports(engine: Any, deployment: Deployment, alias: str) -> range:
    """The ports the kernel in `alias`'s container hands out by itself (to an outgoing
    connection, or a bind to port 0)."""
    item = engine.containers.get(deployment.node(alias).container)
    path = "/proc/sys/net/ipv4/ip_local_port_range"
    result = item.exec_run(["python", "-c", f"print(open({path!r}).read())"])  # no cat in it
    assert result.exit_code == 0, result.output
    first, last = (int(part) for part in result.output.split())
    return range(first, last + 1)


def assert_every_ack_once_on_every_replica(
    deployment: Deployment, table: str, acked: list[int]
) -> None:
    assert acked, "the test acknowledged no rows"
    wait_converged(deployment, table, len(acked))
    replicas = {alias: read_ids(deployment, alias, table) for alias in deployment.aliases}
    reference = replicas[deployment.aliases[0]]
    for alias, ids in replicas.items():
        duplicates = len(ids) - len(set(ids))
        assert duplicates == 0, f"{alias}: {duplicates} rows present more than once"
        missing = set(acked) - set(ids)
        assert not missing, f"{alias}: {len(missing)} acknowledged rows missing"
        assert ids == reference, f"{alias} differs from {deployment.aliases[0]}"


def group_leader(deployment: Deployment) -> str:
    return str(wait_for(lambda: tool.leader_alias(deployment, GROUP), 30, "a group leader"))


# Runs inside the cut-off node's container, where its gRPC port is still reachable on
# loopback (the container has no other network left). Right after the cut it publishes one
# row while the node may still call itself leader (it must not be acknowledged: no majority
# can commit it); then it waits until the node steps down, publishes again (it must be
# refused with NotLeader), and prints what happened as JSON. Wall-clock times are shared
# with the host (containers use the host's clock).
MINORITY_PROBE = """
import json, sys, threading, time, grpc, pyarrow as pa
from proto import hastream_pb2 as pb, hastream_pb2_grpc as rpc
from hastream import errors
port, group, table = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cut_at, deadline_s = float(sys.argv[4]), float(sys.argv[5])
ca = open("/etc/hastream/tls/ca.pem", "rb").read()  # the deployment's CA, mounted
stub = rpc.StreamTableStub(
    grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca))
)
password = open("/etc/hastream/admin.password").read().strip()  # mounted too
token = stub.Login(pb.LoginRequest(userid="admin", password=password), timeout=10).token
login = (("hastream-token", token),)
schema = pa.schema([("id", pa.int64()), ("ts", pa.timestamp("ms")), ("value", pa.float64())])
def role():
    document = json.loads(stub.GetNodeStatus(pb.Empty(), timeout=3, metadata=login).json)
    return next(g["role"] for g in document["groups"] if g["raft_group"] == group)
def rows():
    return stub.GetTableInfo(pb.TableRequest(table=table), timeout=3, metadata=login).row_count
def publish(row_id):
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(pa.table({"id": [row_id], "ts": [0], "value": [0.0]}, schema=schema))
    try:
        stub.Publish(pb.PublishRequest(table=table, payload=sink.getvalue().to_pybytes()),
                     timeout=20, metadata=login)
        return "accepted"
    except grpc.RpcError as error:
        typed = errors.from_wire(dict(error.trailing_metadata() or ()))
        return type(typed).__name__ if typed is not None else error.code().name
result = {"started_after_cut_s": time.time() - cut_at, "first_role": role(), "rows_before": rows()}
early = {}
thread = threading.Thread(target=lambda: early.update(outcome=publish(-1)))
thread.start()  # blocks until the proposal fails; meanwhile watch the node step down
while role() == "leader" and time.time() - cut_at < deadline_s:
    thread.join(timeout=0.05)  # the publish ends when the proposal fails
result["role"], result["not_leader_after_cut_s"] = role(), time.time() - cut_at
thread.join()
result["early_publish"] = early["outcome"]
result["early_publish_done_after_cut_s"] = time.time() - cut_at
result["late_publish"] = publish(-2)
result["rows_after"] = rows()
print(json.dumps(result))
"""


def start_probe(
    engine: Any, deployment: Deployment, alias: str, table: str, cut_at: float
) -> Callable[[], dict[str, Any]]:
    """Starts MINORITY_PROBE in node `alias`'s container; returns a function that waits for
    its JSON result."""
    item = engine.containers.get(deployment.node(alias).container)
    port = str(deployment.node(alias).port)
    deadline_s = str(LEADER_FALLBACK_TIMEOUT_S + 20)
    command = ["python", "-c", MINORITY_PROBE, port, str(GROUP), table, str(cut_at), deadline_s]
    outcome: dict[str, Any] = {}

    def run() -> None:
        outcome["result"] = item.exec_run(command)

    thread = threading.Thread(target=run, name="minority-probe", daemon=True)
    thread.start()

    def result() -> dict[str, Any]:
        thread.join(timeout=90)
        assert "result" in outcome, "the probe in the cut-off container did not finish"
        output = outcome["result"].output.decode(errors="replace")
        assert outcome["result"].exit_code == 0, output
        document: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
        return document

    return result


# ---------------------------------------------------------------------------------------
# Tests without an engine


@pytest.mark.unit
def test_generated_cluster_cfg_is_accepted_by_the_node_parser(tmp_path: Path) -> None:
    planned = plans.plan(
        None, name="unit", state_root=tmp_path, ports=[18901, 18902, 18903], subnet="10.9.8.0/24"
    )
    plans.save(planned)
    cluster = config.load(planned.config_path)
    assert [node.host for node in cluster.nodes] == [n.container for n in planned.nodes]
    assert [node.port for node in cluster.nodes] == [18901, 18902, 18903]
    # Clients are told the published sites, not the container names.
    advertised = [f"{n.advertised_host}:{n.advertised_port}" for n in cluster.nodes]
    assert advertised == plans.sites(planned)
    # Every node serves a publish port, a free one apart from every client and Raft port.
    publish_ports = [node.publish_port for node in cluster.nodes]
    assert publish_ports == [n.publish_port for n in planned.nodes]
    taken = {18901, 18902, 18903, *(port for _, port in planned.nodes[0].raft_ports)}
    assert len(set(publish_ports)) == 3
    assert not taken.intersection(publish_ports)
    assert plans.load("unit", tmp_path) == planned
    assert planned.config_path.parent.stat().st_mode & 0o077 == 0  # it holds the secret
    # TLS on every node, with certificates generated beside it; the CA key is never mounted.
    assert all(node.tls is not None for node in cluster.nodes)
    mounted = [path.name for path in plans.tls_files(planned, "node1")]
    assert mounted == ["ca.pem", "node1.pem", "node1.key"]
    assert all((plans.tls_dir(planned) / name).exists() for name in mounted)


@pytest.mark.unit
def test_logins_are_on_with_a_generated_admin_password(tmp_path: Path) -> None:
    planned = plans.plan(
        None, name="logins", state_root=tmp_path, ports=[18921, 18922, 18923], subnet="10.9.6.0/24"
    )
    plans.save(planned)
    cluster = config.load(planned.config_path)
    assert cluster.authentication
    assert str(cluster.admin_password_file) == plans.ADMIN_PASSWORD_IN_CONTAINER
    password_file = plans.admin_password_path(planned)
    # Private on this machine (its directory is 0700); the containers' node user reads it.
    assert password_file.parent.stat().st_mode & 0o077 == 0
    assert len(password_file.read_text().strip()) >= 16
    mounts = tool._admin_password_mount(planned)
    assert list(mounts.values()) == [{"bind": plans.ADMIN_PASSWORD_IN_CONTAINER, "mode": "ro"}]
    assert plans.admin_login(planned) == ("admin", password_file.read_text().strip())


@pytest.mark.unit
def test_ensure_config_upgrades_a_cfg_without_advertised_sites(tmp_path: Path) -> None:
    planned = plans.plan(
        None, name="old", state_root=tmp_path, ports=[18911, 18912, 18913], subnet="10.9.7.0/24"
    )
    plans.save(planned)
    secret = config.load(planned.config_path).raft_secret
    old_text = "".join(
        line
        for line in planned.config_path.read_text().splitlines(keepends=True)
        if ".advertised" not in line
    )
    planned.config_path.write_text(old_text)  # as an `up` before advertisedHost wrote it
    plans.ensure_config(planned)
    cluster = config.load(planned.config_path)
    assert cluster.raft_secret == secret  # the running cluster's secret is kept
    assert [str(node.advertised_address) for node in cluster.nodes] == [
        f"{site}:{alias}" for site, alias in zip(plans.sites(planned), planned.aliases, strict=True)
    ]


@pytest.mark.unit
def test_a_deployment_planned_before_publish_ports_keeps_its_plan(tmp_path: Path) -> None:
    planned = plans.plan(
        None,
        name="older",
        state_root=tmp_path,
        ports=[18931, 18932, 18933],
        publish_ports=[18941, 18942, 18943],
        subnet="10.9.5.0/24",
    )
    plans.save(planned)
    assert [node.publish_port for node in config.load(planned.config_path).nodes] == [
        18941,
        18942,
        18943,
    ]
    # deployment.json as the tool wrote it before nodes had publish ports.
    path = planned.state_dir / "deployment.json"
    document = json.loads(path.read_text())
    for node in document["nodes"]:
        del node["publish_port"]
    path.write_text(json.dumps(document))
    older = plans.load("older", tmp_path)
    assert older is not None
    assert [node.publish_port for node in older.nodes] == [None, None, None]
    plans.ensure_config(older)  # what `up` does: its cfg is rewritten without the ports
    assert [node.publish_port for node in config.load(planned.config_path).nodes] == [
        None,
        None,
        None,
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("publish_ports", "problem"),
    [([18951, 18952], "distinct publish ports"), ([18951, 18952, 18901], "client or Raft")],
)
def test_publish_ports_given_are_checked(
    tmp_path: Path, publish_ports: list[int], problem: str
) -> None:
    with pytest.raises(plans.DeployError, match=problem):
        plans.plan(
            None,
            name="bad",
            state_root=tmp_path,
            ports=[18901, 18902, 18903],
            publish_ports=publish_ports,
            subnet="10.9.4.0/24",
        )


@pytest.mark.unit
def test_picked_ports_are_free_distinct_and_above_the_ephemeral_range() -> None:
    taken, excluded = plans.free_ports(2)
    with socket.socket() as held:  # a port in use on the host is never picked
        held.bind(("127.0.0.1", taken))
        for _ in range(20):
            ports = plans.free_ports(6, exclude={excluded})
            assert len(set(ports)) == 6
            assert all(port in plans.PORTS_PICKED for port in ports)
            assert not {taken, excluded} & set(ports)
    # A new network namespace (a container's) hands out ports up to 60999 by itself.
    assert plans.PORTS_PICKED.start > 60999


@pytest.mark.unit
@pytest.mark.parametrize("text", ["8911,x,8913", "8911,,8913", "0,8912,8913", "8911,8912,70000"])
def test_port_options_that_are_not_port_numbers_are_refused(text: str) -> None:
    with pytest.raises(plans.DeployError, match="--publish-ports"):
        tool._port_list("--publish-ports", text)
    assert tool._port_list("--ports", "8901,8902,8903") == [8901, 8902, 8903]
    assert tool._port_list("--ports", None) is None


@pytest.mark.unit
def test_compose_cluster_cfg_matches_the_compose_file() -> None:
    cluster = config.load(REPO / "deploy" / "docker" / "cluster.cfg")
    compose = (REPO / "deploy" / "docker" / "docker-compose.yml").read_text()
    for node in cluster.nodes:
        assert f"  {node.host}:\n    <<: *node" in compose, node.host  # host = service name
        # Published on the advertised host and port, to the same port in the container.
        published = f'"${{HASTREAM_PUBLISH_HOST:-{node.advertised_host}}}:'
        assert f'{published}{node.advertised_port}:{node.port}"' in compose, node.alias
        # The publish port on the same port number: clients dial the advertised host.
        assert f'{published}{node.publish_port}:{node.publish_port}"' in compose, node.alias
        assert f"HASTREAM_NODE: {node.alias}" in compose, node.alias
        assert f'"{node.host}:0.0.0.0"' in compose, node.host  # it binds every interface
        for group_id, port in node.raft_ports:
            assert port not in {other.port for other in cluster.nodes}, (group_id, port)


# ---------------------------------------------------------------------------------------
# Tests on the real engine


@pytest.mark.docker
@pytest.mark.cluster  # slow: `pytest -m "not cluster"` stays fast
def test_publish_through_published_ports_reaches_every_replica(deployment: Deployment) -> None:
    table = "dockerTicks"
    alias = group_leader(deployment)
    follower = next(other for other in deployment.aliases if other != alias)
    # A plain session that knows ONE follower's published site: every write it makes is
    # refused with NotLeader, and it can only succeed by following the hint.
    host, port = deployment.site(follower).rsplit(":", 1)
    userid, password = plans.admin_login(deployment)
    ca_file = plans.client_tls(deployment).ca_file
    with connect(host, int(port), userid, password, caFile=ca_file) as session:
        create_table(session, table)
        publisher = Publisher(session, table)
        acked: list[int] = []
        for first in range(0, 500, 100):
            result = publisher.append(rows(first, 100))
            assert result.row_count == 100
            acked.extend(range(first, first + 100))
        leader = session.getStreamingLeader(GROUP)
        learned = session.sites
    # The node names itself by its advertised address: the published site on this machine.
    assert leader == f"{deployment.site(alias)}:{alias}"
    # The first publish went over gRPC (its answer names the publish port, and the NotLeader
    # hint came from gRPC too); the rest over the leader's published publish port, in TLS.
    status = tool.node_status(deployment, alias)
    assert status is not None
    assert status["publish_port"]["port"] == deployment.node(alias).publish_port
    assert status["publish_port"]["answered"] >= 4
    assert learned == [deployment.site(follower), deployment.site(alias)]
    assert_every_ack_once_on_every_replica(deployment, table, acked)


@pytest.mark.docker
@pytest.mark.cluster
def test_killed_leader_container_fails_over_and_restart_catches_up(
    docker_engine: Any, deployment: Deployment
) -> None:
    table = "killTicks"
    with plain_session(deployment) as session:
        create_table(session, table)
        with BackgroundPublisher(session, table) as publisher:
            publisher.wait_acked(200, 30)
            old_leader = group_leader(deployment)
            tool.kill(docker_engine, deployment, old_leader)
            killed_at = len(publisher.acked)
            killed_s = time.monotonic()
            publisher.wait_acked(killed_at + 200, 60)  # publishing goes on without it
            log.info("publishing resumed after kill seconds=%.1f", time.monotonic() - killed_s)
            new_leader = group_leader(deployment)
            assert new_leader != old_leader
            tool.restart(docker_engine, deployment, old_leader)
            restarted_at = len(publisher.acked)
            publisher.wait_acked(restarted_at + 100, 30)
        acked = publisher.acked
    # The restarted node caught up from its volumes and its peers: the same rows.
    wait_for(
        lambda: row_count(deployment, old_leader, table) is not None,
        CONVERGE_TIMEOUT_S,
        f"restarted {old_leader} to serve {table}",
    )
    assert_every_ack_once_on_every_replica(deployment, table, acked)
    # Created and restarted, a container's own ports lie outside the range its kernel
    # hands out by itself: nothing takes one before the node binds it.
    for alias in deployment.aliases:
        automatic = ephemeral_ports(docker_engine, deployment, alias)
        assert not set(deployment.node(alias).listen_ports) & set(automatic), automatic


@pytest.mark.docker
@pytest.mark.cluster
def test_partitioned_leader_refuses_writes_and_loses_no_acknowledged_row(
    docker_engine: Any, deployment: Deployment
) -> None:
    table = "partitionTicks"
    with plain_session(deployment) as session:
        create_table(session, table)
        with BackgroundPublisher(session, table) as publisher:
            publisher.wait_acked(200, 30)
            old_leader = group_leader(deployment)
            cut_at = time.time()
            assert tool.partition(docker_engine, deployment, old_leader)
            probe = start_probe(docker_engine, deployment, old_leader, table, cut_at)
            acked_at_cut = len(publisher.acked)
            new_leader = group_leader(deployment)  # a majority names it, it answers as leader
            assert new_leader != old_leader
            publisher.wait_acked(acked_at_cut + 200, 60)  # the majority side takes the writes
            outcome = probe()
            log.info("cut-off leader probe: %s", outcome)
            # Cut off, the old leader acknowledged nothing: not while it still believed it
            # led, and, once past its fallback timeout, it refused writes as NotLeader.
            assert outcome["early_publish"] != "accepted", outcome
            assert outcome["late_publish"] == "NotLeader", outcome
            assert outcome["rows_after"] == outcome["rows_before"], outcome
            assert outcome["role"] != "leader", outcome
            assert outcome["not_leader_after_cut_s"] < LEADER_FALLBACK_TIMEOUT_S + 3, outcome
            assert tool.heal(docker_engine, deployment, old_leader)
            healed_at = len(publisher.acked)
            publisher.wait_acked(healed_at + 100, 30)
        acked = publisher.acked
    assert not {-1, -2} & set(read_ids(deployment, old_leader, table))
    assert_every_ack_once_on_every_replica(deployment, table, acked)


@pytest.mark.docker
@pytest.mark.cluster
def test_down_then_up_keeps_the_data_in_volumes(docker_engine: Any, deployment: Deployment) -> None:
    table = "durableTicks"
    with plain_session(deployment) as session:
        create_table(session, table)
        Publisher(session, table).append(rows(0, 300))
    acked = list(range(300))
    assert_every_ack_once_on_every_replica(deployment, table, acked)

    tool.down(docker_engine, deployment)  # keeps volumes and the generated cfg
    assert not docker_engine.containers.list(all=True, filters={"name": deployment.name})
    for alias in deployment.aliases:
        docker_engine.volumes.get(deployment.volume(alias, "data"))
        docker_engine.volumes.get(deployment.volume(alias, "raftlog"))
    reloaded = plans.load(deployment.name, deployment.state_dir.parent)
    assert reloaded == deployment
    tool.up(docker_engine, reloaded)

    assert_every_ack_once_on_every_replica(deployment, table, acked)
    with plain_session(deployment) as session:  # the table needs no re-creation
        result = Publisher(session, table).append(rows(300, 100))
    assert result.first_offset == 300
    assert_every_ack_once_on_every_replica(deployment, table, list(range(400)))


@pytest.mark.docker
@pytest.mark.cluster
def test_rolling_restart_of_the_containers_keeps_every_write(
    docker_engine: Any, deployment: Deployment
) -> None:
    """`deploy.docker.tool rolling-restart`: each container in turn, leadership handed over
    first; Docker's health check (grpc.health.v1) says healthy again after each."""
    table = "rollingTicks"
    control = tool.DockerNodes(docker_engine, deployment)
    with plain_session(deployment) as session:
        session.haStreamTable(GROUP, ops_helpers.SCHEMA, table, cacheLimit=10_000, keyColumn="id")
        publisher = ops_helpers.SteadyPublisher(session, table).start()
        try:
            wait_for(lambda: len(publisher.acked) >= 200, 30, "publishing")
            started = time.monotonic()
            steps = rolling.rolling_restart(session, control)
            acked_after = len(publisher.acked) + 100
            wait_for(lambda: len(publisher.acked) >= acked_after, 30, "publishing after")
        finally:
            publisher.stop()
        acked = publisher.acked
    assert sorted(step.alias for step in steps) == sorted(deployment.aliases)
    assert publisher.failures == []
    gap_s = publisher.gaps_since(started)
    log.info("docker rolling restart longest ack gap=%.3fs", gap_s)
    print(f"\ndocker rolling restart: longest ack gap {gap_s:.3f} s")
    for alias in deployment.aliases:
        item = tool.container(docker_engine, deployment, alias)
        wait_for(lambda item=item: _health(item) == "healthy", 60, f"{alias} healthy")
    assert_every_ack_once_on_every_replica(deployment, table, acked)


def _health(item: Any) -> str:
    item.reload()
    return str((item.attrs["State"].get("Health") or {}).get("Status", ""))
