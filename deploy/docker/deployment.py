"""A Docker deployment's plan: names, static addresses, ports, and its cluster.cfg.

Pure apart from picking free ports and a free subnet (which ask the machine and the
engine) and from `save`/`load`, which keep the plan in `<state-dir>/<name>/`:
`deployment.json` (what the tool needs to find every object again) and `cluster.cfg`
(what every container mounts; it holds the Raft secret, so the directory is private).
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from deploy import ports
from deploy.dev_tls import DevCA
from deploy.docker.images import NODE_TAG_DEFAULT, REPO
from deploy.local_security import ensure_password_file
from hastream.tls import ClientTls
from raftstore import config
from raftstore.access import BOOTSTRAP_ADMIN

NAME_DEFAULT: Final = "hastream"
STATE_DIR_DEFAULT: Final = REPO / ".run" / "docker"
CONFIG_IN_CONTAINER: Final = "/etc/hastream/cluster.cfg"
ADMIN_PASSWORD_IN_CONTAINER: Final = "/etc/hastream/admin.password"
TLS_IN_CONTAINER: Final = "/etc/hastream/tls"
DATA_ROOT_IN_CONTAINER: Final = "/var/lib/hastream"
# Client and publish ports are picked here: above the ephemeral range a new network
# namespace starts with (32768-60999), so inside a container nothing ever gets one by
# chance. Picked inside that range (bind to port 0), a node once found its own port taken
# in its fresh container ("bind: Address already in use") and exited before it was ready.
# What took it was not seen; both candidates pick from that range: an outgoing connection,
# and Docker's embedded DNS listener, which binds a random port in the container before a
# sysctl (ip_local_reserved_ports) could keep one free.
PORTS_PICKED: Final = range(61000, 65536)
RAFT_PORT_FIRST: Final = 9201  # Raft port of the first group, inside every container
HOST_INDEX_FIRST: Final = 11  # node1 is .11 on the deployment's subnet
SUBNET_POOL: Final = ipaddress.IPv4Network("10.213.0.0/16")  # /24s handed to deployments
SUBNET_PREFIX: Final = 24


class DeployError(Exception):
    """The deployment did not reach the state asked for (a timeout, a missing node)."""


class NodeExited(DeployError):
    """A node's container stopped before it was ready. `log_tail` holds its last lines."""

    def __init__(self, alias: str, container: str, log_tail: str) -> None:
        self.alias = alias
        self.log_tail = log_tail
        super().__init__(f"node {alias} (container {container}) exited before it was ready")


# ---------------------------------------------------------------------------------------
# The plan: names, ports, addresses (pure apart from picking free ports and a subnet)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    alias: str
    container: str  # also the node's host in cluster.cfg (what its peers dial)
    ip: str  # static address on the cluster network
    port: int  # client gRPC port: the same number in the container and on the host
    raft_ports: tuple[tuple[int, int], ...]  # (group id, port) inside the container
    # The publish port (raftstore/publish_port.py), published with the same number too:
    # a client dials it on the host of the site it uses. None: not served (a deployment
    # planned before the tool served one keeps its plan).
    publish_port: int | None = None

    @property
    def listen_ports(self) -> tuple[int, ...]:
        """Every port the node binds in its container: client, publish and Raft ports."""
        published = (self.port,) if self.publish_port is None else (self.port, self.publish_port)
        return (*published, *(port for _, port in self.raft_ports))


@dataclass(frozen=True, slots=True, kw_only=True)
class Deployment:
    name: str
    image: str
    subnet: str
    publish_host: str  # host address the client ports are published on
    group_ids: tuple[int, ...]
    election_timeout_s: float
    purge_interval_s: float
    nodes: tuple[NodeSpec, ...]
    state_dir: Path  # holds cluster.cfg and deployment.json

    @property
    def network(self) -> str:
        return f"{self.name}-net"

    @property
    def config_path(self) -> Path:
        return self.state_dir / "cluster.cfg"

    @property
    def aliases(self) -> list[str]:
        return [node.alias for node in self.nodes]

    def node(self, alias: str) -> NodeSpec:
        for node in self.nodes:
            if node.alias == alias:
                return node
        known = ", ".join(self.aliases)
        raise DeployError(f"deployment {self.name} has no node {alias!r} (nodes: {known})")

    def volume(self, alias: str, kind: str) -> str:
        assert kind in ("data", "raftlog"), kind
        return f"{self.name}-{alias}-{kind}"

    @property
    def client_host(self) -> str:
        """The host a client on this machine reaches the published ports on (also what
        the nodes advertise)."""
        return "127.0.0.1" if self.publish_host in ("0.0.0.0", "") else self.publish_host

    def site(self, alias: str) -> str:
        """`host:port` a client on this machine uses for node `alias`."""
        return f"{self.client_host}:{self.node(alias).port}"

    def alias_of(self, address: str) -> str | None:
        """The alias in a `host:port:alias` leader address, if it is one of ours."""
        alias = address.rsplit(":", 1)[-1] if address.count(":") == 2 else ""
        return alias if alias in self.aliases else None


def sites(deployment: Deployment) -> list[str]:
    """Every node's published client site, for `connect(..., highAvailabilitySites=...)`."""
    return [deployment.site(alias) for alias in deployment.aliases]


def free_ports(count: int, host: str = "127.0.0.1", exclude: Iterable[int] = ()) -> list[int]:
    """`count` distinct ports in PORTS_PICKED that are free on `host` now (bound together,
    then released)."""
    try:
        return ports.free_ports(count, host, band=PORTS_PICKED, exclude=exclude)
    except ports.PortsUnavailable as error:
        raise DeployError(str(error)) from error


def _host_routes() -> list[ipaddress.IPv4Network]:
    """IPv4 networks routed on this machine (Linux /proc/net/route), to avoid a subnet
    that would shadow one of them."""
    routes: list[ipaddress.IPv4Network] = []
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return routes
    for line in lines:
        fields = line.split()
        if len(fields) < 8:
            continue
        destination = int(fields[1], 16).to_bytes(4, "little")
        mask = int(fields[7], 16).to_bytes(4, "little")
        network = f"{ipaddress.IPv4Address(destination)}/{ipaddress.IPv4Address(mask)}"
        routes.append(ipaddress.IPv4Network(network, strict=False))
    return [route for route in routes if route.prefixlen > 0]


def _docker_subnets(client: Any) -> list[ipaddress.IPv4Network]:
    used = []
    for network in client.networks.list():
        for entry in (network.attrs.get("IPAM") or {}).get("Config") or []:
            subnet = entry.get("Subnet", "")
            if subnet and ":" not in subnet:
                used.append(ipaddress.IPv4Network(subnet, strict=False))
    return used


def pick_subnet(client: Any, name: str) -> str:
    """A /24 of SUBNET_POOL that no Docker network and no host route overlaps. The search
    starts at a place derived from `name`, so concurrent deployments rarely collide."""
    used = [*_docker_subnets(client), *_host_routes()]
    candidates = list(ipaddress.IPv4Network(SUBNET_POOL).subnets(new_prefix=SUBNET_PREFIX))
    start = zlib.crc32(name.encode()) % len(candidates)
    for index in range(len(candidates)):
        candidate = candidates[(start + index) % len(candidates)]
        if not any(candidate.overlaps(other) for other in used):
            return str(candidate)
    raise DeployError(f"no free /{SUBNET_PREFIX} left in {SUBNET_POOL}; pass --subnet")


def plan(
    client: Any,
    *,
    name: str = NAME_DEFAULT,
    state_root: Path = STATE_DIR_DEFAULT,
    image: str = NODE_TAG_DEFAULT,
    node_count: int = 3,
    group_ids: Sequence[int] = (2, 3),
    ports: Sequence[int] | None = None,
    publish_ports: Sequence[int] | None = None,
    publish_host: str = "127.0.0.1",
    subnet: str | None = None,
    election_timeout_s: float = 1.5,
    purge_interval_s: float = 300.0,
) -> Deployment:
    """A new deployment: names, static addresses, client and publish ports (free ones
    unless given)."""
    if node_count < 3:
        raise DeployError(f"a Raft group needs at least 3 nodes, got {node_count}")
    raft_ports = tuple(
        (group_id, RAFT_PORT_FIRST + index) for index, group_id in enumerate(group_ids)
    )
    reserved = {port for _, port in raft_ports}
    if ports is None:
        ports = free_ports(node_count, publish_host, exclude=reserved)
    if len(ports) != node_count or len(set(ports)) != node_count:
        raise DeployError(f"need {node_count} distinct client ports, got {list(ports)}")
    if reserved.intersection(ports):
        raise DeployError(f"client ports {sorted(reserved & set(ports))} are Raft ports")
    if publish_ports is None:
        publish_ports = free_ports(node_count, publish_host, exclude={*reserved, *ports})
    if len(publish_ports) != node_count or len(set(publish_ports)) != node_count:
        raise DeployError(f"need {node_count} distinct publish ports, got {list(publish_ports)}")
    taken = {*reserved, *ports}.intersection(publish_ports)
    if taken:
        raise DeployError(f"publish ports {sorted(taken)} are client or Raft ports")
    network = ipaddress.IPv4Network(subnet or pick_subnet(client, name))
    if network.num_addresses < HOST_INDEX_FIRST + node_count + 1:
        raise DeployError(f"subnet {network} is too small for {node_count} nodes")
    nodes = tuple(
        NodeSpec(
            alias=f"node{number}",
            container=f"{name}-node{number}",
            ip=str(network.network_address + HOST_INDEX_FIRST + number - 1),
            port=ports[number - 1],
            raft_ports=raft_ports,
            publish_port=publish_ports[number - 1],
        )
        for number in range(1, node_count + 1)
    )
    return Deployment(
        name=name,
        image=image,
        subnet=str(network),
        publish_host=publish_host,
        group_ids=tuple(group_ids),
        election_timeout_s=election_timeout_s,
        purge_interval_s=purge_interval_s,
        nodes=nodes,
        state_dir=state_root / name,
    )


def render_config(deployment: Deployment, secret: str) -> str:
    """The deployment's cluster.cfg (what every container mounts). A node binds and its
    peers dial `host` (the container name, on the cluster network); clients are told the
    published site (`advertisedHost:advertisedPort`), so they follow NotLeader hints and
    getStreamingLeader answers from outside Docker with no address mapping."""
    aliases = ":".join(deployment.aliases)
    lines = [
        f"# Generated by deploy.docker.tool for deployment {deployment.name}; do not edit:",
        "# `down --volumes` deletes it, `up` writes a new one.",
        "streamingHAMode=raft",
        "streamingRaftGroups=" + ",".join(f"{g}:{aliases}" for g in deployment.group_ids),
        f"persistenceDir={DATA_ROOT_IN_CONTAINER}/<ALIAS>/persistence",
        f"streamingHADir={DATA_ROOT_IN_CONTAINER}/<ALIAS>/raftlog",
        f"streamingHAPurgeInterval={deployment.purge_interval_s:g}",
        f"streamingRaftElectionTimeout={deployment.election_timeout_s:g}",
        f"streamingRaftSecret={secret}",
        *_authentication_lines(),
        # TLS on every client port (certificates generated by `save`, mounted read-only).
        f"tlsCertFile={TLS_IN_CONTAINER}/<ALIAS>.pem",
        f"tlsKeyFile={TLS_IN_CONTAINER}/<ALIAS>.key",
        f"tlsCAFile={TLS_IN_CONTAINER}/ca.pem",
    ]
    for node in deployment.nodes:
        raft = ",".join(f"{group}:{port}" for group, port in node.raft_ports)
        lines += [
            "",
            f"{node.alias}.host={node.container}",
            f"{node.alias}.port={node.port}",
            f"{node.alias}.raftPorts={raft}",
            f"{node.alias}.advertisedHost={deployment.client_host}",
            f"{node.alias}.advertisedPort={node.port}",  # published with the same number
        ]
        if node.publish_port is not None:  # published with the same number
            lines.append(f"{node.alias}.publishPort={node.publish_port}")
    return "\n".join(lines) + "\n"


def _authentication_lines() -> list[str]:
    """Logins on, the first admin's password generated by `save` into
    `<state dir>/admin.password` (mounted read-only into every container)."""
    return ["authentication=on", f"adminPasswordFile={ADMIN_PASSWORD_IN_CONTAINER}"]


def admin_password_path(deployment: Deployment) -> Path:
    return deployment.state_dir / "admin.password"


def tls_dir(deployment: Deployment) -> Path:
    """The development CA and the nodes' certificates (mounted at TLS_IN_CONTAINER)."""
    return deployment.state_dir / "tls"


def client_tls(deployment: Deployment) -> ClientTls:
    """What a client on this machine trusts: the deployment's development CA."""
    return ClientTls(ca_file=str(tls_dir(deployment) / "ca.pem"))


def tls_files(deployment: Deployment, alias: str) -> list[Path]:
    """What node `alias`'s container mounts, read-only, into TLS_IN_CONTAINER: the CA's
    certificate and the node's certificate and key (never the CA's key)."""
    directory = tls_dir(deployment)
    return [directory / "ca.pem", directory / f"{alias}.pem", directory / f"{alias}.key"]


def _ensure_tls(deployment: Deployment) -> None:
    """A development CA and one certificate per node naming its container (peers dial it)
    and the published host (clients dial it); kept across `up`s. A node's key is made
    readable by the container's unprivileged node user (the files are mounted one by one);
    on this machine they stay private in the 0700 state directory."""
    ca = DevCA.create(tls_dir(deployment))
    for node in deployment.nodes:
        if not (tls_dir(deployment) / f"{node.alias}.pem").exists():
            issued = ca.issue(node.alias, (node.container, deployment.client_host))
            issued.key_file.chmod(0o644)


def _ensure_admin_password(deployment: Deployment) -> None:
    """The first admin's password, generated once. Readable by the containers' node user
    (the file is mounted alone); private on this machine in the 0700 state directory."""
    ensure_password_file(admin_password_path(deployment), mode=0o644)


def admin_login(deployment: Deployment) -> tuple[str, str]:
    """(user, password) of the first admin, for this machine's tools and clients."""
    return BOOTSTRAP_ADMIN, admin_password_path(deployment).read_text().strip()


def save(deployment: Deployment) -> None:
    """Writes cluster.cfg (with a new random Raft secret) and deployment.json, and checks
    the cfg with the node's own parser. The directory is private: the cfg holds the secret."""
    deployment.state_dir.mkdir(parents=True, exist_ok=True)
    deployment.state_dir.chmod(0o700)
    _ensure_admin_password(deployment)
    _ensure_tls(deployment)
    deployment.config_path.write_text(render_config(deployment, secrets.token_urlsafe(24)))
    config.load(deployment.config_path)  # raises ConfigError naming file, key and value
    document = asdict(deployment)
    document["state_dir"] = str(deployment.state_dir)
    path = deployment.state_dir / "deployment.json"
    path.write_text(json.dumps(document, indent=2) + "\n")


def ensure_config(deployment: Deployment) -> None:
    """`save` the deployment if it has no cluster.cfg yet; else rewrite a cfg that
    `render_config` would now write differently (one from before the nodes advertised
    their published sites), keeping its Raft secret. Nodes read it when they next start."""
    if not deployment.config_path.is_file():
        save(deployment)
        return
    secret = config.load(deployment.config_path).raft_secret
    _ensure_admin_password(deployment)
    _ensure_tls(deployment)
    text = render_config(deployment, secret)
    if deployment.config_path.read_text() != text:
        # In place (same inode): running containers bind-mount this very file.
        deployment.config_path.write_text(text)
        config.load(deployment.config_path)


def load(name: str = NAME_DEFAULT, state_root: Path = STATE_DIR_DEFAULT) -> Deployment | None:
    """The saved deployment `name`, or None if there is none."""
    path = state_root / name / "deployment.json"
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    nodes = tuple(
        NodeSpec(
            alias=node["alias"],
            container=node["container"],
            ip=node["ip"],
            port=int(node["port"]),
            raft_ports=tuple((int(g), int(p)) for g, p in node["raft_ports"]),
            publish_port=_optional_int(node.get("publish_port")),
        )
        for node in document["nodes"]
    )
    return Deployment(
        name=document["name"],
        image=document["image"],
        subnet=document["subnet"],
        publish_host=document["publish_host"],
        group_ids=tuple(int(g) for g in document["group_ids"]),
        election_timeout_s=float(document["election_timeout_s"]),
        purge_interval_s=float(document["purge_interval_s"]),
        nodes=nodes,
        state_dir=Path(document["state_dir"]),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
