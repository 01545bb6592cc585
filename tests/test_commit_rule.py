"""The leader's commit counts it only up to what its own fdatasyncs covered
(replication.commit_reach, _SyncObj._count_self_only_when_durable): its fdatasync runs on
the journal's helper thread while it sends and takes acknowledgements. Checked against a
plain model of Raft's rule (an entry of the current term is committed once a majority holds
it durably), for generated logs, match indexes and durable indexes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from raftstore import replication


def majority_holds(index: int, durable: int, matches: list[int]) -> bool:
    held = (durable >= index) + sum(match >= index for match in matches)
    return held * 2 > len(matches) + 1


@given(
    durable=st.integers(0, 30),
    matches=st.lists(st.integers(0, 30), min_size=0, max_size=6),
)
def test_commit_reach_is_the_highest_index_a_majority_holds(
    durable: int, matches: list[int]
) -> None:
    expected = max(
        (index for index in range(1, 31) if majority_holds(index, durable, matches)), default=0
    )
    assert replication.commit_reach(durable, matches) == expected


@dataclass
class _Journal:
    durable_index: int
    log_terms: list[int]  # of the entries at Raft index 1, 2, ...
    wake_wanted: bool = False

    def terms(self, index: int, count: int) -> list[int]:
        return self.log_terms[index - 1 : index - 1 + count] if index >= 1 else []

    def want_wake(self) -> None:
        self.wake_wanted = True


@dataclass
class _Log:
    stored: list[int] = field(default_factory=list)

    def setRaftCommitIndex(self, index: int) -> None:
        self.stored.append(index)


class _Leader:
    """The attributes of a pysyncobj leader that the commit rule reads and writes."""

    def __init__(
        self, terms: list[int], before: int, proposed: int, durable: int, matches: list[int]
    ) -> None:
        self._commit_before_tick = before
        self._SyncObj__raftCommitIndex = proposed
        self._SyncObj__leaderCommitIndex = proposed
        self._SyncObj__otherNodes = [f"node{n}" for n in range(len(matches))]
        self._SyncObj__raftMatchIndex = dict(zip(self._SyncObj__otherNodes, matches, strict=True))
        self._journal = _Journal(durable, terms)
        self._SyncObj__raftLog = _Log()
        self.raftCurrentTerm = terms[-1]

    _term_at = replication._SyncObj._term_at


@st.composite
def leaders(draw: Any) -> tuple[list[int], int, int, list[int]]:
    """A leader's log (terms, rising; the current term's entries at its end, at least its
    no-op), the commit index it had, its durable index and its followers' match indexes."""
    length = draw(st.integers(1, 20))
    old = draw(st.integers(0, length - 1))  # entries of earlier terms
    terms = sorted(draw(st.lists(st.integers(1, 4), min_size=old, max_size=old)))
    terms += [5] * (length - old)
    before = draw(st.integers(0, old))  # committed before this term's entries: it is legit
    durable = draw(st.integers(0, length))
    matches = draw(st.lists(st.integers(0, length), min_size=0, max_size=4))
    return terms, before, durable, matches


def pysyncobj_commit(terms: list[int], before: int, matches: list[int]) -> int:
    """syncobj.py's computation: the leader counted for every entry it holds."""
    commit = before
    for index in range(before + 1, len(terms) + 1):
        if not majority_holds(index, len(terms), matches):
            break
        if terms[index - 1] == terms[-1]:
            commit = index
    return commit


@given(leaders())
def test_the_leader_counts_itself_only_up_to_its_durable_index(
    leader: tuple[list[int], int, int, list[int]],
) -> None:
    terms, before, durable, matches = leader
    proposed = pysyncobj_commit(terms, before, matches)
    member = _Leader(terms, before, proposed, durable, matches)
    replication._SyncObj._count_self_only_when_durable(member)
    expected = max(
        (
            index
            for index in range(before + 1, proposed + 1)
            if majority_holds(index, durable, matches) and terms[index - 1] == terms[-1]
        ),
        default=before,
    )
    assert member._SyncObj__raftCommitIndex == expected
    assert member._SyncObj__leaderCommitIndex == expected
    assert member._SyncObj__raftLog.stored == ([] if expected == proposed else [expected])
    # Cut back: the tick thread must hear when the leader's own fdatasync returns.
    assert member._journal.wake_wanted == (expected != proposed)


def test_two_followers_commit_what_the_leader_has_not_synced_yet() -> None:
    member = _Leader([1, 1, 1], before=1, proposed=3, durable=1, matches=[3, 3])
    replication._SyncObj._count_self_only_when_durable(member)
    assert member._SyncObj__raftCommitIndex == 3


def test_one_follower_does_not_commit_what_the_leader_has_not_synced_yet() -> None:
    member = _Leader([1, 1, 1], before=1, proposed=3, durable=2, matches=[3, 0])
    replication._SyncObj._count_self_only_when_durable(member)
    assert member._SyncObj__raftCommitIndex == 2  # the leader's and one follower's copy
