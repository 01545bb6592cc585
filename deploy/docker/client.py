"""A client session for a Docker cluster reached through published ports.

Nodes advertise themselves by their cfg host, the container name (`NAME-node2:P:node2`),
which resolves only on the cluster network. A client outside Docker that follows such a
NotLeader hint cannot resolve it. `AddressMappedSession` rewrites every node address the
cluster hands out (NotLeader hints, getStreamingLeader answers) through an address map
before using it, as ioredis' `natMap` does for Redis Cluster behind NAT:

    session = connect(deployment)                   # map: NAME-nodeN:P -> 127.0.0.1:P
    session = AddressMappedSession(sites, {"hastream-node1:8901": "10.0.0.5:8901", ...})

Without a map (plain `api_clients.connect`), a redirect to an unresolvable name fails fast
and the session moves to its next site; see docs/docker.md for when that is enough.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from api_clients import Session
from deploy.docker.deployment import Deployment, sites

log = logging.getLogger(__name__)


class AddressMappedSession(Session):
    """A Session whose learned node addresses go through `address_map` (`host:port` ->
    `host:port`). Addresses not in the map are used as they are."""

    def __init__(
        self, sites: Sequence[str], address_map: Mapping[str, str], **options: Any
    ) -> None:
        super().__init__(sites, **options)
        self._address_map = {key.lower(): value for key, value in address_map.items()}

    def map_address(self, address: str) -> str:
        """`host:port[:alias]` -> the mapped `host:port[:alias]` (the alias is kept)."""
        host, _, rest = address.partition(":")
        port, _, alias = rest.partition(":")
        mapped = self._address_map.get(f"{host}:{port}".lower())
        if mapped is None:
            return address
        return f"{mapped}:{alias}" if alias else mapped

    def learn_site(self, address: str) -> str | None:
        return super().learn_site(self.map_address(address))


def address_map(deployment: Deployment) -> dict[str, str]:
    """`container:port` -> published site, for every node of `deployment`."""
    return {
        f"{node.container}:{node.port}": deployment.site(node.alias) for node in deployment.nodes
    }


def connect(deployment: Deployment, **options: Any) -> AddressMappedSession:
    """A session over every published site of `deployment`, following leaders through the
    address map. `options` are Session's (`timeout_s`, `deadline_s`, ...)."""
    return AddressMappedSession(sites(deployment), address_map(deployment), **options)
