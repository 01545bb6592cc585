"""A follower never advances its commit index on a snapshot message (replication.py): its
log is not matched against the leader's there, and a restarted node whose log still holds
an old lone leader's uncommitted entries would apply them (found by a seeded chaos run:
a replica served rows no other replica had). A real follower (tests/raft_members.py),
handed the messages as its tick thread would be."""

from __future__ import annotations

from typing import Any

import pytest

from raftstore import replication
from tests.raft_members import Acks, deliver, one_follower


def _append_entries(**fields: Any) -> dict[str, Any]:
    return {"type": "append_entries", "term": 7, **fields}


def _entries(first: int, count: int, term: int) -> list[tuple[bytes, int, int]]:
    return [
        (replication._TAG_REGULAR + b"entry %d" % index, index, term)
        for index in range(first, first + count)
    ]


@pytest.mark.parametrize(
    "snapshot",
    [
        {"serialized": None},  # the leader's snapshot is not ready yet
        {"serialized": (b"chunk", 0, False)},  # one chunk of many
    ],
)
def test_a_snapshot_message_does_not_advance_the_commit_index(
    monkeypatch: pytest.MonkeyPatch, snapshot: dict[str, Any]
) -> None:
    with one_follower(Acks(), monkeypatch) as replica:
        # An old leader's entries 2-4, of which only 2 committed.
        deliver(
            replica,
            _append_entries(commit_index=2, prevLogIdx=1, prevLogTerm=0, entries=_entries(2, 3, 5)),
        )
        assert replica.commit_index == 2
        deliver(replica, _append_entries(commit_index=500, **snapshot))
        assert replica.commit_index == 2


def test_a_matched_append_entries_takes_the_leaders_commit_index_up_to_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with one_follower(Acks(), monkeypatch) as replica:
        deliver(
            replica,
            _append_entries(commit_index=1, prevLogIdx=1, prevLogTerm=0, entries=_entries(2, 3, 7)),
        )
        deliver(replica, _append_entries(commit_index=3, prevLogIdx=4, prevLogTerm=7, entries=[]))
        assert replica.commit_index == 3
        deliver(replica, _append_entries(commit_index=500, prevLogIdx=4, prevLogTerm=7, entries=[]))
        assert replica.commit_index == 4
