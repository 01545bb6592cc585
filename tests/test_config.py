"""cluster.cfg parsing: the shipped file, round trips, and one test per refusal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hastream.errors import ConfigError, UnknownGroup
from hastream.model import NodeAddress
from raftstore import config
from raftstore.config import ClusterConfig, NodeConfig, RaftGroupConfig

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[1]
CFG_PATH = Path("/etc/hastream/cluster.cfg")

BASE = """\
streamingHAMode=raft
streamingRaftGroups=2:n1:n2:n3
streamingRaftSecret=s3cret
persistenceDir=/srv/<ALIAS>/data
streamingHADir=/srv/<ALIAS>/raft
n1.host=127.0.0.1
n1.port=8901
n1.raftPorts=2:9201
n2.host=127.0.0.1
n2.port=8902
n2.raftPorts=2:9202
n3.host=127.0.0.1
n3.port=8903
n3.raftPorts=2:9203
"""


def cfg(*, drop: tuple[str, ...] = (), **values: str) -> str:
    """BASE with keys replaced (`n1__port="1"` means `n1.port=1`), added, or dropped."""
    lines = {}
    for line in BASE.splitlines():
        key, _, value = line.partition("=")
        lines[key] = value
    for key, value in values.items():
        lines[key.replace("__", ".")] = value
    for key in drop:
        del lines[key]
    return "".join(f"{key}={value}\n" for key, value in lines.items())


def refused(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        config.parse(text, CFG_PATH)
    assert caught.value.path == str(CFG_PATH)
    return caught.value


# --- accepted configs --------------------------------------------------------------------


def test_shipped_cluster_cfg_loads() -> None:
    cluster = config.load(REPO_ROOT / "cluster.cfg")
    assert cluster.ha_mode == "raft"
    assert [group.group_id for group in cluster.groups] == [2, 3]
    assert [node.alias for node in cluster.nodes] == ["node1", "node2", "node3"]
    assert [node.port for node in cluster.nodes] == [8901, 8902, 8903]
    assert cluster.node("node2").raft_ports == ((2, 9202), (3, 9302))
    assert cluster.node("node3").persistence_dir == REPO_ROOT / "data/node3/persistence"
    assert cluster.node("node3").ha_dir == REPO_ROOT / "data/node3/raftlog"
    assert cluster.purge_interval_s == 300.0
    assert cluster.raft_secret


def test_base_config_parses_with_defaults() -> None:
    cluster = config.parse(BASE, CFG_PATH)
    assert cluster.path == CFG_PATH
    assert cluster.groups == (RaftGroupConfig(group_id=2, members=("n1", "n2", "n3")),)
    assert cluster.purge_interval_s == config.PURGE_INTERVAL_S_DEFAULT
    assert cluster.election_timeout_s == config.ELECTION_TIMEOUT_S_DEFAULT
    assert cluster.raft_secret == "s3cret"


def test_comments_blank_lines_and_whitespace_are_ignored() -> None:
    text = "# header\n\n   \n" + BASE.replace("n1.port=8901", "  n1.port   =   8901  \n# note")
    assert config.parse(text, CFG_PATH) == config.parse(BASE, CFG_PATH)


def test_value_keeps_hash_and_equals_signs() -> None:
    cluster = config.parse(cfg(streamingRaftSecret="a#b=c"), CFG_PATH)
    assert cluster.raft_secret == "a#b=c"


def test_alias_placeholder_is_substituted_per_node() -> None:
    cluster = config.parse(BASE, CFG_PATH)
    assert cluster.node("n2").persistence_dir == Path("/srv/n2/data")
    assert cluster.node("n2").ha_dir == Path("/srv/n2/raft")


def test_relative_dirs_resolve_against_the_cfg_directory() -> None:
    text = cfg(persistenceDir="data/<ALIAS>/p", streamingHADir="../logs/<ALIAS>")
    cluster = config.parse(text, CFG_PATH)
    assert cluster.node("n1").persistence_dir == Path("/etc/hastream/data/n1/p")
    assert cluster.node("n1").ha_dir == Path("/etc/logs/n1")


def test_relative_cfg_path_is_made_absolute(tmp_path: Path) -> None:
    """A node started in the cfg's directory with a relative `--config` path (a process of
    its own, started there, as an operator's shell would)."""
    (tmp_path / "c.cfg").write_text(cfg(persistenceDir="d/<ALIAS>"))
    script = (
        "from raftstore import config; cluster = config.load('c.cfg'); "
        "print(cluster.path); print(cluster.node('n1').persistence_dir)"
    )
    shown = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    assert shown == [str(tmp_path / "c.cfg"), str(tmp_path / "d" / "n1")]


def test_per_node_dir_overrides_the_global_one() -> None:
    cluster = config.parse(
        cfg(n2__persistenceDir="/fast/n2", n2__streamingHADir="/ssd/x"), CFG_PATH
    )
    assert cluster.node("n2").persistence_dir == Path("/fast/n2")
    assert cluster.node("n2").ha_dir == Path("/ssd/x")
    assert cluster.node("n1").persistence_dir == Path("/srv/n1/data")


def test_per_node_dirs_without_global_dirs() -> None:
    dirs = {f"n{i}__{key}": f"/d/{key}{i}" for i in (1, 2, 3) for key in ("persistenceDir",)}
    dirs |= {f"n{i}__streamingHADir": f"/d/ha{i}" for i in (1, 2, 3)}
    cluster = config.parse(cfg(drop=("persistenceDir", "streamingHADir"), **dirs), CFG_PATH)
    assert cluster.node("n3").persistence_dir == Path("/d/persistenceDir3")
    assert cluster.node("n3").ha_dir == Path("/d/ha3")


def test_raft_ports_are_sorted_by_group() -> None:
    text = cfg(
        streamingRaftGroups="3:n1:n2:n3,2:n1:n2:n3",
        n1__raftPorts="3:9301,2:9201",
        n2__raftPorts="2:9202,3:9302",
        n3__raftPorts="2:9203,3:9303",
    )
    cluster = config.parse(text, CFG_PATH)
    assert cluster.node("n1").raft_ports == ((2, 9201), (3, 9301))
    assert [group.group_id for group in cluster.groups] == [3, 2]


def test_accessors() -> None:
    cluster = config.parse(BASE, CFG_PATH)
    node = cluster.node("n1")
    assert node.address == NodeAddress(host="127.0.0.1", port=8901, alias="n1")
    assert node.advertised_address == node.address
    assert node.raft_port(2) == 9201
    assert cluster.group(2).members == ("n1", "n2", "n3")
    assert cluster.groups_of("n3") == cluster.groups
    assert cluster.raft_address("n2", 2) == "127.0.0.1:9202"
    assert cluster.raft_peers("n2", 2) == ("127.0.0.1:9201", "127.0.0.1:9203")


def test_advertised_address_defaults_to_host_and_port() -> None:
    node = config.parse(BASE, CFG_PATH).node("n2")
    assert (node.advertised_host, node.advertised_port) == ("127.0.0.1", 8902)


def test_advertised_host_and_port_are_what_clients_are_told() -> None:
    text = cfg(n2__advertisedHost="db2.example.com", n2__advertisedPort="18902")
    node = config.parse(text, CFG_PATH).node("n2")
    assert node.advertised_address == NodeAddress(host="db2.example.com", port=18902, alias="n2")
    # The node still binds, and its peers still dial, the cfg host and port.
    assert node.address == NodeAddress(host="127.0.0.1", port=8902, alias="n2")
    assert config.parse(text, CFG_PATH).raft_address("n2", 2) == "127.0.0.1:9202"


def test_advertised_host_alone_keeps_the_port() -> None:
    node = config.parse(cfg(n3__advertisedHost="10.1.2.3"), CFG_PATH).node("n3")
    assert node.advertised_address == NodeAddress(host="10.1.2.3", port=8903, alias="n3")


def test_advertised_port_alone_keeps_the_host() -> None:
    node = config.parse(cfg(n3__advertisedPort="443"), CFG_PATH).node("n3")
    assert node.advertised_address == NodeAddress(host="127.0.0.1", port=443, alias="n3")


def test_advertised_port_may_equal_a_bound_port_of_another_node() -> None:
    # A published port lives on another machine (or NAT): it cannot clash with a bind.
    text = cfg(n1__advertisedHost="gateway", n1__advertisedPort="8902")
    assert config.parse(text, CFG_PATH).node("n1").advertised_port == 8902


def test_unknown_node_lookup_raises_config_error() -> None:
    with pytest.raises(ConfigError) as caught:
        config.parse(BASE, CFG_PATH).node("n9")
    assert (caught.value.key, caught.value.value) == ("node", "n9")


def test_unknown_group_lookup_raises_unknown_group() -> None:
    with pytest.raises(UnknownGroup):
        config.parse(BASE, CFG_PATH).group(7)


def test_secret_is_not_in_repr() -> None:
    assert "s3cret" not in repr(config.parse(BASE, CFG_PATH))


# --- round trip --------------------------------------------------------------------------


def test_render_round_trips_the_shipped_cfg() -> None:
    cluster = config.load(REPO_ROOT / "cluster.cfg")
    assert config.parse(config.render(cluster), cluster.path) == cluster


def test_render_round_trips_advertised_addresses() -> None:
    text = cfg(n1__advertisedHost="public", n1__advertisedPort="18901", n2__advertisedPort="1")
    cluster = config.parse(text, CFG_PATH)
    rendered = config.render(cluster)
    assert "n1.advertisedHost=public" in rendered
    assert "n2.advertisedPort=1" in rendered
    assert "n2.advertisedHost" not in rendered  # defaults are not written out
    assert "n3.advertised" not in rendered
    assert config.parse(rendered, CFG_PATH) == cluster


def test_render_round_trips_per_node_dirs() -> None:
    text = cfg(n2__persistenceDir="/elsewhere/p", n3__streamingHADir="/ssd/raft3")
    cluster = config.parse(text, CFG_PATH)
    rendered = config.render(cluster)
    assert "n2.persistenceDir=/elsewhere/p" in rendered
    assert config.parse(rendered, CFG_PATH) == cluster


ALIASES = st.from_regex(r"[A-Za-z][A-Za-z0-9_-]{0,8}", fullmatch=True)


@st.composite
def clusters(draw: st.DrawFn) -> ClusterConfig:
    aliases = draw(st.lists(ALIASES, min_size=3, max_size=6, unique=True))
    group_ids = draw(st.lists(st.integers(2, 2**31 - 1), min_size=1, max_size=3, unique=True))
    groups = []
    for group_id in group_ids:
        members = draw(st.permutations(aliases).map(lambda a: a[: draw(st.integers(3, len(a)))]))
        preferred = draw(st.none() | st.sampled_from(members))
        groups.append(
            RaftGroupConfig(group_id=group_id, members=tuple(members), preferred_leader=preferred)
        )
    # Every node must be in a group: the first group takes everyone left over.
    covered = {alias for group in groups for alias in group.members}
    first = groups[0]
    left_over = tuple(alias for alias in aliases if alias not in covered)
    groups[0] = RaftGroupConfig(
        group_id=first.group_id,
        members=first.members + left_over,
        preferred_leader=first.preferred_leader,
    )
    hosts = draw(st.lists(st.sampled_from(["127.0.0.1", "10.0.0.2", "db-host"]), min_size=1))
    ports = iter(draw(st.lists(st.integers(1, 65535), min_size=40, max_size=40, unique=True)))
    per_node_dirs = draw(st.booleans())
    nodes = []
    for index, alias in enumerate(aliases):
        member_of = sorted(group.group_id for group in groups if alias in group.members)
        base = f"/x{index}" if per_node_dirs else f"/srv/{alias}"
        host, port = hosts[index % len(hosts)], next(ports)
        # Advertised ports come from the same unique pool: no two nodes advertise one address.
        advertised_port = next(ports) if draw(st.booleans()) else port
        nodes.append(
            NodeConfig(
                alias=alias,
                host=host,
                port=port,
                raft_ports=tuple((group_id, next(ports)) for group_id in member_of),
                advertised_host=draw(st.sampled_from([host, "127.0.0.1", "public.example"])),
                advertised_port=advertised_port,
                persistence_dir=Path(base, "data"),
                ha_dir=Path(base, "raft"),
                metrics_port=next(ports) if draw(st.booleans()) else None,
                publish_port=next(ports) if draw(st.booleans()) else None,
            )
        )
    return ClusterConfig(
        path=CFG_PATH,
        ha_mode="raft",
        groups=tuple(groups),
        nodes=tuple(nodes),
        purge_interval_s=draw(st.floats(min_value=0.001, max_value=1e9)),
        raft_secret=draw(
            st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=16)
        ),
        election_timeout_s=draw(st.floats(min_value=0.2, max_value=60.0)),
    )


@pytest.mark.property
@settings(max_examples=200, deadline=None)
@given(clusters())
def test_render_then_parse_is_identity(cluster: ClusterConfig) -> None:
    assert config.parse(config.render(cluster), CFG_PATH) == cluster


# --- refusals: each names the key and the value ------------------------------------------


def test_load_missing_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.cfg"
    with pytest.raises(ConfigError) as caught:
        config.load(missing)
    assert (caught.value.key, caught.value.value) == ("file", str(missing))


def test_malformed_line_is_refused() -> None:
    error = refused(BASE + "justakey\n")
    assert (error.key, error.value) == ("line 15", "justakey")


def test_empty_key_is_refused() -> None:
    error = refused(BASE + "=value\n")
    assert error.value == "=value"


def test_unknown_global_key_is_refused() -> None:
    error = refused(BASE + "maxMemSize=8\n")
    assert (error.key, error.value) == ("maxMemSize", "8")
    assert "unknown key" in error.reason


def test_wrongly_cased_key_suggests_the_right_one() -> None:
    error = refused(BASE + "streaminghadir=/x\n")
    assert error.key == "streaminghadir"
    assert "streamingHADir" in error.reason


def test_unknown_node_field_is_refused() -> None:
    error = refused(BASE + "n1.colour=red\n")
    assert (error.key, error.value) == ("n1.colour", "red")


def test_bad_alias_is_refused() -> None:
    error = refused(BASE + "9x.port=1\n")
    assert (error.key, error.value) == ("9x.port", "1")


def test_duplicate_key_is_refused() -> None:
    error = refused(BASE + "n2.port=8999\n")
    assert (error.key, error.value) == ("n2.port", "8999")
    assert "duplicate" in error.reason


@pytest.mark.parametrize("mode", ["", "none", "Raft", "paxos"])
def test_bad_mode_is_refused(mode: str) -> None:
    error = refused(cfg(streamingHAMode=mode))
    assert (error.key, error.value) == ("streamingHAMode", mode)


def test_missing_mode_is_refused() -> None:
    error = refused(cfg(drop=("streamingHAMode",)))
    assert error.key == "streamingHAMode"


def test_missing_groups_is_refused() -> None:
    error = refused(cfg(drop=("streamingRaftGroups",)))
    assert error.key == "streamingRaftGroups"


@pytest.mark.parametrize(
    ("groups", "reason"),
    [
        ("2:n1:n2", "at least 3"),
        ("2:n1:n2:n2", "more than once"),
        ("x:n1:n2:n3", "not a decimal integer"),
        ("-2:n1:n2:n3", "not a decimal integer"),
        ("1:n1:n2:n3", ">= 2"),
        ("0:n1:n2:n3", ">= 2"),
        ("2:n1:n2:n3,2:n1:n2:n3", "duplicate group id"),
        ("2:n1:n2:n3,", "empty group"),
        ("2:n1:n2:n3:n4", "not declared"),
        ("2:n1:n2:n 3", "bad node alias"),
    ],
)
def test_bad_group_is_refused(groups: str, reason: str) -> None:
    error = refused(cfg(streamingRaftGroups=groups))
    assert (error.key, error.value) == ("streamingRaftGroups", groups)
    assert reason in error.reason


def test_declared_node_in_no_group_is_refused() -> None:
    error = refused(BASE + "n4.host=127.0.0.1\nn4.port=8904\n")
    assert (error.key, error.value) == ("n4.port", "8904")
    assert "no raft group" in error.reason


def test_node_fields_without_port_are_refused() -> None:
    error = refused(BASE + "n4.host=127.0.0.1\n")
    assert error.key == "n4.port"
    assert "n4.host=127.0.0.1" in error.reason


@pytest.mark.parametrize("field", ["host", "raftPorts"])
def test_missing_node_field_is_refused(field: str) -> None:
    error = refused(cfg(drop=(f"n2.{field}",)))
    assert (error.key, error.value) == (f"n2.{field}", "")


@pytest.mark.parametrize("host", ["::1", "a b", "host:1"])
def test_bad_host_is_refused(host: str) -> None:
    error = refused(cfg(n1__host=host))
    assert (error.key, error.value) == ("n1.host", host)


@pytest.mark.parametrize("host", ["", "::1", "a b", "host:1", "h/x", "é.example"])
def test_bad_advertised_host_is_refused(host: str) -> None:
    error = refused(cfg(n2__advertisedHost=host))
    assert (error.key, error.value) == ("n2.advertisedHost", host)


@pytest.mark.parametrize("port", ["", "0", "65536", "-1", "+80", "80.0", "eighty", "8_000"])
def test_bad_advertised_port_is_refused(port: str) -> None:
    error = refused(cfg(n2__advertisedPort=port))
    assert (error.key, error.value) == ("n2.advertisedPort", port)


def test_advertised_key_of_an_undeclared_node_is_refused() -> None:
    error = refused(BASE + "n9.advertisedHost=x\n")
    assert error.key == "n9.port"
    assert "n9.advertisedHost=x" in error.reason


def test_wrongly_cased_advertised_key_suggests_the_right_one() -> None:
    error = refused(BASE + "n1.advertisedhost=x\n")
    assert (error.key, error.value) == ("n1.advertisedhost", "x")
    assert "n1.advertisedHost" in error.reason


def test_two_nodes_advertising_one_address_are_refused() -> None:
    text = cfg(
        n1__advertisedHost="gw",
        n1__advertisedPort="7000",
        n3__advertisedHost="GW",
        n3__advertisedPort="7000",
    )
    error = refused(text)
    assert (error.key, error.value) == ("n3.advertisedPort", "7000")
    assert "also advertised by n1 (n1.advertisedPort=7000)" in error.reason


def test_advertising_another_nodes_default_address_is_refused() -> None:
    error = refused(cfg(n3__advertisedPort="8901"))
    assert (error.key, error.value) == ("n3.advertisedPort", "8901")
    assert "127.0.0.1:8901 is also advertised by n1 (n1.port=8901)" in error.reason


@pytest.mark.parametrize("port", ["0", "65536", "-1", "+80", "80.0", "eighty", "8_000"])
def test_bad_client_port_is_refused(port: str) -> None:
    error = refused(cfg(n1__port=port))
    assert (error.key, error.value) == ("n1.port", port)


@pytest.mark.parametrize("raft_ports", ["2:0", "2:70000", "2", "2:x", "x:9201"])
def test_bad_raft_port_is_refused(raft_ports: str) -> None:
    error = refused(cfg(n1__raftPorts=raft_ports))
    assert (error.key, error.value) == ("n1.raftPorts", raft_ports)


def test_raft_ports_missing_a_group_of_the_node_is_refused() -> None:
    text = cfg(
        streamingRaftGroups="2:n1:n2:n3,3:n1:n2:n3",
        n2__raftPorts="2:9202,3:9302",
        n3__raftPorts="2:9203,3:9303",
    )
    error = refused(text)
    assert (error.key, error.value) == ("n1.raftPorts", "2:9201")
    assert "group(s) 3" in error.reason


def test_raft_ports_naming_a_foreign_group_is_refused() -> None:
    error = refused(cfg(n1__raftPorts="2:9201,3:9301"))
    assert (error.key, error.value) == ("n1.raftPorts", "2:9201,3:9301")
    assert "not a member of group 3" in error.reason


def test_raft_ports_listing_a_group_twice_is_refused() -> None:
    error = refused(cfg(n1__raftPorts="2:9201,2:9301"))
    assert "more than once" in error.reason


def test_duplicate_client_ports_on_one_host_are_refused() -> None:
    error = refused(cfg(n2__port="8901"))
    assert (error.key, error.value) == ("n2.port", "8901")
    assert "n1.port" in error.reason


def test_client_port_equal_to_a_raft_port_on_one_host_is_refused() -> None:
    error = refused(cfg(n3__port="9201"))
    assert (error.key, error.value) == ("n3.port", "9201")
    assert "n1.raftPorts" in error.reason


def test_same_ports_on_different_hosts_are_accepted() -> None:
    text = cfg(
        n2__host="10.0.0.2", n2__port="8901", n2__raftPorts="2:9201", streamingRaftSecret="x" * 16
    )
    assert config.parse(text, CFG_PATH).node("n2").port == 8901


def test_shared_persistence_dir_is_refused() -> None:
    error = refused(cfg(persistenceDir="/srv/shared"))
    assert (error.key, error.value) == ("n2.persistenceDir", "/srv/shared")
    assert "n1.persistenceDir" in error.reason


def test_shared_ha_dir_after_resolution_is_refused() -> None:
    error = refused(cfg(n1__streamingHADir="/srv/x/../n2/raft"))
    assert (error.key, error.value) == ("n2.streamingHADir", "/srv/n2/raft")


def test_persistence_dir_equal_to_another_nodes_ha_dir_is_refused() -> None:
    error = refused(cfg(n2__persistenceDir="/srv/n1/raft"))
    assert (error.key, error.value) == ("n2.persistenceDir", "/srv/n1/raft")
    assert "n1.streamingHADir" in error.reason


def test_persistence_dir_equal_to_own_ha_dir_is_refused() -> None:
    error = refused(cfg(streamingHADir="/srv/<ALIAS>/data"))
    assert (error.key, error.value) == ("n1.streamingHADir", "/srv/n1/data")


def test_nested_dirs_are_refused() -> None:
    error = refused(cfg(streamingHADir="/srv/<ALIAS>/data/raft"))
    assert (error.key, error.value) == ("n1.streamingHADir", "/srv/n1/data/raft")
    assert "nested" in error.reason


@pytest.mark.parametrize("key", ["persistenceDir", "streamingHADir"])
def test_missing_dir_is_refused(key: str) -> None:
    error = refused(cfg(drop=(key,)))
    assert (error.key, error.value) == (f"n1.{key}", "")


def test_empty_per_node_dir_is_refused() -> None:
    error = refused(cfg(n3__streamingHADir=""))
    assert (error.key, error.value) == ("n3.streamingHADir", "")


@pytest.mark.parametrize("secret", [None, ""])
def test_missing_secret_is_refused(secret: str | None) -> None:
    text = cfg(drop=("streamingRaftSecret",)) if secret is None else cfg(streamingRaftSecret="")
    error = refused(text)
    assert (error.key, error.value) == ("streamingRaftSecret", "")


@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan", "inf", ""])
def test_bad_purge_interval_is_refused(value: str) -> None:
    error = refused(cfg(streamingHAPurgeInterval=value))
    assert (error.key, error.value) == ("streamingHAPurgeInterval", value)


@pytest.mark.parametrize("value", ["0.1", "61", "-1", "fast", "nan"])
def test_bad_election_timeout_is_refused(value: str) -> None:
    error = refused(cfg(streamingRaftElectionTimeout=value))
    assert (error.key, error.value) == ("streamingRaftElectionTimeout", value)


def test_election_timeout_bounds_are_inclusive() -> None:
    assert config.parse(cfg(streamingRaftElectionTimeout="0.2"), CFG_PATH).election_timeout_s == 0.2
    assert config.parse(cfg(streamingRaftElectionTimeout="60"), CFG_PATH).election_timeout_s == 60


def test_error_message_names_file_key_and_value() -> None:
    error = refused(cfg(n1__port="0"))
    assert str(CFG_PATH) in str(error)
    assert "n1.port" in str(error)
    assert "'0'" in str(error)


# --- metrics port and preferred leaders ----------------------------------------------------


def test_metrics_port_is_optional_per_node() -> None:
    cluster = config.parse(cfg(n1__metricsPort="9101"), CFG_PATH)
    assert cluster.node("n1").metrics_port == 9101
    assert cluster.node("n2").metrics_port is None


def test_metrics_port_equal_to_a_client_port_on_one_host_is_refused() -> None:
    error = refused(cfg(n3__metricsPort="8901"))
    assert (error.key, error.value) == ("n3.metricsPort", "8901")
    assert "n1.port" in error.reason


@pytest.mark.parametrize("port", ["0", "65536", "x", ""])
def test_bad_metrics_port_is_refused(port: str) -> None:
    error = refused(cfg(n2__metricsPort=port))
    assert error.key == "n2.metricsPort"


def test_publish_port_is_optional_per_node_and_renders_back() -> None:
    cluster = config.parse(cfg(n1__publishPort="8911", n2__publishPort="8912"), CFG_PATH)
    assert [node.publish_port for node in cluster.nodes] == [8911, 8912, None]
    assert config.parse(config.render(cluster), CFG_PATH) == cluster


def test_publish_port_equal_to_another_port_on_one_host_is_refused() -> None:
    error = refused(cfg(n1__metricsPort="9101", n2__publishPort="9101"))
    assert (error.key, error.value) == ("n2.publishPort", "9101")
    assert "n1.metricsPort" in error.reason


@pytest.mark.parametrize("port", ["0", "65536", "x", ""])
def test_bad_publish_port_is_refused(port: str) -> None:
    error = refused(cfg(n3__publishPort=port))
    assert error.key == "n3.publishPort"


def test_preferred_leaders_name_a_member_per_group() -> None:
    text = cfg(
        streamingRaftGroups="2:n1:n2:n3,3:n1:n2:n3",
        n1__raftPorts="2:9201,3:9301",
        n2__raftPorts="2:9202,3:9302",
        n3__raftPorts="2:9203,3:9303",
        streamingPreferredLeaders="2:n2, 3:n3",
    )
    cluster = config.parse(text, CFG_PATH)
    assert [g.preferred_leader for g in cluster.groups] == ["n2", "n3"]
    assert config.parse(config.render(cluster), CFG_PATH) == cluster


def test_no_preferred_leader_by_default() -> None:
    assert config.parse(BASE, CFG_PATH).group(2).preferred_leader is None


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("2:n9", "not a member"),
        ("5:n1", "not in streamingRaftGroups"),
        ("2:n1,2:n2", "more than once"),
        ("2", "not groupId:alias"),
        ("x:n1", "group id"),
    ],
)
def test_bad_preferred_leaders_are_refused(value: str, reason: str) -> None:
    error = refused(cfg(streamingPreferredLeaders=value))
    assert error.key == "streamingPreferredLeaders"
    assert reason in error.reason


@pytest.mark.parametrize("host", ["10.0.0.5", "db1.example.com", "0.0.0.0"])
def test_a_short_secret_is_refused_when_a_node_is_reachable_from_elsewhere(host: str) -> None:
    text = cfg(streamingRaftSecret="tiny").replace("n2.host=127.0.0.1", f"n2.host={host}")
    with pytest.raises(ConfigError, match="shorter than 16 characters while n2") as raised:
        config.parse(text, CFG_PATH)
    assert raised.value.key == "streamingRaftSecret"
    assert "tiny" not in str(raised.value)  # the secret is never echoed
    long_secret = cfg(streamingRaftSecret="x" * 16).replace("n2.host=127.0.0.1", f"n2.host={host}")
    assert config.parse(long_secret, CFG_PATH).node("n2").host == host


# --- authentication ----------------------------------------------------------------------


def test_logins_are_off_on_loopback_and_on_beyond_it_by_default() -> None:
    assert not config.parse(cfg(), CFG_PATH).authentication
    exposed = cfg(n1__host="10.0.0.5", streamingRaftSecret="x" * 24)
    assert config.parse(exposed, CFG_PATH).authentication
    explicit = cfg(n1__host="10.0.0.5", streamingRaftSecret="x" * 24, authentication="off")
    assert not config.parse(explicit, CFG_PATH).authentication
    assert config.parse(cfg(authentication="on"), CFG_PATH).authentication


def test_authentication_takes_on_or_off_only() -> None:
    error = refused(cfg(authentication="yes"))
    assert (error.key, error.value) == ("authentication", "yes")


def test_admin_password_file_resolves_against_the_cfg_directory() -> None:
    parsed = config.parse(cfg(adminPasswordFile="secrets/admin.password"), CFG_PATH)
    assert parsed.admin_password_file == CFG_PATH.parent / "secrets/admin.password"
    assert config.parse(config.render(parsed), CFG_PATH) == parsed
    assert refused(cfg(adminPasswordFile="")).key == "adminPasswordFile"
