"""A follower never advances its commit index on a snapshot message (replication.py): its
log is not matched against the leader's there, and a restarted node whose log still holds
an old lone leader's uncommitted entries would apply them (found by a seeded chaos run:
a replica served rows no other replica had)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from raftstore import replication

pytestmark = pytest.mark.unit


def _follower(commit_index: int) -> Any:
    replica = SimpleNamespace(rejoining=False, in_doubt=lambda: False)
    return SimpleNamespace(
        _replica=replica,
        _journal=SimpleNamespace(bytes_total=0),
        _SyncObj__raftCommitIndex=commit_index,
        raftCurrentTerm=0,
        _leader_heard_at=None,
        _SyncObj__raftNextIndex={},
    )


@pytest.fixture
def delivered(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(
        replication, "_original_on_message_received", lambda self, node, m: seen.append(m)
    )
    return seen


@pytest.mark.parametrize(
    "snapshot",
    [
        {"serialized": None},  # the leader's snapshot is not ready yet
        {"serialized": (b"chunk", 0, False)},  # one chunk of many
    ],
)
def test_a_snapshot_message_does_not_advance_the_commit_index(
    delivered: list[dict[str, Any]], snapshot: dict[str, Any]
) -> None:
    message = {"type": "append_entries", "term": 7, "commit_index": 500, **snapshot}
    replication._on_message_received(_follower(commit_index=120), "leader", message)
    assert delivered[-1]["commit_index"] == 120
    assert delivered[-1]["serialized"] == snapshot["serialized"]


def test_a_matched_append_entries_keeps_the_leaders_commit_index(
    delivered: list[dict[str, Any]],
) -> None:
    message = {
        "type": "append_entries",
        "term": 7,
        "commit_index": 500,
        "prevLogIdx": 499,
        "prevLogTerm": 7,
        "entries": [],
    }
    replication._on_message_received(_follower(commit_index=120), "leader", message)
    assert delivered[-1] is message
