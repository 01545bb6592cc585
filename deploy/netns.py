"""Network namespaces for partition drills: every node alone in its own namespace, joined by
a bridge in a namespace of its own, the client in the root namespace on one more link into
that bridge. Cutting a node's bridge port (`ip link set DEV down`) cuts it off from its peers
and its clients alike, without killing it: its TCP connections stay open and go silent, as
when a switch port or a cable dies.

    root ns:  <tag>c 10.213.X.1/24 ─┐
    <tag>-br: bridge br0 ── cl, p1, p2, p3
    <tag>-node1: eth0 10.213.X.11/24 ── p1 (in <tag>-br)
    ...

Everything lives in namespaces this module creates, on a private /24 that no route of the
root namespace uses yet (checked when it is picked). Only the root end of the client link
and its /24 route appear in the root namespace, and they go with the bridge namespace.
`destroy()` removes everything; use `NamespaceNetwork.create()` as a context manager. Needs
root and `ip netns` (iproute2); `unavailable()` says why not.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final

SUBNET_PREFIX: Final = "10.213"  # the /24s are 10.213.X.0/24, X picked at random
CLIENT_HOST_OCTET: Final = 1
NODE_HOST_OCTET_FIRST: Final = 11
NAME_PREFIX: Final = "hsn"  # every namespace and root-side link this module makes


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be used here (not root, no `ip`, no netns support), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{NAME_PREFIX}probe{secrets.token_hex(3)}"
    added = _ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"`ip netns add` failed: {added.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


def _free_subnet() -> str:
    """A 10.213.X /24 that no address or route of the root namespace touches."""
    used = _ip("-4", "route", "show", "table", "all").stdout + _ip("-4", "addr").stdout
    candidates = [f"{SUBNET_PREFIX}.{octet}" for octet in range(16, 250)]
    random.shuffle(candidates)
    for subnet in candidates:
        if f"{subnet}." not in used:
            return subnet
    raise RuntimeError(f"no free {SUBNET_PREFIX}.X.0/24 subnet")


@dataclass
class NamespaceNetwork:
    """One bridge namespace, one namespace per alias, the client link in the root ns."""

    tag: str
    subnet: str  # "10.213.X"
    aliases: tuple[str, ...]
    _created: list[str] = field(default_factory=list)  # namespaces, for destroy()
    _client_link: str = ""

    @classmethod
    def create(cls, aliases: Sequence[str]) -> NamespaceNetwork:
        network = cls(f"{NAME_PREFIX}{secrets.token_hex(2)}", _free_subnet(), tuple(aliases))
        try:
            network._build()
        except BaseException:
            network.destroy()
            raise
        return network

    @property
    def bridge_namespace(self) -> str:
        return f"{self.tag}-br"

    @property
    def client_host(self) -> str:
        return f"{self.subnet}.{CLIENT_HOST_OCTET}"

    def namespace(self, alias: str) -> str:
        return f"{self.tag}-{alias}"

    def host(self, alias: str) -> str:
        """The node's address (in its namespace)."""
        return f"{self.subnet}.{NODE_HOST_OCTET_FIRST + self.aliases.index(alias)}"

    def port(self, alias: str) -> str:
        """The node's port on the bridge (in the bridge namespace)."""
        return f"p{self.aliases.index(alias) + 1}"

    def exec_prefix(self, alias: str) -> tuple[str, ...]:
        """Runs a command in the node's namespace (`ip netns exec` execs it: same pid)."""
        return ("ip", "netns", "exec", self.namespace(alias))

    def hosts(self) -> dict[str, str]:
        return {alias: self.host(alias) for alias in self.aliases}

    def prefixes(self) -> dict[str, tuple[str, ...]]:
        return {alias: self.exec_prefix(alias) for alias in self.aliases}

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        bridge = self.bridge_namespace
        self._netns(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        for alias in self.aliases:
            namespace = self.namespace(alias)
            self._netns(namespace)
            port = self.port(alias)
            _ip(
                "-n",
                bridge,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "eth0",
                "netns",
                namespace,
            )
            _ip("-n", bridge, "link", "set", port, "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{self.host(alias)}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
        # The client's link: created in the root namespace, its peer moved into the bridge's.
        self._client_link = f"{self.tag}c"
        _ip("link", "add", self._client_link, "type", "veth", "peer", "cl", "netns", bridge)
        _ip("-n", bridge, "link", "set", "cl", "master", "br0", "up")
        _ip("addr", "add", f"{self.client_host}/24", "dev", self._client_link)
        _ip("link", "set", self._client_link, "up")

    def cut(self, alias: str) -> None:
        """Takes the node's bridge port down: no packet reaches it or leaves it."""
        _ip("-n", self.bridge_namespace, "link", "set", self.port(alias), "down")

    def heal(self, alias: str) -> None:
        _ip("-n", self.bridge_namespace, "link", "set", self.port(alias), "up")

    def destroy(self) -> None:
        """Deletes the namespaces (with every link in them, so the client link's root end
        too). Stop the processes running in them first. Idempotent."""
        if self._client_link:
            _ip("link", "delete", self._client_link, check=False)
            self._client_link = ""
        for name in reversed(self._created):
            _ip("netns", "delete", name, check=False)
        self._created.clear()

    def __enter__(self) -> NamespaceNetwork:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.destroy()
