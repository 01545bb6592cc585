"""Retention's schedule (raftstore/retention.py): `due` says what `run_if_due` would do,
so the applier's tick lists its stores only when a run is due."""

from __future__ import annotations

from raftstore.retention import Retention


def test_due_says_whether_run_if_due_would_run() -> None:
    now = [100.0]
    retention = Retention(interval_s=60.0, monotonic=lambda: now[0], wall_ms=lambda: 0)
    assert not retention.due()  # the first run is an interval after the start
    now[0] += 59.9
    assert not retention.due()
    now[0] += 0.1
    assert retention.due()
    retention.run_if_due([])
    assert not retention.due()  # ran: the next one is an interval away
    now[0] += 60.0
    assert retention.due()
