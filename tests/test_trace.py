"""raftstore/trace.py: the default records nothing; the recording trace correlates one entry's
hand-offs into stages, stays bounded, and writes its summary at close."""

from __future__ import annotations

import json
from pathlib import Path

from raftstore import trace


def test_the_default_trace_is_off_and_does_nothing(tmp_path: Path) -> None:
    quiet = trace.current()
    assert type(quiet) is trace.Trace
    assert not quiet.on
    quiet.proposed(b"x")
    quiet.journal_added(b"x", 1, 0.0, 1.0)
    quiet.close()
    assert not list(tmp_path.iterdir())


def test_a_leaders_entry_is_followed_through_every_stage(tmp_path: Path) -> None:
    recording = trace.RecordingTrace(tmp_path / "node1.json")
    command = b"entry"
    recording.proposed(command)
    started = trace.clock()
    recording.journal_added(command, 5, started, started + 0.001)
    recording.journal_synced(5, started + 0.001, started + 0.003)
    recording.follower_acked(5, started + 0.004)
    recording.applied(5, started + 0.005, started + 0.006, leader=True)
    recording.answered(5, started - 0.001, started + 0.007)
    recording.close()
    summary = json.loads((tmp_path / "node1.json").read_text())
    for stage in (
        "journal add (write)",
        "leader: propose -> journal add (queue, tick wake-up)",
        "fdatasync (journal)",
        "journal add -> durable (this node)",
        "leader: journal add -> first follower ack",
        "leader: journal add -> apply start (commit)",
        "apply (decode, state machine, data file, cache)",
        "gRPC Publish handler (total)",
        "leader: apply end -> Publish handler returns",
    ):
        assert summary[stage]["count"] == 1, stage
    assert abs(summary["fdatasync (journal)"]["p50_ms"] - 2.0) < 0.01


def test_a_follower_counts_entries_it_is_sent_again(tmp_path: Path) -> None:
    recording = trace.RecordingTrace(tmp_path / "f.json")
    recording.follower_handled(4, 0, 0.0, 0.002)
    recording.follower_handled(3, 2, 0.0, 0.001)
    summary = recording.summary()
    assert summary["follower: entries received"] == {"count": 7}
    assert summary["follower: entries received again (already held)"] == {"count": 2}


def test_stamps_of_entries_that_never_complete_stay_bounded(tmp_path: Path) -> None:
    recording = trace.RecordingTrace(tmp_path / "t.json")
    for index in range(3 * trace._PENDING_MAX):  # added, never applied (a lost leadership)
        recording.journal_added(b"", index, 0.0, 0.0)
        recording.proposed(bytes(8))
    assert len(recording._added) <= trace._PENDING_MAX
    assert len(recording._proposed) <= trace._PENDING_MAX


def test_the_timeline_is_written_beside_the_summary(tmp_path: Path) -> None:
    recording = trace.RecordingTrace(tmp_path / "node1-trace.json")
    recording.journal_added(b"c", 7, 1.0, 1.5)
    recording.entries_sent(7, 1.6)
    recording.entries_received(7, 1.7)
    recording.journal_synced(7, 1.8, 2.0)
    recording.follower_acked(7, 2.1)
    recording.applied(7, 2.2, 2.3, leader=True)
    recording.close()
    written = json.loads(trace.timeline_path(tmp_path / "node1-trace.json").read_text())
    assert written == {
        "sent": [[7, 1.6]],
        "received": [[7, 1.7]],
        "added": [[7, 1.5]],
        "durable": [[7, 2.0]],
        "acked": [[7, 2.1]],
        "apply": [[7, 2.2]],
    }


def test_timeline_events_stay_bounded(tmp_path: Path) -> None:
    recording = trace.RecordingTrace(tmp_path / "t.json")
    for index in range(trace._EVENTS_MAX + 10):
        recording.entries_sent(index, 0.0)
    assert len(recording._timeline["sent"]) == trace._EVENTS_MAX
