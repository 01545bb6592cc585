"""Raft's rule for a follower's log on a regular append_entries, as a rewrite of the message
pysyncobj's follower then handles.

pysyncobj 0.3.17's follower (syncobj.py, the `append_entries` branch of
`__onMessageReceived`) deletes every entry after the message's `prevLogIdx` whenever its log
holds any, and then adds the message's entries: a heartbeat (no entries) or a resend whose
`prevLogIdx` is behind the follower's log cuts entries the follower already holds and may
have acknowledged. Raft (Figure 2, AppendEntries receiver, rules 3-5) deletes only from the
first entry whose term conflicts with one of the message's, adds only the entries not
already in the log, and advances the commit index only up to the message's last entry.

On one ordered connection the two agree in effect (the leader's next message starts where
its last one ended), but a late or repeated message does not: its cut forces the follower
to write, fsync and acknowledge again what it had, and anything that acknowledged the cut
entries elsewhere (a second path to the follower's log) would have been told a falsehood.
`raft_append_rule` rewrites the message so pysyncobj's own code does what Raft says: the
entries the follower already holds with the same term are dropped from the message (its
`prevLogIdx`/`prevLogTerm` move to the last of them), so pysyncobj deletes only from a real
conflict; and when nothing new is left while the log goes on past the message, it says so,
so the caller keeps that tail (replication.py) and holds the commit index to the message's
end. Pure: the follower's terms are passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AppendPlan:
    """What the follower hands pysyncobj, and how far it may trust its log."""

    message: dict[str, Any]
    # The index of the message's last entry (its prevLogIdx when it has none): Raft's
    # commit bound, and what a success acknowledges.
    verified_end: int
    # True when the message adds nothing and the log goes on past `verified_end`: that tail
    # is kept (not deleted, not acknowledged, not committed by this message).
    keep_tail: bool


def raft_append_rule(
    message: dict[str, Any], last_index: int, held_terms: Sequence[int]
) -> AppendPlan:
    """The plan for a regular append_entries (one with `prevLogIdx`, no transmission).

    `last_index` is the index of the follower's last entry; `held_terms[i]` the term of its
    entry at `prevLogIdx + i`, for i from 0 up to min(last_index - prevLogIdx, number of
    the message's entries), or empty when it holds no entry at `prevLogIdx` (then, and when
    that entry's term differs from `prevLogTerm`, pysyncobj refuses the message as it is).
    """
    prev = int(message["prevLogIdx"])
    entries = message.get("entries") or []
    verified_end = prev + len(entries)
    untouched = AppendPlan(message, verified_end, keep_tail=False)
    if last_index <= prev or not held_terms or held_terms[0] != message["prevLogTerm"]:
        return untouched  # nothing past prevLogIdx to delete, or a refusal
    if any(int(entry[1]) != prev + 1 + i for i, entry in enumerate(entries)):
        return untouched  # a leader sends consecutive entries; anything else is not ours
    held = 0
    while held < len(entries) and held + 1 < len(held_terms):
        if int(held_terms[held + 1]) != int(entries[held][2]):
            break  # the first conflict: pysyncobj deletes from here, as Raft does
        held += 1
    if held:
        last_held = entries[held - 1]
        message = {
            **message,
            "prevLogIdx": int(last_held[1]),
            "prevLogTerm": int(last_held[2]),
            "entries": entries[held:],
        }
    keep_tail = held == len(entries) and last_index > verified_end
    return AppendPlan(message, verified_end, keep_tail)
