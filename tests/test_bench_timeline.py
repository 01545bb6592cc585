"""bench/timeline.py: the nodes' trace timelines lined up entry by entry, the follower whose
fdatasync ended first taken as the one the commit waited for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import timeline
from raftstore import trace


def _leader(index: int, base: float) -> trace.Timeline:
    return {
        "added": [(index, base)],
        "sent": [(index, base + 0.1), (index, base + 0.15)],  # one send per follower
        "received": [],
        "durable": [(index, base + 0.9)],
        "acked": [(index - 1, base + 0.5), (index, base + 1.3)],  # an older ack first
        "apply": [(index, base + 1.4)],
    }


def _follower(index: int, base: float, *, received: float, durable: float) -> trace.Timeline:
    return {
        "sent": [],
        "received": [(index, base + received)],
        "added": [(index, base + received + 0.05)],
        "durable": [(index - 1, base), (index, base + durable)],
        "acked": [],
        "apply": [],
    }


def test_an_entry_is_followed_to_the_first_durable_follower_and_back() -> None:
    leader = _leader(5, 10.0)
    slow = _follower(5, 10.0, received=0.2, durable=1.2)
    fast = _follower(5, 10.0, received=0.3, durable=1.0)
    found = timeline.hops(leader, [slow, fast])
    expected = [0.1, 0.3, 0.05, 0.65, 0.3, 0.9, 0.1, 1.4]
    for hop, seconds in zip(timeline.HOPS, expected, strict=True):
        assert found[hop] == [pytest.approx(seconds)], hop


def test_entries_a_node_never_saw_through_are_left_out() -> None:
    leader = _leader(5, 10.0)
    leader["apply"] = []  # never applied: a lost leadership
    assert all(
        not seconds
        for seconds in timeline.hops(
            leader, [_follower(5, 10.0, received=0.2, durable=1.0)]
        ).values()
    )
    unacked = _leader(5, 10.0)
    unacked["acked"] = [(4, 10.5)]
    follower = _follower(5, 10.0, received=0.2, durable=1.0)
    assert all(not seconds for seconds in timeline.hops(unacked, [follower]).values())


def test_load_reads_what_the_trace_wrote_and_report_gives_a_row_per_hop(tmp_path: Path) -> None:
    summary = tmp_path / "node1-trace.json"
    recording = trace.RecordingTrace(summary)
    recording.journal_added(b"c", 3, 0.0, 1.0)
    recording.close()
    loaded = timeline.load({"node1": summary, "node2": tmp_path / "node2-trace.json"})
    assert list(loaded) == ["node1"]
    assert loaded["node1"]["added"] == [(3, 1.0)]
    assert json.loads(summary.read_text())["journal add (write)"]["count"] == 1
    rows = timeline.report({timeline.HOPS[0]: [0.001, 0.002, 0.003], timeline.HOPS[1]: []})
    assert rows[2] == f"| {timeline.HOPS[0]} | 2.00 | 3.00 | 3 |"
    assert len(rows) == 3
