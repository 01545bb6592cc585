"""Pre-vote (Raft thesis 9.6): a member whose election timer ran out asks the others whether
they would vote for it before it raises its term, and stands for election only when a
majority (itself included) says yes.

Why: pysyncobj raises the term as soon as the timer runs out, and any member seeing a higher
term drops its leader. A member can miss the leader while the leader is fine: its own tick
thread was held (a long apply or fsync, CPU starved by its neighbours on a loaded machine),
or the leader's heartbeat waits in the link behind a large append to it. That member then
forced an election it could not win (its log is behind) and the cluster lost its leader for
one or more election rounds: measured, 4-13 elections in 6 s of two clusters publishing
side by side on two cores. With pre-vote it asks, the members that still hear the leader
say nothing, and it keeps following.

A member grants a pre-vote when it is not the leader, has not heard from a leader within
the minimum election timeout, and the asker's log is at least as up to date as its own
(the vote rule); granting changes nothing on the granter. A refusal is silence: the asker
asks again after `RETRY_FRACTION` of an election timeout, so a follower that heard the
leader's last heartbeat just before it died delays the failover by at most that much.

A leadership transfer's TimeoutNow skips the pre-vote: the leader itself asked for the
election (replication.py checks that before it calls `start`).

This module holds the decisions and the round's state; replication.py sends the messages.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Final

PRE_VOTE: Final = "pre_vote"
PRE_VOTE_GRANTED: Final = "pre_vote_granted"
# After a round without a majority, the next one starts after this share of an election
# timeout (randomised like the timeout itself, by the caller).
RETRY_FRACTION: Final = 0.25


@dataclass(frozen=True, slots=True)
class LogPosition:
    term: int
    index: int

    def at_least(self, other: LogPosition) -> bool:
        """Raft's "at least as up to date": a later last term, or the same and as long."""
        return (self.term, self.index) >= (other.term, other.index)


def should_grant(
    *,
    proposed_term: int,
    current_term: int,
    is_leader: bool,
    heard_leader_s_ago: float | None,
    min_timeout_s: float,
    asker: LogPosition,
    own: LogPosition,
) -> bool:
    """Would this member vote for the asker at `proposed_term`, were it to stand?"""
    if is_leader or proposed_term < current_term:
        return False
    if heard_leader_s_ago is not None and heard_leader_s_ago < min_timeout_s:
        return False  # The leader is alive as far as this member can tell.
    return asker.at_least(own)


@dataclass
class PreVoteRound:
    """The asking side: at most one round at a time, for the term it proposes."""

    proposed_term: int | None = None
    members: int = 0
    grants: set[Hashable] = field(default_factory=set)
    passed_term: int | None = None
    rounds_total: int = 0
    passed_total: int = 0

    def start(self, current_term: int, members: int) -> bool:
        """A new round proposing current_term + 1 among `members` (this one included).
        True when this member alone is a majority (the round has passed)."""
        self.proposed_term = current_term + 1
        self.members = members
        self.grants = set()
        self.passed_term = None
        self.rounds_total += 1
        return self._check()

    def granted(self, node: Hashable, proposed_term: int, current_term: int) -> bool:
        """A grant arrived. True when it completes a majority for this round (once)."""
        if self.proposed_term is None or proposed_term != self.proposed_term:
            return False  # A grant for an older round.
        if current_term + 1 != proposed_term:
            self.proposed_term = None  # The term moved on meanwhile: the round is void.
            return False
        self.grants.add(node)
        return self._check()

    def take_pass(self, current_term: int) -> bool:
        """True once after a round passed, while the term it was for is still the next one:
        the member may now raise its term and stand."""
        passed, self.passed_term = self.passed_term, None
        return passed is not None and passed == current_term + 1

    def _check(self) -> bool:
        if 2 * (len(self.grants) + 1) <= self.members:
            return False
        self.passed_term, self.proposed_term = self.proposed_term, None
        self.passed_total += 1
        return True
