"""A three-node cluster in Docker, on the Docker SDK (no compose, no docker CLI needed).

    python -m deploy.docker.tool build   [--force] [--base-image TAG]
    python -m deploy.docker.tool up      [--ports 8901,8902,8903] [--publish-ports 8911,8912,8913]
                                         [--publish-host 127.0.0.1]
    python -m deploy.docker.tool status
    python -m deploy.docker.tool kill NODE          SIGKILL the node's container (a crash)
    python -m deploy.docker.tool restart NODE       stop (if running), start, wait until ready
    python -m deploy.docker.tool rolling-restart    every node in turn, leadership moved first
    python -m deploy.docker.tool partition NODE     cut NODE off from its peers
    python -m deploy.docker.tool heal NODE          reconnect it
    python -m deploy.docker.tool logs NODE [--tail 200]
    python -m deploy.docker.tool down    [--volumes]
    (every action takes --name NAME, default "hastream", and --state-dir, default .run/docker)

Topology of deployment NAME (every object is named NAME-... and labelled with NAME):
- `NAME-net`: a user-defined bridge network with a fixed subnet. Each node has a static
  address on it, so a restarted or reconnected container keeps its address (pysyncobj
  caches resolved peer addresses for 10 minutes).
- Each node's client port is the SAME number inside and outside, published on
  `127.0.0.1:P -> container:P`, so the generated cluster.cfg says `host=NAME-node1,
  port=P` (what the node binds and its peers dial) and `advertisedHost=127.0.0.1,
  advertisedPort=P` (what clients are told). So is its publish port (`publishPort=Q`,
  published `127.0.0.1:Q -> container:Q`): a client dials it on the host of the site it
  uses, at the number the node reports. Raft ports are not published.
- Every container's /etc/hosts names all nodes by their static addresses, and its own name
  as 0.0.0.0: a node binds its gRPC and Raft ports to its cfg host, so it listens on every
  interface, loopback included (the health check and a cut-off node stay reachable from
  inside the container).
- `partition NODE` disconnects NODE from `NAME-net`: it loses its peers and its published
  port (connects fail at once: there is no other route); `heal` reconnects it with the
  same address and the port mapping comes back.
- Volumes `NAME-<alias>-raftlog` (streamingHADir) and `NAME-<alias>-data`
  (persistenceDir) per node; `down` keeps them (and the generated cluster.cfg with its
  ports and Raft secret, in `<state-dir>/NAME/`) unless `--volumes`.

NotLeader hints and getStreamingLeader name nodes by their advertised, published site
(`127.0.0.1:P:node2`), so a plain `api_clients.connect(...)` on this machine follows them.
See docs/docker.md.

Importable for tests: `plan`, `save`, `ensure_config`, `load`, `sites` (from
deploy.docker.deployment), `up`, `down`, `kill`, `restart`, `partition`, `heal`, `logs`,
`status_text`, `wait_ready`, `leader_alias`, `wait_leaders`.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc

from api_clients import Session
from deploy import rolling
from deploy.docker import images
from deploy.docker.base_image import BASE_TAG_DEFAULT
from deploy.docker.deployment import (
    ADMIN_PASSWORD_IN_CONTAINER,
    CONFIG_IN_CONTAINER,
    DATA_ROOT_IN_CONTAINER,
    NAME_DEFAULT,
    STATE_DIR_DEFAULT,
    TLS_IN_CONTAINER,
    DeployError,
    Deployment,
    NodeExited,
    NodeSpec,
    admin_login,
    admin_password_path,
    client_tls,
    ensure_config,
    load,
    plan,
    save,
    sites,
    tls_dir,
    tls_files,
)
from deploy.docker.images import NODE_TAG_DEFAULT
from hastream.errors import ConfigError, RaftStoreError
from proto import hastream_pb2, hastream_pb2_grpc

log = logging.getLogger(__name__)

LABEL_DEPLOYMENT: Final = "org.hastream.deployment"
LABEL_NODE: Final = "org.hastream.node"
READY_TIMEOUT_S: Final = 90.0
LEADER_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 10
RPC_TIMEOUT_S: Final = 2.0
POLL_INTERVAL_S: Final = 0.2
LOG_MAX_BYTES: Final = "20m"  # per container: json-file logs rotate, never fill the disk
ACTIONS: Final = (
    "build",
    "up",
    "down",
    "status",
    "kill",
    "restart",
    "rolling-restart",
    "partition",
    "heal",
    "logs",
)


# ---------------------------------------------------------------------------------------
# Docker objects


def _labels(deployment: Deployment, **extra: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: deployment.name, **extra}


def _get(collection: Any, name: str) -> Any | None:
    import docker.errors

    try:
        return collection.get(name)
    except docker.errors.NotFound:
        return None


def ensure_network(client: Any, deployment: Deployment) -> None:
    if _get(client.networks, deployment.network) is not None:
        return
    import docker.errors
    from docker.types import IPAMConfig, IPAMPool

    try:
        client.networks.create(
            deployment.network,
            driver="bridge",
            ipam=IPAMConfig(pool_configs=[IPAMPool(subnet=deployment.subnet)]),
            labels=_labels(deployment),
        )
    except docker.errors.APIError as error:  # most often: the subnet overlaps another one
        reason = f"cannot create network {deployment.network} on {deployment.subnet}"
        hint = "`down --volumes` and `up --subnet ...` to choose another subnet"
        raise DeployError(f"{reason}: {error.explanation}; {hint}") from None
    log.info("created network %s subnet=%s", deployment.network, deployment.subnet)


def ensure_volumes(client: Any, deployment: Deployment) -> None:
    for alias in deployment.aliases:
        for kind in ("raftlog", "data"):
            name = deployment.volume(alias, kind)
            if _get(client.volumes, name) is None:
                client.volumes.create(name, labels=_labels(deployment, **{LABEL_NODE: alias}))


def _extra_hosts(deployment: Deployment, node: NodeSpec) -> dict[str, str]:
    """Every node's name -> its cluster address; the node's own name -> 0.0.0.0 (bind all)."""
    return {
        peer.container: ("0.0.0.0" if peer.alias == node.alias else peer.ip)
        for peer in deployment.nodes
    }


def _admin_password_mount(deployment: Deployment) -> dict[str, dict[str, str]]:
    path = admin_password_path(deployment)
    return {str(path.resolve()): {"bind": ADMIN_PASSWORD_IN_CONTAINER, "mode": "ro"}}


def admin_session(deployment: Deployment, sites: list[str]) -> Session:
    """A session on `sites`, over TLS, logged in as the first admin."""
    userid, password = admin_login(deployment)
    session = Session(sites, userid=userid, password=password, tls=client_tls(deployment))
    session.login()
    return session


def create_container(client: Any, deployment: Deployment, node: NodeSpec) -> Any:
    from docker.types import EndpointConfig, LogConfig

    container = client.containers.create(
        deployment.image,
        name=node.container,
        environment={"HASTREAM_NODE": node.alias, "HASTREAM_CONFIG": CONFIG_IN_CONTAINER},
        ports={
            f"{port}/tcp": (deployment.publish_host, port)
            for port in (node.port, node.publish_port)
            if port is not None
        },
        volumes={
            deployment.volume(node.alias, "raftlog"): {
                "bind": f"{DATA_ROOT_IN_CONTAINER}/{node.alias}/raftlog",
                "mode": "rw",
            },
            deployment.volume(node.alias, "data"): {
                "bind": f"{DATA_ROOT_IN_CONTAINER}/{node.alias}/persistence",
                "mode": "rw",
            },
            str(deployment.config_path.resolve()): {"bind": CONFIG_IN_CONTAINER, "mode": "ro"},
            **_admin_password_mount(deployment),
            **{
                str(path.resolve()): {"bind": f"{TLS_IN_CONTAINER}/{path.name}", "mode": "ro"}
                for path in tls_files(deployment, node.alias)
            },
        },
        extra_hosts=_extra_hosts(deployment, node),
        network=deployment.network,
        networking_config={
            deployment.network: EndpointConfig(client.api.api_version, ipv4_address=node.ip)
        },
        init=True,  # docker-init as pid 1: forwards SIGTERM, reaps
        labels=_labels(deployment, **{LABEL_NODE: node.alias}),
        log_config=LogConfig(type="json-file", config={"max-size": LOG_MAX_BYTES}),
        detach=True,
    )
    log.info("created container %s ip=%s port=%d", node.container, node.ip, node.port)
    return container


def container(client: Any, deployment: Deployment, alias: str) -> Any | None:
    return _get(client.containers, deployment.node(alias).container)


def _state(item: Any) -> str:
    item.reload()
    return str(item.attrs["State"]["Status"])


def log_tail(client: Any, deployment: Deployment, alias: str, lines: int = 40) -> str:
    item = container(client, deployment, alias)
    if item is None:
        return "(no container)"
    return str(item.logs(tail=lines).decode(errors="replace"))


# ---------------------------------------------------------------------------------------
# Probes over the published ports


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, interval_s: float = POLL_INTERVAL_S
) -> bool:
    """Poll `predicate` until True (-> True) or `timeout_s` passes (-> False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(interval_s, remaining))


def _call(deployment: Deployment, alias: str, method: str, request: Any) -> Any | None:
    """One unary call to node `alias` through its published port; None if it fails."""
    ca = (tls_dir(deployment) / "ca.pem").read_bytes()
    credentials = grpc.ssl_channel_credentials(ca)
    with grpc.secure_channel(deployment.site(alias), credentials) as channel:
        stub = hastream_pb2_grpc.StreamTableStub(channel)
        try:
            return getattr(stub, method)(request, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError:
            return None


def node_status(deployment: Deployment, alias: str) -> dict[str, Any] | None:
    """The node's GetNodeStatus document, None if it does not answer."""
    reply = _call(deployment, alias, "GetNodeStatus", hastream_pb2.Empty())
    if reply is None:
        return None
    document = json.loads(reply.json)
    return document if isinstance(document, dict) else None


def leader_hint(deployment: Deployment, alias: str, group_id: int) -> str | None:
    """The leader (`host:port:alias`) of `group_id` as node `alias` sees it."""
    reply = _call(
        deployment, alias, "GetStreamingLeader", hastream_pb2.GroupRequest(raft_group=group_id)
    )
    return (reply.leader or None) if reply is not None else None


def leader_alias(deployment: Deployment, group_id: int) -> str | None:
    """The leader of `group_id`, once a majority of the nodes name it and it answers as
    leader itself. A cut-off old leader still names itself until its fallback timeout; the
    majority rule keeps it from being reported."""
    votes: dict[str, int] = {}
    for alias in deployment.aliases:
        hint = leader_hint(deployment, alias, group_id)
        named = deployment.alias_of(hint) if hint else None
        if named is not None:
            votes[named] = votes.get(named, 0) + 1
    majority = len(deployment.nodes) // 2 + 1
    for alias, count in votes.items():
        if count >= majority and _role(deployment, alias, group_id) == "leader":
            return alias
    return None


def _role(deployment: Deployment, alias: str, group_id: int) -> str | None:
    entry = _group_entry(node_status(deployment, alias), group_id)
    return None if entry is None else str(entry.get("role"))


def wait_ready(
    client: Any,
    deployment: Deployment,
    aliases: Iterable[str] | None = None,
    timeout_s: float = READY_TIMEOUT_S,
) -> None:
    """Wait until every node in `aliases` (default: all) answers gRPC on its published
    port and says it is ready (replayed, not in doubt). Raises NodeExited as soon as one's
    container is not running, DeployError on timeout."""
    pending = set(deployment.aliases if aliases is None else aliases)

    def all_ready() -> bool:
        for alias in sorted(pending):
            item = container(client, deployment, alias)
            if item is None or _state(item) != "running":
                node = deployment.node(alias)
                raise NodeExited(alias, node.container, log_tail(client, deployment, alias))
            status = node_status(deployment, alias)
            if status is not None and status.get("ready", True):
                pending.discard(alias)
        return not pending

    if not wait_until(all_ready, timeout_s, interval_s=0.5):
        raise DeployError(f"not ready after {timeout_s:.0f}s: {', '.join(sorted(pending))}")


def wait_leaders(deployment: Deployment, timeout_s: float = LEADER_TIMEOUT_S) -> dict[int, str]:
    """Wait until every Raft group has a leader; group id -> leader alias."""
    leaders: dict[int, str] = {}

    def all_led() -> bool:
        for group_id in deployment.group_ids:
            if group_id not in leaders:
                alias = leader_alias(deployment, group_id)
                if alias is not None:
                    leaders[group_id] = alias
        return len(leaders) == len(deployment.group_ids)

    if not wait_until(all_led, timeout_s, interval_s=0.25):
        missing = [str(g) for g in deployment.group_ids if g not in leaders]
        raise DeployError(f"no leader after {timeout_s:.0f}s for group(s) {', '.join(missing)}")
    return leaders


# ---------------------------------------------------------------------------------------
# Actions


def up(
    client: Any, deployment: Deployment, *, timeout_s: float = READY_TIMEOUT_S
) -> dict[int, str]:
    """Create what is missing (networks, volumes, containers), start what is stopped, wait
    until every node answers and every group has a leader. Idempotent."""
    ensure_config(deployment)
    ensure_network(client, deployment)
    ensure_volumes(client, deployment)
    for node in deployment.nodes:
        item = _get(client.containers, node.container)
        if item is None:
            item = create_container(client, deployment, node)
        if _state(item) != "running":
            item.start()
            log.info("started container %s", node.container)
    wait_ready(client, deployment, timeout_s=timeout_s)
    return wait_leaders(deployment)


def down(client: Any, deployment: Deployment, *, volumes: bool = False) -> None:
    """Stop and remove the containers and networks; the volumes and the saved cfg stay
    (so `up` brings the same data back) unless `volumes`."""
    for node in deployment.nodes:
        item = _get(client.containers, node.container)
        if item is not None:
            if _state(item) == "running":
                item.stop(timeout=STOP_TIMEOUT_S)
            item.remove(force=True)
            log.info("removed container %s", node.container)
    network = _get(client.networks, deployment.network)
    if network is not None:
        network.remove()
    if volumes:
        for alias in deployment.aliases:
            for kind in ("raftlog", "data"):
                volume = _get(client.volumes, deployment.volume(alias, kind))
                if volume is not None:
                    volume.remove(force=True)
        shutil.rmtree(deployment.state_dir, ignore_errors=True)
        log.info("removed volumes and state of %s", deployment.name)


def _existing(client: Any, deployment: Deployment, alias: str) -> Any:
    item = container(client, deployment, alias)
    if item is None:
        raise DeployError(f"node {alias} has no container (run `up` first)")
    return item


def kill(client: Any, deployment: Deployment, alias: str) -> None:
    """SIGKILL the node's container (a crash) and wait until it has exited."""
    item = _existing(client, deployment, alias)
    if _state(item) == "running":
        item.kill()
    if not wait_until(lambda: _state(item) != "running", 30):
        raise DeployError(f"container {item.name} still runs after SIGKILL")


def restart(
    client: Any, deployment: Deployment, alias: str, *, timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Stop the node (SIGTERM, then SIGKILL after STOP_TIMEOUT_S) if it runs, start it
    again on the same volumes and address, wait until it answers."""
    item = _existing(client, deployment, alias)
    if is_partitioned(client, deployment, alias):
        raise DeployError(f"node {alias} is partitioned: `heal {alias}` first")
    if _state(item) == "running":
        item.stop(timeout=STOP_TIMEOUT_S)
    item.start()
    wait_ready(client, deployment, [alias], timeout_s)
    targets: dict[int, int] = {}
    if not wait_until(lambda: caught_up(deployment, alias, targets), timeout_s, interval_s=0.25):
        raise DeployError(f"{alias} did not catch up with its groups' leaders")


@dataclass
class DockerNodes:
    """The containers of a `deploy.docker.tool` deployment."""

    client: Any  # docker.DockerClient
    deployment: Any  # deploy.docker.deployment.Deployment

    def aliases(self) -> list[str]:
        return list(self.deployment.aliases)

    def site(self, alias: str) -> str:
        return str(self.deployment.site(alias))

    def restart(self, alias: str) -> None:
        try:
            restart(self.client, self.deployment, alias)
        except DeployError as error:
            raise rolling.RollingRestartError(f"{alias}: {error}") from error


def rolling_restart(client: Any, deployment: Deployment) -> None:
    """Restart every node in turn, leadership handed over first (deploy/rolling.py)."""
    control = DockerNodes(client, deployment)
    with admin_session(deployment, rolling.sites_of(control)) as session:
        try:
            for step in rolling.rolling_restart(session, control):
                print(rolling.describe(step), flush=True)
        except rolling.RollingRestartError as error:
            raise DeployError(str(error)) from error
    print("rolling restart done")


def caught_up(deployment: Deployment, alias: str, targets: dict[int, int] | None = None) -> bool:
    """Every group of `alias` has a leader, the node is healthy in it, and has applied what
    that leader had committed when first asked (`targets`, group -> that commit index,
    carries the first answer across polls: under a steady load the leader's commit index
    moves on, and a follower always just behind it is caught up)."""
    targets = {} if targets is None else targets
    status = node_status(deployment, alias)
    for group_id in deployment.group_ids:
        entry = _group_entry(status, group_id)
        if entry is None or not entry.get("leader"):
            return False
        if entry.get("health", {}).get("state", "healthy") != "healthy":
            return False
        if group_id not in targets:
            leader = leader_alias(deployment, group_id)
            if leader is None:
                return False
            leader_entry = _group_entry(node_status(deployment, leader), group_id)
            if leader_entry is None:
                return False
            targets[group_id] = int(leader_entry.get("commit_index", 0))
        if int(entry.get("last_applied", 0)) < targets[group_id]:
            return False
    return True


def is_partitioned(client: Any, deployment: Deployment, alias: str) -> bool:
    item = _existing(client, deployment, alias)
    item.reload()
    return deployment.network not in item.attrs["NetworkSettings"]["Networks"]


def partition(client: Any, deployment: Deployment, alias: str) -> bool:
    """Disconnect the node from the deployment's network: it loses its peers and its
    published port, and keeps only loopback. Returns False if it already was."""
    if is_partitioned(client, deployment, alias):
        return False
    network = client.networks.get(deployment.network)
    network.disconnect(deployment.node(alias).container)
    return True


def heal(client: Any, deployment: Deployment, alias: str) -> bool:
    """Reconnect the node with its static address (its port mapping comes back). Returns
    False if it was connected."""
    if not is_partitioned(client, deployment, alias):
        return False
    node = deployment.node(alias)
    client.networks.get(deployment.network).connect(node.container, ipv4_address=node.ip)
    return True


def logs(client: Any, deployment: Deployment, alias: str, tail: int = 200) -> str:
    return log_tail(client, deployment, alias, tail)


def status_text(client: Any, deployment: Deployment) -> str:
    """Containers (state, health, network link, site), then per group its leader and each
    member's role, term, commit index and tables."""
    statuses: dict[str, dict[str, Any] | None] = {}
    rows: list[tuple[str, ...]] = [("NODE", "CONTAINER", "STATE", "HEALTH", "NETWORK", "SITE")]
    for node in deployment.nodes:
        row, statuses[node.alias] = _container_row(client, deployment, node)
        rows.append(row)
    lines = [_format_row(row, _NODE_WIDTHS) for row in rows]
    for group_id in deployment.group_ids:
        lines += ["", *_group_lines(deployment, group_id, statuses)]
    return "\n".join(lines)


def _container_row(
    client: Any, deployment: Deployment, node: NodeSpec
) -> tuple[tuple[str, ...], dict[str, Any] | None]:
    site = deployment.site(node.alias)
    item = _get(client.containers, node.container)
    if item is None:
        return (node.alias, node.container, "absent", "-", "-", site), None
    item.reload()
    state = item.attrs["State"]
    health = str((state.get("Health") or {}).get("Status", "-"))
    linked = deployment.network in item.attrs["NetworkSettings"]["Networks"]
    running = state["Status"] == "running"
    status = node_status(deployment, node.alias) if running and linked else None
    link = "connected" if linked else "PARTITIONED"
    return (node.alias, node.container, str(state["Status"]), health, link, site), status


def _group_lines(
    deployment: Deployment, group_id: int, statuses: dict[str, dict[str, Any] | None]
) -> list[str]:
    leader = leader_alias(deployment, group_id) or "none (election running or no quorum)"
    header = ("  NODE", "ROLE", "TERM", "COMMIT", "APPLIED", "TABLES")
    lines = [f"GROUP {group_id}  leader: {leader}", _format_row(header, _GROUP_WIDTHS)]
    for alias in deployment.aliases:
        entry = _group_entry(statuses.get(alias), group_id)
        if entry is None:
            lines.append(f"  {alias:<8} unreachable")
            continue
        keys = ("role", "term", "commit_index", "last_applied")
        cells = [str(entry.get(key, "-")) for key in keys]
        tables = ",".join(str(table) for table in entry.get("tables", [])) or "-"
        lines.append(_format_row((f"  {alias}", *cells, tables), _GROUP_WIDTHS))
    return lines


def _group_entry(status: dict[str, Any] | None, group_id: int) -> dict[str, Any] | None:
    for entry in (status or {}).get("groups", []):
        if isinstance(entry, dict) and entry.get("raft_group") == group_id:
            return entry
    return None


_NODE_WIDTHS: Final = (8, 26, 10, 10, 12)
_GROUP_WIDTHS: Final = (10, 10, 6, 8, 8)


def _format_row(cells: Sequence[str], widths: Sequence[int]) -> str:
    padded = [cell.ljust(width) for cell, width in zip(cells, widths, strict=False)]
    return " ".join(padded + list(cells[len(widths) :])).rstrip()


# ---------------------------------------------------------------------------------------
# CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.docker.tool", description="A three-node cluster in Docker."
    )
    parser.add_argument("action", choices=ACTIONS)
    parser.add_argument("node", nargs="?", default=None, help="node alias (kill, restart, ...)")
    parser.add_argument("--name", default=NAME_DEFAULT, help="deployment name (object prefix)")
    parser.add_argument("--state-dir", type=Path, default=STATE_DIR_DEFAULT)
    parser.add_argument("--image", default=NODE_TAG_DEFAULT)
    parser.add_argument("--base-image", default=BASE_TAG_DEFAULT, help="FROM of the node image")
    parser.add_argument("--force", action="store_true", help="build: rebuild even if up to date")
    parser.add_argument("--no-build", action="store_true", help="up: do not build images")
    parser.add_argument("--ports", help="up: client ports, e.g. 8901,8902,8903 (default: free)")
    parser.add_argument(
        "--publish-ports", help="up: publish ports, e.g. 8911,8912,8913 (default: free)"
    )
    parser.add_argument("--publish-host", default="127.0.0.1", help="up: address to publish on")
    parser.add_argument("--subnet", help="up: cluster network subnet (default: a free /24)")
    parser.add_argument("--election-timeout", type=float, default=1.5, help="up: seconds")
    parser.add_argument("--volumes", action="store_true", help="down: delete the data too")
    parser.add_argument("--tail", type=int, default=200, help="logs: lines")
    args = parser.parse_args(argv)
    if args.action in ("kill", "restart", "partition", "heal", "logs") and args.node is None:
        parser.error(f"{args.action} needs a NODE")
    args.state_dir = args.state_dir.absolute()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point. Exit codes: 0 ok, 1 failed, 2 no such deployment or node."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    import docker

    client = docker.from_env()
    try:
        return _run(client, args)
    except NodeExited as error:
        print(f"error: {error}; last lines:\n{error.log_tail}", file=sys.stderr)
    except (DeployError, images.ImageBuildError, ConfigError, RaftStoreError) as error:
        print(f"error: {error}", file=sys.stderr)
    return 1


def _run(client: Any, args: argparse.Namespace) -> int:
    if args.action == "build":
        image_id = images.ensure_images(
            client, node_tag=args.image, base=args.base_image, force=args.force
        )
        print(f"{args.image} {image_id}")
        return 0
    deployment = load(args.name, args.state_dir)
    if args.action == "up":
        if not args.no_build:
            images.ensure_images(client, node_tag=args.image, base=args.base_image)
        if deployment is None:
            deployment = plan(
                client,
                name=args.name,
                state_root=args.state_dir,
                image=args.image,
                ports=_port_list("--ports", args.ports),
                publish_ports=_port_list("--publish-ports", args.publish_ports),
                publish_host=args.publish_host,
                subnet=args.subnet,
                election_timeout_s=args.election_timeout,
            )
            save(deployment)
        for group_id, alias in sorted(up(client, deployment).items()):
            print(f"group {group_id}: leader {alias}")
        print("sites: " + ",".join(sites(deployment)))
        return 0
    if deployment is None:
        print(f"error: no deployment {args.name!r} in {args.state_dir}", file=sys.stderr)
        return 2
    return _act(client, deployment, args)


def _port_list(option: str, text: str | None) -> list[int] | None:
    """The ports of a comma-separated option; None when it is not given."""
    if not text:
        return None
    try:
        ports = [int(port) for port in text.split(",")]
    except ValueError:
        detail = f"{option} takes port numbers separated by commas, got {text!r}"
        raise DeployError(detail) from None
    if not all(0 < port < 65536 for port in ports):
        raise DeployError(f"{option}: ports are 1-65535, got {text!r}")
    return ports


def _act(client: Any, deployment: Deployment, args: argparse.Namespace) -> int:
    alias = args.node
    if alias is not None:
        deployment.node(alias)  # raises DeployError for an unknown alias
    if args.action == "down":
        down(client, deployment, volumes=args.volumes)
        print(f"{deployment.name}: down" + (" (volumes removed)" if args.volumes else ""))
    elif args.action == "status":
        print(status_text(client, deployment))
    elif args.action == "kill":
        kill(client, deployment, alias)
        print(f"{alias}: killed")
    elif args.action == "restart":
        restart(client, deployment, alias)
        print(f"{alias}: restarted and ready")
    elif args.action == "rolling-restart":
        rolling_restart(client, deployment)
    elif args.action == "partition":
        changed = partition(client, deployment, alias)
        print(f"{alias}: {'partitioned' if changed else 'already partitioned'}")
    elif args.action == "heal":
        changed = heal(client, deployment, alias)
        print(f"{alias}: {'healed' if changed else 'was not partitioned'}")
    else:
        assert args.action == "logs", args.action
        print(logs(client, deployment, alias, args.tail))
    return 0


if __name__ == "__main__":
    sys.exit(main())
