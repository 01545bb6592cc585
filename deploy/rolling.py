"""Rolling restart: every node in turn, with no write refused for longer than a transfer.

For each node, one at a time:
1. every Raft group it leads is handed to a caught-up follower (`transferLeadership`, Raft's
   TimeoutNow): writes pause for a round trip and an election, not an election timeout;
2. the node is restarted (SIGTERM; should it lead again by then, it hands over itself);
3. the next node waits until this one has replayed its log, caught up with every group's
   leader, is healthy and answers the gRPC health check SERVING.
Nodes that lead nothing go first, so fewer transfers are needed.

`deploy.local.LocalNodes` restarts local processes (pid files in a run directory) and
`deploy.docker.tool.DockerNodes` the containers of the Docker deployment; both behind
`NodeControl`, so this module imports neither. Used by
`python -m deploy.local rolling-restart`, `python -m deploy.docker.tool rolling-restart`
and `hastream rolling-restart`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from api_clients import Session
from raftstore import config

log = logging.getLogger(__name__)

SERVING_TIMEOUT_S: Final = 60.0
POLL_S: Final = 0.2


class RollingRestartError(Exception):
    """A node did not come back in time (or could not be restarted): the restart stops
    there, with every node before it restarted and the others untouched."""


class NodeControl(Protocol):
    """How to restart one node of a deployment and see it back."""

    def aliases(self) -> list[str]: ...

    def site(self, alias: str) -> str:
        """The node's client site (`host:port`) as clients reach it."""
        ...

    def restart(self, alias: str) -> None:
        """Stop the node (SIGTERM), start it again, and wait until it has replayed its log
        and caught up with its groups' leaders. Raises RollingRestartError."""
        ...


@dataclass(frozen=True, slots=True)
class RestartStep:
    alias: str
    handed_over: dict[int, str]  # group -> the leader it was handed to
    transfer_s: float  # handing leaderships over
    restart_s: float  # stop, start, replay, catch up, SERVING


def leaders_by_alias(session: Session) -> dict[str, list[int]]:
    """alias -> the groups it leads, as the cluster reports them."""
    leading: dict[str, list[int]] = {}
    for group in session.getStreamingRaftGroups():
        leader = group["leader"]
        if leader:
            leading.setdefault(str(leader).rpartition(":")[2], []).append(int(group["id"]))
    return leading


def restart_order(aliases: Sequence[str], leading: dict[str, list[int]]) -> list[str]:
    """Followers first (no transfer needed), then by how few groups a node leads."""
    return sorted(aliases, key=lambda alias: (len(leading.get(alias, [])), aliases.index(alias)))


def hand_over(session: Session, alias: str) -> dict[int, str]:
    """Move every group `alias` leads to another member; group -> new leader."""
    moved: dict[int, str] = {}
    for group_id in leaders_by_alias(session).get(alias, []):
        moved[group_id] = session.transferLeadership(group_id)
        log.info("group %d: leadership %s -> %s", group_id, alias, moved[group_id])
    return moved


def wait_serving(session: Session, site: str, timeout_s: float = SERVING_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while session.checkHealth(site) != "SERVING":  # bounded by the deadline
        if time.monotonic() > deadline:
            raise RollingRestartError(f"{site} is not SERVING after {timeout_s:.0f}s")
        time.sleep(POLL_S)


def rolling_restart(
    session: Session,
    control: NodeControl,
    *,
    order: Sequence[str] | None = None,
    report: Callable[[RestartStep], None] | None = None,
) -> list[RestartStep]:
    """Restart every node of `control` (or those in `order`, in that order) one at a time;
    see the module docstring. Raises RollingRestartError, or the client's typed errors
    (TransferFailed: a group could not be handed over; nothing was restarted then)."""
    aliases = control.aliases()
    for alias in aliases:
        wait_serving(session, control.site(alias))
    if order is None:
        order = restart_order(aliases, leaders_by_alias(session))
    steps: list[RestartStep] = []
    for alias in order:
        started = time.monotonic()
        moved = hand_over(session, alias)
        handed = time.monotonic()
        control.restart(alias)
        wait_serving(session, control.site(alias))
        step = RestartStep(alias, moved, handed - started, time.monotonic() - handed)
        steps.append(step)
        if report is not None:
            report(step)
    return steps


def client_sites(config_path: str | Path) -> list[str]:
    """The sites clients use (advertised addresses) of the cluster.cfg at `config_path`."""
    cluster = config.load(config_path)
    return [f"{node.advertised_host}:{node.advertised_port}" for node in cluster.nodes]


def sites_of(control: NodeControl) -> list[str]:
    return [control.site(alias) for alias in control.aliases()]


def describe(step: RestartStep) -> str:
    moved = ", ".join(f"group {g} -> {leader}" for g, leader in sorted(step.handed_over.items()))
    handed = f"handed over {moved} in {step.transfer_s * 1000:.0f} ms; " if moved else ""
    return f"{step.alias}: {handed}restarted and serving in {step.restart_s:.1f} s"
