"""When the leader sends each follower its next append_entries: the followers a commit
needs get every entry at once, the others get theirs in batches.

An entry commits once a majority holds it durably: the leader and, in a three-member group,
one follower. pysyncobj sends every follower every entry as soon as it is added, so under
small waited publishes each follower runs a tick, a journal write, an fdatasync and an
acknowledgement per entry, and the leader seals, sends, reads and opens two messages per
entry, where the commit waits for only the first acknowledgement. Here the followers a
majority needs (the *eager* ones: the most caught up, kept until one falls behind) get each
entry as pysyncobj would; every other follower (*held back*) gets all it lacks in one
message once the first entry it lacks has waited `hold_s`, once it lacks `hold_bytes` or
more, or with its heartbeat. Raft lets a leader send when it likes: this changes when a
follower hears, never what it is told, and a commit still needs a majority's fdatasync
(replication.commit_reach).

If an eager follower stops acknowledging (it died, froze, or its journal failed), the held
back one's next batch goes at most `hold_s` later; its acknowledgement commits, and makes it
eager once the stalled one has stayed behind it for `hold_s`. So one follower's failure
costs the publishers a wait of about twice `hold_s`, not an election; a follower that is
slow but alive costs at most `hold_s` per commit until it is replaced.

Every follower still hears of a new commit index by the commit notice's time (`pull`) and
gets a heartbeat every `heartbeat_s`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

Node = Hashable


@dataclass(frozen=True, slots=True)
class Follower:
    """A follower as the leader sees it when it may send."""

    node: Node
    match_index: int  # the highest index it acknowledged as durable
    lacks: int  # entries the leader holds that it has not been sent (next index to the end)


@dataclass(slots=True)
class Pacing:
    """One leader's send plan for its followers; reset on every new term (`reset`). Used
    by the Raft tick thread only."""

    hold_s: float
    hold_bytes: int
    heartbeat_s: float
    # When each follower must next get a message even with nothing new for it.
    _due: dict[Node, float] = field(default_factory=dict)
    # Each held-back follower: since when, and how many bytes of entries it lacks.
    _held_since: dict[Node, float] = field(default_factory=dict)
    _held_bytes: dict[Node, int] = field(default_factory=dict)
    _eager: tuple[Node, ...] = ()
    # Since when each follower has acknowledged less than another, at every plan.
    _behind_since: dict[Node, float] = field(default_factory=dict)

    @property
    def eager(self) -> tuple[Node, ...]:
        """The followers the last plan sent every entry at once."""
        return self._eager

    @property
    def holding(self) -> bool:
        """Whether a follower lacks entries the leader holds back from it."""
        return bool(self._held_since)

    def reset(self) -> None:
        """A new term (or a new leader): every follower is due at once."""
        self._due.clear()
        self._held_since.clear()
        self._held_bytes.clear()
        self._eager = ()
        self._behind_since.clear()

    def pull(self, at: float) -> None:
        """Every follower must hear from the leader by `at` (a commit notice)."""
        due = self._due
        for node, when in due.items():
            if when > at:
                due[node] = at

    def plan(
        self, now: float, followers: Sequence[Follower], needed: int, added_bytes: int
    ) -> list[Node]:
        """The followers to send to now. `needed`: how many followers' acknowledgements a
        commit needs; `added_bytes`: the bytes of the entries added since the last plan."""
        eager = self._choose_eager(now, followers, needed)
        send: list[Node] = []
        for follower in followers:
            node = follower.node
            due = self._due.get(node, 0.0) <= now
            if follower.lacks and not due and node not in eager:
                since = self._held_since.setdefault(node, now)
                held = self._held_bytes.get(node, 0) + added_bytes
                self._held_bytes[node] = held
                if now - since < self.hold_s and held < self.hold_bytes:
                    self._due[node] = min(self._due[node], since + self.hold_s)
                    continue
            if follower.lacks or due:
                send.append(node)
        return send

    def sent(self, node: Node, now: float) -> None:
        """`node` was sent everything it lacked: its next message is its heartbeat."""
        self._due[node] = now + self.heartbeat_s
        self._held_since.pop(node, None)
        self._held_bytes.pop(node, None)

    def next_due(self) -> float:
        """When the leader's tick must send next to some follower (inf: none known yet;
        a follower not planned for yet is due at once)."""
        return min(self._due.values(), default=math.inf)

    def _choose_eager(
        self, now: float, followers: Sequence[Follower], needed: int
    ) -> tuple[Node, ...]:
        """The eager followers stay eager until one falls behind: another follower has
        acknowledged more, at every plan for `hold_s`. Ranking by index alone swapped them
        on most batches (the held-back follower's acknowledgement of a batch often lands
        before the eager one's of the batch's last entry)."""
        match = {follower.node: follower.match_index for follower in followers}
        best = max(match.values(), default=0)
        behind = self._behind_since
        for node, index in match.items():
            if index >= best:
                behind.pop(node, None)
            else:
                behind.setdefault(node, now)
        before = set(self._eager)
        kept = [
            node
            for node in self._eager
            if node in match and now - behind.get(node, now) < self.hold_s
        ][:needed]
        # The places left go to the most caught up; on a tie to one that was eager (a
        # follower behind keeps its place while nobody is ahead of it to take it).
        ranked = sorted(match, key=lambda node: (match[node], node in before), reverse=True)
        kept += [node for node in ranked if node not in kept][: needed - len(kept)]
        self._eager = tuple(kept)
        return self._eager
