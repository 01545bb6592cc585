"""The node container's health check: the standard gRPC health service (grpc.health.v1).

    python -m deploy.docker.healthcheck [--node ALIAS] [--config PATH]

Asks the node itself (inside the container) `Health.Check("")`: SERVING once it has
replayed its log, no group is in doubt and every Raft group of the node has a known leader
(raftstore/node.py `Node.serving`). Exit 0 when SERVING, 1 otherwise (Docker's contract),
with one line on stdout that `docker inspect` shows; an unhealthy line names the leaders
the node knows. Imports only grpc, the health and proto stubs and the config parser, so it
costs little every few seconds.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Final

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hastream.errors import ConfigError
from proto import hastream_pb2, hastream_pb2_grpc
from raftstore import config
from raftstore.config import NodeConfig

CONFIG_DEFAULT: Final = "/etc/hastream/cluster.cfg"
RPC_TIMEOUT_S: Final = 2.0
EXIT_HEALTHY: Final = 0
EXIT_UNHEALTHY: Final = 1


def local_target(host: str, port: int) -> str:
    """Where to reach this node from inside its container. The deployment maps the node's
    own name to 0.0.0.0 (listen on every interface); connect to loopback then."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return f"{host}:{port}"
    return f"127.0.0.1:{port}" if address == "0.0.0.0" else f"{address}:{port}"


def _channel(target: str, node: NodeConfig) -> grpc.Channel:
    """To the node's client port, over TLS when it serves TLS (its own CA: the target is
    loopback, which its development certificate names)."""
    if node.tls is None:
        return grpc.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(node.tls.ca_file.read_bytes())
    return grpc.secure_channel(target, credentials)


def leaders(target: str, node: NodeConfig) -> dict[int, str]:
    """group id -> leader (`host:port:alias`, "" while unknown) as the node sees it."""
    group_ids = node.group_ids
    with _channel(target, node) as channel:
        stub = hastream_pb2_grpc.StreamTableStub(channel)
        found = {}
        for group_id in group_ids:
            request = hastream_pb2.GroupRequest(raft_group=group_id)
            found[group_id] = stub.GetStreamingLeader(request, timeout=RPC_TIMEOUT_S).leader
        return found


def serving_status(target: str, node: NodeConfig) -> str:
    """The node's grpc.health.v1 status for the whole server ("" service)."""
    with _channel(target, node) as channel:
        request = health_pb2.HealthCheckRequest(service="")
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=RPC_TIMEOUT_S)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.docker.healthcheck")
    parser.add_argument("--node", default=os.environ.get("HASTREAM_NODE"))
    parser.add_argument("--config", default=os.environ.get("HASTREAM_CONFIG", CONFIG_DEFAULT))
    args = parser.parse_args(argv)
    try:
        node = config.load(args.config).node(args.node or "")
    except ConfigError as error:
        print(f"unhealthy: config error: {error}")
        return EXIT_UNHEALTHY
    target = local_target(node.host, node.port)
    try:
        status = serving_status(target, node)
        found = leaders(target, node)
    except grpc.RpcError as error:
        code = error.code().name if isinstance(error, grpc.Call) else "error"
        print(f"unhealthy: {target} does not answer ({code})")
        return EXIT_UNHEALTHY
    except OSError as error:  # the CA file
        print(f"unhealthy: {error}")
        return EXIT_UNHEALTHY
    text = " ".join(f"group {group}: {leader or 'none'}" for group, leader in found.items())
    if status == "SERVING":
        print(f"healthy: SERVING; {text}")
        return EXIT_HEALTHY
    print(f"unhealthy: {status}; {text}")
    return EXIT_UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
