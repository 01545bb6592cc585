"""Where an entry's time goes between the nodes: the nodes' trace timelines lined up.

Each node traced by `bench.experiment --trace` writes, beside its stage summary, a timeline
(raftstore/trace.py): when each append_entries was sent and received, each entry's journal
add ended, each fdatasync ended (and the last index it covered), the leader took a
follower's acknowledgement, and each apply started, on the machine's one monotonic clock.
For every entry the leader added, `hops` follows it to the follower that made it durable
first and back:

    leader add -> sent                 the leader encodes and sends the append_entries
    leader add -> follower received    ... and the follower wakes up, reads and decodes it
    follower received -> follower add  pysyncobj's handling and the journal write
    follower add -> follower durable   the follower's fdatasync (and what its tick did first)
    follower durable -> leader ack     the acknowledgement sent, a wake-up, received
    leader add -> leader durable       the leader's own fdatasync, beside the follower's
    leader ack -> apply start          the commit, once the leader is durable too

The per-node summary gives each node's own stages; only the timelines show the time spent
between processes (the sends, the wake-ups, the waits behind other work). A trace is one
per process and Raft indexes are per group: the timelines read as one group's while one
group takes the writes, as in bench.experiment (the HA group only).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from raftstore import trace

HOPS: Final = (
    "leader add -> its first append_entries sent",
    "leader add -> follower received it (send, wake-up, read, decode)",
    "follower received -> follower add (handling, journal write)",
    "follower add -> follower durable (its fdatasync)",
    "follower durable -> leader takes the ack (send, wake-up, receive)",
    "leader add -> leader durable (its own fdatasync, in parallel)",
    "leader takes the ack -> apply start (commit)",
    "leader add -> apply start (all of it)",
)


@dataclass(frozen=True)
class Covering:
    """Events that each cover every index up to theirs ("durable", "acked"), in time order:
    the first one at or after a time that covers an index."""

    indexes: list[int]
    times: list[float]
    reach: list[int]  # the highest index covered by the events up to each one

    @staticmethod
    def of(events: Sequence[tuple[int, float]]) -> Covering:
        reach, highest = [], -1
        for index, _ in events:
            highest = max(highest, index)
            reach.append(highest)
        return Covering([index for index, _ in events], [at for _, at in events], reach)

    def first_covering(self, index: int, after: float) -> float | None:
        """The time of the first event at or after `after` that covers `index`."""
        start = bisect.bisect_left(self.times, after)
        # Events before the first whose reach gets to `index` cannot cover it.
        start = max(start, bisect.bisect_left(self.reach, index))
        for position in range(start, len(self.times)):
            if self.indexes[position] >= index:
                return self.times[position]
        return None


def first_added(timeline: trace.Timeline) -> dict[int, float]:
    """Index -> when it was first added to this node's journal."""
    added: dict[int, float] = {}
    for index, at in timeline["added"]:
        added.setdefault(index, at)
    return added


def hops(leader: trace.Timeline, followers: Sequence[trace.Timeline]) -> dict[str, list[float]]:
    """Per hop (`HOPS`), its seconds for every entry the leader added and sent that a
    follower received, made durable and the leader applied. "The follower" is the one that
    made the entry durable first: its acknowledgement is the one the commit waited for."""
    leader_sent = Covering.of(leader.get("sent", []))
    leader_durable = Covering.of(leader["durable"])
    leader_acked = Covering.of(leader["acked"])
    applies = dict(reversed(leader["apply"]))  # index -> its first apply start
    views = [
        (first_added(f), Covering.of(f.get("received", [])), Covering.of(f["durable"]))
        for f in followers
    ]
    found: dict[str, list[float]] = {hop: [] for hop in HOPS}
    for index, added in first_added(leader).items():
        sent = leader_sent.first_covering(index, added)
        durable_here = leader_durable.first_covering(index, added)
        applied = applies.get(index)
        first: tuple[float, float, float] | None = None  # follower received, add, durable
        for follower_added, received, follower_durable in views:
            at = follower_added.get(index)
            got = received.first_covering(index, added)
            if at is None or got is None:
                continue
            durable = follower_durable.first_covering(index, at)
            if durable is not None and (first is None or durable < first[2]):
                first = (got, at, durable)
        if first is None or sent is None or durable_here is None or applied is None:
            continue
        acked = leader_acked.first_covering(index, first[2])
        if acked is None:
            continue
        got, follower_add, follower_durable_at = first
        spans = (
            sent - added,
            got - added,
            follower_add - got,
            follower_durable_at - follower_add,
            acked - follower_durable_at,
            durable_here - added,
            applied - acked,
            applied - added,
        )
        for hop, seconds in zip(HOPS, spans, strict=True):
            found[hop].append(seconds)
    return found


def load(summary_paths: Mapping[str, Path]) -> dict[str, trace.Timeline]:
    """Node alias -> its timeline, for the nodes that wrote one."""
    found = {}
    for alias, summary_path in summary_paths.items():
        path = trace.timeline_path(summary_path)
        if path.exists():
            raw = json.loads(path.read_text())
            found[alias] = {kind: [(int(i), float(t)) for i, t in raw[kind]] for kind in raw}
    return found


def report(found: Mapping[str, Sequence[float]]) -> list[str]:
    """Markdown rows: each hop's p50, p90 and count, in ms."""
    lines = ["| hop | p50 | p90 | count |", "|---|---:|---:|---:|"]
    for hop, seconds in found.items():
        if not seconds:
            continue
        ordered = sorted(seconds)
        p50, p90 = ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.9)]
        lines.append(f"| {hop} | {p50 * 1000:.2f} | {p90 * 1000:.2f} | {len(ordered)} |")
    return lines
