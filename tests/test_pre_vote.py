"""raftstore/pre_vote.py: who grants a pre-vote, and when a round passes; and how
replication.py answers pre-vote messages, malformed ones included."""

from __future__ import annotations

import functools
import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raftstore import replication
from raftstore.pre_vote import (
    PRE_VOTE,
    PRE_VOTE_GRANTED,
    LogPosition,
    PreVoteRound,
    should_grant,
)

pytestmark = pytest.mark.unit

OWN = LogPosition(term=3, index=100)


def grant(**overrides: object) -> bool:
    arguments: dict[str, object] = {
        "proposed_term": 4,
        "current_term": 3,
        "is_leader": False,
        "heard_leader_s_ago": None,
        "min_timeout_s": 1.0,
        "asker": OWN,
        "own": OWN,
    }
    arguments.update(overrides)
    return should_grant(**arguments)  # type: ignore[arg-type]


def test_a_member_that_hears_no_leader_grants_an_asker_as_up_to_date() -> None:
    assert grant()
    assert grant(heard_leader_s_ago=1.0)  # The minimum timeout has passed.
    assert grant(asker=LogPosition(4, 1))  # A later last term beats a longer log.


def test_a_member_that_still_hears_its_leader_says_nothing() -> None:
    assert not grant(heard_leader_s_ago=0.2)


def test_the_leader_never_grants() -> None:
    assert not grant(is_leader=True)


def test_an_asker_behind_in_log_or_term_is_refused() -> None:
    assert not grant(asker=LogPosition(3, 99))
    assert not grant(asker=LogPosition(2, 500))
    assert not grant(proposed_term=2)  # It would stand below this member's term.


def test_a_round_passes_once_with_a_majority_of_three() -> None:
    rounds = PreVoteRound()
    assert not rounds.start(current_term=7, members=3)
    assert rounds.granted("node2", 8, current_term=7)
    assert not rounds.granted("node3", 8, current_term=7)  # Passed already: once.
    assert rounds.take_pass(current_term=7)
    assert not rounds.take_pass(current_term=7)


def test_grants_of_an_older_round_or_after_the_term_moved_do_not_count() -> None:
    rounds = PreVoteRound()
    rounds.start(current_term=7, members=5)
    assert not rounds.granted("node2", 7, current_term=7)  # An older round's term.
    assert not rounds.granted("node2", 8, current_term=8)  # This member moved on: void.
    assert not rounds.granted("node3", 8, current_term=7)
    assert not rounds.take_pass(current_term=7)


def test_a_pass_is_stale_once_the_term_moved() -> None:
    rounds = PreVoteRound()
    rounds.start(current_term=7, members=3)
    rounds.granted("node2", 8, current_term=7)
    assert not rounds.take_pass(current_term=8)  # A leader of term 8 appeared meanwhile.


def test_a_lone_member_passes_at_once() -> None:
    assert PreVoteRound().start(current_term=0, members=1)


@given(
    members=st.integers(1, 7),
    grants=st.lists(st.sampled_from("abcdefg"), max_size=12),
)
def test_a_round_passes_exactly_when_distinct_grants_and_self_are_a_majority(
    members: int, grants: list[str]
) -> None:
    rounds = PreVoteRound()
    passed = rounds.start(current_term=1, members=members)
    seen: set[str] = set()
    for node in grants:
        if passed:
            break
        seen.add(node)
        passed = rounds.granted(node, 2, current_term=1)
    assert passed == (2 * (len(seen) + 1) > members)
    assert rounds.passed_total == int(passed)


# --- the adapter's message handling (replication.py), on a stand-in member ------------------


def _member(*, heard_leader_at: float | None = None, state: int = 0) -> tuple[Any, list[Any]]:
    sent: list[Any] = []
    member = SimpleNamespace(
        _replica=SimpleNamespace(rejoining=False, in_doubt=lambda: False),
        _journal=SimpleNamespace(bytes_total=0),
        raftCurrentTerm=3,
        _leader_heard_at=heard_leader_at,
        _pre_vote=PreVoteRound(),
        _SyncObj__raftState=state,
        _SyncObj__conf=SimpleNamespace(raftMinTimeout=1.0),
        _SyncObj__getCurrentLogTerm=lambda: 3,
        _SyncObj__getCurrentLogIndex=lambda: 10,
        _SyncObj__transport=SimpleNamespace(send=lambda node, message: sent.append(message)),
    )
    member._on_pre_vote = functools.partial(replication._SyncObj._on_pre_vote, member)
    member._on_pre_vote_granted = functools.partial(
        replication._SyncObj._on_pre_vote_granted, member
    )
    return member, sent


def _ask(term: int = 4, index: int = 10) -> dict[str, Any]:
    return {"type": PRE_VOTE, "term": term, "last_log_term": 3, "last_log_index": index}


def test_a_follower_without_a_leader_answers_a_pre_vote_with_a_grant() -> None:
    member, sent = _member()
    assert replication._on_message_received(member, "node2", _ask()) is None
    assert sent == [{"type": PRE_VOTE_GRANTED, "term": 4}]


def test_a_follower_that_hears_its_leader_or_a_shorter_log_gets_silence() -> None:
    member, sent = _member(heard_leader_at=time.monotonic())
    replication._on_message_received(member, "node2", _ask())
    member, sent_too = _member()
    replication._on_message_received(member, "node2", _ask(index=9))
    assert sent == sent_too == []


def test_a_malformed_pre_vote_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    member, sent = _member()
    with caplog.at_level(logging.WARNING):
        for garbage in ({"type": PRE_VOTE}, {**_ask(), "term": "x"}, {"type": PRE_VOTE_GRANTED}):
            assert replication._on_message_received(member, "node2", garbage) is None
    assert sent == []
    assert caplog.text.count("malformed") == 3


def test_the_grant_that_makes_a_majority_lets_the_member_stand_at_its_next_tick() -> None:
    member, _ = _member()
    member._replica.settings = SimpleNamespace(group_id=2)
    member._SyncObj__raftElectionDeadline = 123.0
    member._pre_vote.start(current_term=3, members=3)
    replication._on_message_received(member, "node2", {"type": PRE_VOTE_GRANTED, "term": 4})
    assert member._SyncObj__raftElectionDeadline == 0.0
    assert member._pre_vote.take_pass(current_term=3)
