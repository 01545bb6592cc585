"""Where a node moves its groups' leadership: away before it stops, back when it is the
group's preferred leader (cluster.cfg `streamingPreferredLeaders`).

Both use the graceful transfer (`Group.transfer_leadership`, Raft's TimeoutNow): the leader
stops taking writes, the target catches up, then takes over with one election round, so
clients see a pause of a round trip and an election instead of an election timeout.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

from hastream.errors import RaftStoreError
from hastream.model import LOCAL_GROUP, NodeAddress
from raftstore import limits
from raftstore.group import Group
from raftstore.threads import Spawn

log = logging.getLogger(__name__)

# Ask `peer` (a group's leader) to hand `group_id` to `alias` within `timeout_s`.
Transfer = Callable[[NodeAddress, int, str, float], str]


def hand_over(groups: list[Group], timeout_s: float, spawn: Spawn) -> None:
    """Hand every Raft group this node leads to a follower, all at once (one thread each,
    started through `spawn`), and wait at most `timeout_s` in all. A transfer that fails is
    logged: the node stops anyway, and the group elects a leader after its election
    timeout."""
    leading = [group for group in groups if group.group_id != LOCAL_GROUP and group.is_leader()]
    threads = [
        spawn(f"hand-over-{group.group_id}", functools.partial(_hand_over_one, group, timeout_s))
        for group in leading
    ]
    deadline = time.monotonic() + timeout_s + 1.0
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _hand_over_one(group: Group, timeout_s: float) -> None:
    started = time.monotonic()
    try:
        leader = group.transfer_leadership(None, timeout_s)
    except RaftStoreError as error:
        log.warning("leadership not handed over group=%d: %s", group.group_id, error)
        return
    elapsed_ms = (time.monotonic() - started) * 1000
    log.info("handed over group=%d leader=%s ms=%.0f", group.group_id, leader, elapsed_ms)


class PreferredLeader:
    """Asks for leadership back for each group whose preferred leader is this node, once it
    has been a healthy, caught-up follower for `settle_s` (a node that just restarted is
    not handed a group while it replays). Asks at most every `settle_s` per group.

    Called from the node's watch thread only."""

    def __init__(
        self,
        alias: str,
        preferred: dict[int, str],
        transfer: Transfer,
        *,
        settle_s: float = limits.PREFERRED_LEADER_SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._alias = alias
        self._groups = {group_id for group_id, who in preferred.items() if who == alias}
        self._transfer = transfer
        self._settle_s = settle_s
        self._clock = clock
        self._settled_since: dict[int, float] = {}
        self._next_attempt: dict[int, float] = {}

    def check(self, groups: list[Group]) -> None:
        for group in groups:
            if group.group_id in self._groups:
                self._check(group)

    def _check(self, group: Group) -> None:
        group_id = group.group_id
        now = self._clock()
        leader = group.leader_peer()
        if group.is_leader() or leader is None or not _caught_up_follower(group):
            self._settled_since.pop(group_id, None)
            return
        since = self._settled_since.setdefault(group_id, now)
        if now - since < self._settle_s or now < self._next_attempt.get(group_id, 0.0):
            return
        self._next_attempt[group_id] = now + self._settle_s
        log.info("asking for leadership back group=%d leader=%s", group_id, leader)
        try:
            self._transfer(leader, group_id, self._alias, limits.TRANSFER_TIMEOUT_S_DEFAULT)
        except RaftStoreError as error:
            log.info("leadership not moved back group=%d: %s", group_id, error)


def _caught_up_follower(group: Group) -> bool:
    """Replayed, healthy, and has applied everything it knows to be committed."""
    if not group.ready():
        return False
    status = group.status()
    applied, committed = int(status["last_applied"]), int(status["commit_index"])
    return status["role"] == "follower" and applied >= committed > 0
