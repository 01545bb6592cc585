"""Where one Raft entry's time goes on this node: time stamps at each hand-off of the write path.

The node calls `current()` at each hand-off (propose -> journal add -> fdatasync -> first
follower ack -> apply -> Publish answered; on a follower: append_entries handled). The
default `Trace` records nothing and says so through `on`, so a call site costs one
attribute test per entry. `RecordingTrace` (installed when tuning.trace_file is set, for
bench.experiment --trace) keeps per-stage samples and writes their summary as JSON at
close, and beside it the node's timeline (`timeline_path`): the clock time of each
append_entries sent and received, each entry's journal add, each fdatasync (with the last
index it covered), each follower acknowledgement the leader took and each apply's start.
`clock` is CLOCK_MONOTONIC, one clock for every process of the machine, so
bench/timeline.py lines the nodes' timelines up: where an entry's time goes between them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Final

clock: Final = time.perf_counter
_SAMPLES_MAX: Final = 200_000  # per stage: bounded however long the node runs
_PENDING_MAX: Final = 10_000  # proposed/added/applied stamps kept for correlation
_EVENTS_MAX: Final = 200_000  # per kind of timeline event: bounded however long the node runs

Summary = dict[str, dict[str, float]]
# Timeline event kinds -> [index, clock time] pairs in the order they happened: "sent" (an
# append_entries up to the index went to a follower's socket), "received" (a follower
# decoded one, before handling it), "added" (an entry's journal add ended), "durable" (an
# fdatasync ended; the index is the last it covered), "acked" (the leader took a follower's
# acknowledgement up to the index), "apply" (an entry's apply started).
Timeline = dict[str, list[tuple[int, float]]]


def timeline_path(summary_path: Path) -> Path:
    """Where a node's timeline goes, beside its summary."""
    return summary_path.with_name(f"{summary_path.stem}-timeline.json")


class Trace:
    """Records nothing: the node's default."""

    on: bool = False

    def proposed(self, command: bytes) -> None:
        pass

    def journal_added(self, command: bytes, index: int, started: float, finished: float) -> None:
        pass

    def journal_synced(self, last_index: int, started: float, finished: float) -> None:
        pass

    def follower_handled(self, entries: int, again: int, started: float, finished: float) -> None:
        pass

    def follower_acked(self, covered_index: int, now: float) -> None:
        pass

    def entries_sent(self, last_index: int, now: float) -> None:
        pass

    def entries_received(self, last_index: int, now: float) -> None:
        pass

    def applied(self, index: int, started: float, finished: float, *, leader: bool) -> None:
        pass

    def answered(self, lsn: int, started: float, finished: float) -> None:
        pass

    def close(self) -> None:
        pass


class RecordingTrace(Trace):
    """Per-stage durations (seconds) of this node's write path, summarised into `path`."""

    on = True

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stages: dict[str, list[float]] = {}
        self._counters: dict[str, int] = {}
        self._proposed: dict[int, float] = {}  # id(command bytes) -> handed to Raft
        self._added: dict[int, float] = {}  # log index -> added to the journal
        self._applied: dict[int, float] = {}  # log index -> apply finished (leader)
        self._synced_to = 0  # highest index known durable here
        self._acked_to = 0  # highest index some follower acknowledged (leader)
        self._timeline: Timeline = {
            kind: [] for kind in ("sent", "received", "added", "durable", "acked", "apply")
        }

    def proposed(self, command: bytes) -> None:
        _bounded_put(self._proposed, id(command), clock())

    def journal_added(self, command: bytes, index: int, started: float, finished: float) -> None:
        self._note("journal add (write)", finished - started)
        proposed = self._proposed.pop(id(command), None)
        if proposed is not None:
            self._note("leader: propose -> journal add (queue, tick wake-up)", started - proposed)
        _bounded_put(self._added, index, finished)
        self._event("added", index, finished)

    def journal_synced(self, last_index: int, started: float, finished: float) -> None:
        self._note("fdatasync (journal)", finished - started)
        for index in range(max(self._synced_to + 1, last_index - _PENDING_MAX), last_index + 1):
            added = self._added.get(index)
            if added is not None:
                self._note("journal add -> durable (this node)", finished - added)
        self._synced_to = max(self._synced_to, last_index)
        self._event("durable", last_index, finished)

    def follower_handled(self, entries: int, again: int, started: float, finished: float) -> None:
        self._count("follower: entries received", entries)
        if again > 0:  # the follower truncates them and writes them again
            self._count("follower: entries received again (already held)", again)
        self._note("follower: handle append_entries (add+fsync+ack)", finished - started)

    def follower_acked(self, covered_index: int, now: float) -> None:
        first = max(self._acked_to + 1, covered_index - _PENDING_MAX)
        for index in range(first, covered_index + 1):
            added = self._added.get(index)
            if added is not None:
                self._note("leader: journal add -> first follower ack", now - added)
        self._acked_to = max(self._acked_to, covered_index)
        self._event("acked", covered_index, now)

    def entries_sent(self, last_index: int, now: float) -> None:
        self._event("sent", last_index, now)

    def entries_received(self, last_index: int, now: float) -> None:
        self._event("received", last_index, now)

    def applied(self, index: int, started: float, finished: float, *, leader: bool) -> None:
        self._event("apply", index, started)
        added = self._added.pop(index, None)
        if added is not None and leader:
            self._note("leader: journal add -> apply start (commit)", started - added)
        self._note("apply (decode, state machine, data file, cache)", finished - started)
        if leader:
            _bounded_put(self._applied, index, finished)

    def answered(self, lsn: int, started: float, finished: float) -> None:
        self._note("gRPC Publish handler (total)", finished - started)
        applied = self._applied.pop(lsn, None)
        if applied is not None:
            self._note("leader: apply end -> Publish handler returns", finished - applied)

    def summary(self) -> Summary:
        result: Summary = {name: {"count": value} for name, value in self._counters.items()}
        for stage, samples in self._stages.items():
            ordered = sorted(samples)
            result[stage] = {
                "count": len(ordered),
                "p50_ms": ordered[len(ordered) // 2] * 1000,
                "p90_ms": ordered[int(len(ordered) * 0.9)] * 1000,
                "mean_ms": sum(ordered) / len(ordered) * 1000,
                "total_s": sum(ordered),
            }
        return result

    def close(self) -> None:
        self._path.write_text(json.dumps(self.summary(), indent=1))
        timeline_path(self._path).write_text(json.dumps(self._timeline))

    def _event(self, kind: str, index: int, at: float) -> None:
        events = self._timeline[kind]
        if len(events) < _EVENTS_MAX:
            events.append((index, at))

    def _note(self, stage: str, seconds: float) -> None:
        samples = self._stages.setdefault(stage, [])
        if len(samples) < _SAMPLES_MAX:
            samples.append(seconds)

    def _count(self, name: str, value: int) -> None:
        self._counters[name] = self._counters.get(name, 0) + value


def _bounded_put(stamps: dict[int, float], key: int, value: float) -> None:
    # Entries that never complete (a lost leadership, a follower's index) must not pile up.
    if len(stamps) >= _PENDING_MAX:
        stamps.clear()
    stamps[key] = value


_current: Trace = Trace()


def current() -> Trace:
    """The node's trace (one per process, like logging's configuration)."""
    return _current


def install(trace: Trace) -> None:
    """Set once by Node at start, before any thread runs the write path."""
    global _current
    _current = trace
