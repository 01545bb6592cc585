"""A follower's log takes Raft's rule on append_entries (append_rule.py, replication.py),
not pysyncobj 0.3.17's, which deletes everything after the message's prevLogIdx.

The property test drives a real follower (replication.RaftReplica: pysyncobj, the patches,
the fsynced journal, on loopback ports) with a leader's messages delivered late, repeated
and out of order, after an old leader left it a tail of entries that were never committed,
and compares it after every message with Raft's receiver rule (Figure 2) over a plain list
of terms: the same log, the same acknowledgement, the same commit index, and only
committed entries applied."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raftstore import replication
from raftstore.append_rule import raft_append_rule
from raftstore.replication import RaftReplica
from tests.harness import wait_until
from tests.raft_members import Acks, RecordingHooks, deliver, one_follower


def _command(index: int, term: int) -> bytes:
    """The entry at `index` written in `term`: one content per (index, term), as in Raft."""
    return replication._TAG_REGULAR + f"entry {index} of term {term}".encode()


def _message(term: int, terms: list[int], prev: int, count: int, commit: int) -> dict[str, Any]:
    """An append_entries as pysyncobj's leader sends it (after unpickling), from a leader
    whose log holds `terms` (the term of index i at terms[i - 1])."""
    return {
        "type": "append_entries",
        "term": term,
        "commit_index": commit,
        "prevLogIdx": prev,
        "prevLogTerm": terms[prev - 1],
        "entries": [
            (_command(i, terms[i - 1]), i, terms[i - 1]) for i in range(prev + 1, prev + 1 + count)
        ],
    }


@dataclass
class RaftFollowerModel:
    """Raft's AppendEntries receiver (Figure 2, rules 2-5) over a plain list of terms."""

    terms: list[int] = field(default_factory=lambda: [0])  # pysyncobj's first entry: NO_OP
    commit: int = 1  # pysyncobj's starting commit index; the NO_OP is applied by itself

    def receive(self, message: dict[str, Any]) -> tuple[bool, int]:
        prev = message["prevLogIdx"]
        if prev > len(self.terms) or self.terms[prev - 1] != message["prevLogTerm"]:
            return False, 0
        for _command_bytes, index, term in message["entries"]:
            if index <= len(self.terms):
                if self.terms[index - 1] == term:
                    continue
                del self.terms[index - 1 :]
            self.terms.append(term)
        end = prev + len(message["entries"])
        self.commit = max(self.commit, min(message["commit_index"], end))
        return True, end + 1


def _log_terms(replica: RaftReplica) -> list[int]:
    journal = replica._sync_obj._journal
    assert journal.index_at(0) == 1
    return journal.terms(1, len(journal))


@st.composite
def _histories(draw: st.DrawFn) -> tuple[list[int], int, list[int], list[tuple[int, int, int]]]:
    """A term-1 leader's committed entries; a term-2 leader's entries this follower got and
    that never committed (the new leader holds a prefix of them); a term-3 leader's log and
    windows of it, sent in any order, some more than once, with any commit index it may
    have had."""
    committed = draw(st.integers(0, 4))
    stale = draw(st.integers(0, 4))
    shared = draw(st.integers(0, stale))
    new = draw(st.integers(0, 5))
    old_terms = [0] + [1] * committed + [2] * stale
    leader_terms = [0] + [1] * committed + [2] * shared + [3] * new
    windows = []
    for _ in range(draw(st.integers(1, 8))):
        prev = draw(st.integers(1, len(leader_terms)))
        count = draw(st.integers(0, len(leader_terms) - prev))
        commit = draw(st.integers(1 + committed, len(leader_terms)))
        windows.append((prev, count, commit))
    return old_terms, committed, leader_terms, windows


@settings(deadline=None)
@given(history=_histories())
def test_a_follower_keeps_raft_s_log_under_late_repeated_and_reordered_messages(
    history: tuple[list[int], int, list[int], list[tuple[int, int, int]]],
) -> None:
    old_terms, committed, leader_terms, windows = history
    acks = Acks()
    model = RaftFollowerModel()
    with pytest.MonkeyPatch.context() as monkeypatch, one_follower(acks, monkeypatch) as replica:
        setup = [
            _message(1, old_terms, 1, committed, 1 + committed),
            _message(2, old_terms, 1 + committed, len(old_terms) - 1 - committed, 1 + committed),
        ]
        sent = setup + [_message(3, leader_terms, *window) for window in windows]
        for step, message in enumerate(sent):
            acks.sent.clear()
            success, next_index = model.receive(message)
            deliver(replica, message)
            where = f"after message {step} {_shape(message)}"
            assert _log_terms(replica) == model.terms, where
            assert acks.sent, where
            assert bool(acks.sent[-1].get("success")) == success, where
            if success:
                assert acks.sent[-1]["nextNodeIdx"] == next_index, where
            assert replica.commit_index == model.commit, where
        # Only committed entries are applied, and every one of them is (the tick thread).
        expected = [_command(i, model.terms[i - 1])[1:] for i in range(2, model.commit + 1)]
        hooks = replica.hooks
        assert isinstance(hooks, RecordingHooks)
        wait_until(lambda: len(hooks.applied) >= len(expected), timeout_s=10)
        assert hooks.applied == expected


def _shape(message: dict[str, Any]) -> str:
    indexes = [entry[1] for entry in message["entries"]]
    return (
        f"term={message['term']} prev={message['prevLogIdx']} entries={indexes} "
        f"commit={message['commit_index']}"
    )


def _terms_message(prev: int, prev_term: int, entries: list[tuple[int, int]]) -> dict[str, Any]:
    return {
        "type": "append_entries",
        "term": 3,
        "commit_index": 0,
        "prevLogIdx": prev,
        "prevLogTerm": prev_term,
        "entries": [(_command(index, term), index, term) for index, term in entries],
    }


def test_a_message_at_the_end_of_the_log_is_left_as_it_is() -> None:
    message = _terms_message(4, 3, [(5, 3), (6, 3)])
    plan = raft_append_rule(message, last_index=4, held_terms=[3])
    assert plan.message is message
    assert (plan.verified_end, plan.keep_tail) == (6, False)


def test_a_late_heartbeat_keeps_the_tail_it_does_not_cover() -> None:
    message = _terms_message(2, 3, [])
    plan = raft_append_rule(message, last_index=6, held_terms=[3])
    assert plan.message is message
    assert (plan.verified_end, plan.keep_tail) == (2, True)


def test_entries_already_held_are_dropped_and_the_rest_start_at_the_first_conflict() -> None:
    message = _terms_message(2, 3, [(3, 3), (4, 3), (5, 3)])
    plan = raft_append_rule(message, last_index=6, held_terms=[3, 3, 2, 2])
    assert plan.message["prevLogIdx"] == 3
    assert plan.message["prevLogTerm"] == 3
    assert [entry[1] for entry in plan.message["entries"]] == [4, 5]
    assert (plan.verified_end, plan.keep_tail) == (5, False)


def test_a_message_whose_prev_does_not_match_is_left_to_pysyncobj_s_refusal() -> None:
    message = _terms_message(2, 3, [(3, 3)])
    assert raft_append_rule(message, last_index=6, held_terms=[2, 2]).message is message
    assert raft_append_rule(message, last_index=6, held_terms=[]).message is message
