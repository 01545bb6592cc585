"""raftstore/pre_vote.py: who grants a pre-vote, and when a round passes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raftstore.pre_vote import LogPosition, PreVoteRound, should_grant

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
