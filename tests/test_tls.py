"""TLS on the client port: the config keys, and a real cluster with mutual TLS (its nodes
calling each other over TLS for a repair) that refuses plaintext, untrusted and
certificate-less clients with an error that says why."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from api_clients import aio, connect
from api_clients.aio_port import AioPublishPorts
from api_clients.connection import Session
from api_clients.publish_port import PortRefused, PublishPorts, client_context
from api_clients.publisher import Publisher
from api_clients.transport import TransportError
from deploy.dev_tls import DevCA
from hastream.errors import ConfigError, InvalidArgument
from hastream.tls import ClientTls
from proto import hastream_pb2 as pb
from raftstore import config
from tests.harness import (
    AckedPublisher,
    LocalCluster,
    ManualClock,
    assert_replicas_hold_exactly,
    restart_with_a_damaged_record,
    wait_damage_repaired,
    wait_durable_checkpoint_of_what_is_applied,
    wait_until,
)
from tests.ops_helpers import run_cli, run_cli_raw

SCHEMA = pa.schema([("id", pa.int64()), ("ts", pa.timestamp("ms")), ("sym", pa.string())])

BASE = """streamingHAMode=raft
streamingRaftGroups=2:node1:node2:node3
streamingRaftSecret=s
persistenceDir=data/<ALIAS>/persistence
streamingHADir=data/<ALIAS>/raftlog
node1.host=127.0.0.1
node1.port=8901
node1.raftPorts=2:9201
node2.host=127.0.0.1
node2.port=8902
node2.raftPorts=2:9202
node3.host=127.0.0.1
node3.port=8903
node3.raftPorts=2:9203
"""


@pytest.mark.unit
def test_tls_keys_are_global_or_per_node_and_render_back(tmp_path: Path) -> None:
    text = BASE + (
        "tlsCertFile=tls/<ALIAS>.pem\ntlsKeyFile=tls/<ALIAS>.key\ntlsCAFile=tls/ca.pem\n"
        "node3.tlsCertFile=/etc/other/node3.pem\ntlsClientAuth=require\n"
    )
    cluster = config.parse(text, tmp_path / "cluster.cfg")
    node1, node3 = cluster.node("node1").tls, cluster.node("node3").tls
    assert node1 is not None
    assert node3 is not None
    assert node1.cert_file == tmp_path / "tls" / "node1.pem"
    assert node1.ca_file == tmp_path / "tls" / "ca.pem"
    assert node3.cert_file == Path("/etc/other/node3.pem")
    assert node1.client_auth
    assert config.parse(config.render(cluster), tmp_path / "cluster.cfg") == cluster
    assert config.parse(BASE, tmp_path / "c.cfg").node("node1").tls is None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("extra", "key", "reason"),
    [
        ("tlsCertFile=a.pem\ntlsKeyFile=a.key\n", "node1.tlsCAFile", "missing"),
        (
            "node1.tlsCertFile=a\nnode1.tlsKeyFile=b\nnode1.tlsCAFile=c\n",
            "node2.tlsCertFile",
            "some nodes only",
        ),
        ("tlsClientAuth=require\n", "tlsClientAuth", "needs TLS"),
        (
            "tlsCertFile=a\ntlsKeyFile=b\ntlsCAFile=c\ntlsClientAuth=optional\n",
            "tlsClientAuth",
            "none or require",
        ),
    ],
)
def test_incomplete_tls_settings_are_refused(
    tmp_path: Path, extra: str, key: str, reason: str
) -> None:
    with pytest.raises(ConfigError, match=reason) as raised:
        config.parse(BASE + extra, tmp_path / "cluster.cfg")
    assert raised.value.key == key


@pytest.mark.unit
def test_client_tls_files_are_checked_when_the_session_is_made(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="caFile"):
        connect("127.0.0.1", 1, caFile=str(tmp_path / "missing.pem"))
    (tmp_path / "not.pem").write_text("hello")
    with pytest.raises(InvalidArgument, match="no PEM block"):
        connect("127.0.0.1", 1, caFile=str(tmp_path / "not.pem"))
    with pytest.raises(InvalidArgument, match="both"):
        ClientTls(cert_file="a.pem")


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("tls") / "cluster", purge_interval_s=1.0)
    cluster.enable_tls(client_auth=True)
    yield cluster.start()
    cluster.stop()


def _session(cluster: LocalCluster, tls: ClientTls | None) -> Session:
    sites = [node.site for node in cluster.nodes.values()]
    return Session(sites, tls=tls, deadline_s=3.0, hedge_delay_s=None)


@pytest.mark.cluster
def test_a_client_with_the_cluster_certificate_publishes_and_reads(
    tls_cluster: LocalCluster,
) -> None:
    ca = DevCA(tls_cluster.root / "tls")
    app = ca.client("app")
    with Session([node.site for node in tls_cluster.nodes.values()], tls=app) as session:
        session.haStreamTable(2, SCHEMA, "tls_rows", 10_000)
        rows = pa.table(
            {"id": range(100), "ts": pa.array([0] * 100, pa.timestamp("ms")), "sym": ["a"] * 100}
        )
        publisher = Publisher(session, "tls_rows")
        assert publisher.append(rows).first_offset == 0
        assert session.read("tls_rows", 0).num_rows == 100
    # The same through DolphinDB-style connect(), with the files as keyword arguments.
    first = tls_cluster.nodes["node1"]
    with connect(
        first.host,
        first.port,
        highAvailabilitySites=[node.site for node in tls_cluster.nodes.values()],
        caFile=app.ca_file,
        certFile=app.cert_file,
        keyFile=app.key_file,
    ) as session:
        assert session.read("tls_rows", 0).num_rows == 100


def _answered_on_ports(cluster: LocalCluster) -> int:
    return sum(cluster.status(alias)["publish_port"]["answered"] for alias in cluster.alive())


@pytest.mark.cluster
def test_waited_publishes_take_the_publish_port_over_mutual_tls(
    tls_cluster: LocalCluster,
) -> None:
    """The publish port speaks the client port's TLS: the session's CA and certificate,
    the node's name checked; pipelines stay on gRPC's TLS."""
    app = DevCA(tls_cluster.root / "tls").client("app")
    before = _answered_on_ports(tls_cluster)
    with Session([node.site for node in tls_cluster.nodes.values()], tls=app) as session:
        session.haStreamTable(2, SCHEMA, "tls_port_rows", 10_000)
        publisher = Publisher(session, "tls_port_rows")
        for key in range(50):  # the first over gRPC, which names the port
            row = {"id": [key], "ts": pa.array([key], pa.timestamp("ms")), "sym": ["p"]}
            assert publisher.append(pa.table(row, schema=SCHEMA)).first_offset == key
        assert _answered_on_ports(tls_cluster) - before == 49
        pipelined = Publisher(session, "tls_port_rows", max_in_flight=8)
        row = {"id": [50], "ts": pa.array([50], pa.timestamp("ms")), "sym": ["q"]}
        assert pipelined.append_async(pa.table(row, schema=SCHEMA)).result(30).first_offset == 50
        pipelined.close()
        assert _answered_on_ports(tls_cluster) - before == 49  # the pipeline used gRPC
    assert_replicas_hold_exactly(tls_cluster, "tls_port_rows", list(range(51)))


@pytest.mark.cluster
def test_the_asyncio_client_publishes_over_the_port_with_mutual_tls(
    tls_cluster: LocalCluster,
) -> None:
    app = DevCA(tls_cluster.root / "tls").client("app")
    sites = [node.site for node in tls_cluster.nodes.values()]
    before = _answered_on_ports(tls_cluster)

    async def scenario() -> None:
        async with aio.AioSession(sites, tls=app) as session:
            await session.haStreamTable(2, SCHEMA, "tls_aio_rows", 10_000)
            for key in range(20):  # the first over gRPC, which names the port
                row = {"id": [key], "ts": pa.array([key], pa.timestamp("ms")), "sym": ["a"]}
                result = await session.append("tls_aio_rows", pa.table(row, schema=SCHEMA))
                assert result.first_offset == key

    asyncio.run(scenario())
    assert _answered_on_ports(tls_cluster) - before == 19
    assert_replicas_hold_exactly(tls_cluster, "tls_aio_rows", list(range(20)))


@pytest.mark.cluster
@pytest.mark.parametrize("client", ["plaintext", "no-client-cert", "foreign-ca"])
def test_the_publish_port_refuses_what_the_client_port_refuses(
    tls_cluster: LocalCluster, tmp_path: Path, client: str
) -> None:
    """A plaintext greeting, a client without a certificate, or one that does not trust
    the node's CA: no greeting comes back, and the session would publish over gRPC (which
    refuses it as test_wrong_clients_are_refused_with_the_cause shows)."""
    ca = DevCA(tls_cluster.root / "tls")
    tls = {
        "plaintext": None,
        "no-client-cert": ClientTls(ca_file=str(ca.ca_file)),
        "foreign-ca": DevCA.create(tmp_path / "foreign").client("intruder"),
    }[client]
    leader = tls_cluster.leader()
    node = tls_cluster.nodes[leader]
    site = node.site
    ports = (
        PublishPorts(ManualClock())
        if tls is None
        else PublishPorts(ManualClock(), tls=client_context(tls))
    )
    ports.learn(site, int(tls_cluster.status(leader)["publish_port"]["port"]))
    request = pb.PublishRequest(table="tls_rows", payload=b"")
    with pytest.raises(PortRefused):
        ports.publish(site, request, "", timeout_s=5)
    assert not ports.usable(site, 0)  # set aside: gRPC for a while
    # The asyncio client's ports alike.
    aio_ports = (
        AioPublishPorts(ManualClock())
        if tls is None
        else AioPublishPorts(ManualClock(), tls=client_context(tls))
    )
    aio_ports.learn(site, int(tls_cluster.status(leader)["publish_port"]["port"]))
    with pytest.raises(PortRefused):
        asyncio.run(aio_ports.publish(site, request, "", timeout_s=5))
    assert not aio_ports.usable(site, 0)


@pytest.mark.cluster
@pytest.mark.parametrize("client", ["plaintext", "no-client-cert", "foreign-cert", "foreign-ca"])
def test_wrong_clients_are_refused_with_the_cause(
    tls_cluster: LocalCluster, tmp_path: Path, client: str
) -> None:
    ca = DevCA(tls_cluster.root / "tls")
    foreign = DevCA.create(tmp_path / "foreign")
    tls = {
        "plaintext": None,
        "no-client-cert": ClientTls(ca_file=str(ca.ca_file)),
        "foreign-cert": ClientTls(
            ca_file=str(ca.ca_file),
            cert_file=str(foreign.issue("intruder").cert_file),
            key_file=str(foreign.issue("intruder").key_file),
        ),
        "foreign-ca": foreign.client("intruder"),
    }[client]
    with _session(tls_cluster, tls) as session, pytest.raises(TransportError) as raised:
        session.getStreamingRaftGroups()
    assert "TLS" in str(raised.value) or "tls" in str(raised.value), str(raised.value)


@pytest.mark.cluster
def test_a_damaged_replica_repairs_from_its_peers_over_mutual_tls(
    tls_cluster: LocalCluster,
) -> None:
    """FetchRecords, a node calling its peer's client port, runs over the same TLS."""
    cluster = tls_cluster
    cluster.create_table("repaired", SCHEMA)
    publisher = AckedPublisher(cluster, "repaired", SCHEMA)
    for first_key in range(0, 2000, 500):
        publisher.publish(first_key, 500)
    leader = cluster.leader()
    follower = next(alias for alias in cluster.alive() if alias != leader)
    wait_until(
        lambda: cluster.row_count(follower, "repaired") == 2000, timeout_s=60, message="rows"
    )
    # A durable checkpoint after the rows: the restart cannot replay them from the log, it
    # must fetch them from a peer.
    wait_durable_checkpoint_of_what_is_applied(cluster, follower)
    restart_with_a_damaged_record(cluster, follower, "repaired")
    wait_damage_repaired(cluster, follower)
    assert "repair fetched" in cluster.log_tail(follower, lines=400)
    assert_replicas_hold_exactly(cluster, "repaired", publisher.acked)


@pytest.mark.cluster
def test_the_hastream_command_takes_the_tls_options(tls_cluster: LocalCluster) -> None:
    app = DevCA(tls_cluster.root / "tls").client("operator")
    sites = ",".join(node.site for node in tls_cluster.nodes.values())
    files = ("--ca-file", str(app.ca_file), "--cert-file", str(app.cert_file))
    groups = run_cli("groups", "--sites", sites, *files, "--key-file", str(app.key_file))
    assert [group["id"] for group in groups] == [2]
    refused = run_cli_raw("groups", "--sites", sites, "--timeout", "3", "--json")
    assert refused.returncode == 1
    assert "TLS" in refused.stdout, refused.stdout
