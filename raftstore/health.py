"""Whether one group replica's state can be trusted, and why not. Pure values.

    HEALTHY ──environment error (ENOSPC, EMFILE, EIO...)──> STALLED ──cleared──> HEALTHY
    HEALTHY ──damage, or data behind a restored state──> REPAIRING ──swapped in──> HEALTHY
    REPAIRING ──no peer could help before the deadline──> FAILED ──retry worked──> HEALTHY

A replica that is not HEALTHY is *in doubt*: it serves no reads, subscriptions or writes
(ReplicaInDoubt), does not stand for election, hands leadership away, and acknowledges no
Raft entries. Its committed entries wait in its Raft log and are applied, in order, once it
is healthy again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class ReplicaState(enum.Enum):
    HEALTHY = "healthy"
    STALLED = "stalled"  # an environment error: retried with backoff, nothing lost
    REPAIRING = "repairing"  # fetching rows from peers into a side directory
    FAILED = "failed"  # repair could not finish; retried slowly, shown in status


@dataclass(frozen=True, slots=True)
class RepairProgress:
    """What a repair fetches: `tables` (name -> [offset_from, offset_to)) and how far."""

    tables: dict[str, tuple[int, int]] = field(default_factory=dict)
    rows_fetched: int = 0
    rows_wanted: int = 0
    source: str = ""  # the peer the last rows came from
    attempts: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "tables": {name: list(span) for name, span in sorted(self.tables.items())},
            "rows_fetched": self.rows_fetched,
            "rows_wanted": self.rows_wanted,
            "source": self.source,
            "attempts": self.attempts,
        }


@dataclass(frozen=True, slots=True)
class Health:
    state: ReplicaState = ReplicaState.HEALTHY
    reason: str = ""
    repair: RepairProgress | None = None

    @property
    def in_doubt(self) -> bool:
        return self.state is not ReplicaState.HEALTHY

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {"state": self.state.value, "reason": self.reason}
        if self.repair is not None:
            document["repair"] = self.repair.to_json()
        return document


HEALTHY = Health()
