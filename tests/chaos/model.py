"""What the clients saw, and the pure checks of a cluster's final state against it.

Every row carries a globally unique key: `writer * WRITER_SPAN + n`, `n` growing in the
order the writer sent it. So a row names its writer, and a writer's rows must appear in
increasing key order on every replica.

An append's outcome is ACKED (the call returned), REFUSED (a typed error that says nothing
was applied) or UNKNOWN (a timeout, a lost leader, a deadline: its rows may or may not be
there). The checks are the linearizability consequences that hold for any interleaving:

- replicas of a table hold the same rows in the same order;
- no key twice, no key nobody sent, each writer's keys in send order;
- every ACKED row is present, unless a drop of its table may have taken effect after the
  append began (a drop that succeeded later, or failed with an unknown outcome).

No I/O here: the runners read the cluster and hand the rows in.
"""

from __future__ import annotations

import collections
import enum
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

WRITER_SPAN: Final = 1_000_000_000
EXAMPLES_MAX: Final = 5  # keys quoted per problem
# What TableNotFound says (hastream/errors.py), also inside a PublishAborted it caused.
NOT_FOUND_TEXT: Final = "table not found: "


class Outcome(enum.Enum):
    ACKED = "acked"
    REFUSED = "refused"  # nothing applied (a typed, definite refusal)
    UNKNOWN = "unknown"  # may or may not have been applied


def writer_of(key: int) -> int:
    return key // WRITER_SPAN


@dataclass(frozen=True, slots=True)
class Append:
    """One append call: rows with keys `[first_key, first_key + count)`."""

    table: str
    first_key: int
    count: int
    started_s: float  # time.monotonic() when the call began
    ended_s: float  # when it returned or raised
    outcome: Outcome
    error: str = ""

    @property
    def keys(self) -> range:
        return range(self.first_key, self.first_key + self.count)


@dataclass(frozen=True, slots=True)
class Drop:
    """One drop call of `table`. A drop with an UNKNOWN outcome may take effect at any time
    until the end of the run."""

    table: str
    started_s: float
    ended_s: float
    outcome: Outcome

    @property
    def effective_until_s(self) -> float:
        """The latest moment this drop may have taken effect."""
        if self.outcome is Outcome.REFUSED:
            return -math.inf
        return self.ended_s if self.outcome is Outcome.ACKED else math.inf


@dataclass(frozen=True, slots=True)
class Commit:
    """One offset commit of `topic`."""

    topic: str
    offset: int
    outcome: Outcome


@dataclass
class Ledger:
    """Everything the clients did, from any thread."""

    appends: list[Append] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, event: Append | Drop | Commit) -> None:
        with self._lock:
            if isinstance(event, Append):
                self.appends.append(event)
            elif isinstance(event, Drop):
                self.drops.append(event)
            else:
                self.commits.append(event)

    def appends_of(self, table: str) -> list[Append]:
        with self._lock:
            return [append for append in self.appends if append.table == table]

    def drops_of(self, table: str) -> list[Drop]:
        with self._lock:
            return [drop for drop in self.drops if drop.table == table]

    def commits_of(self, topic: str) -> list[Commit]:
        with self._lock:
            return [commit for commit in self.commits if commit.topic == topic]

    def acked_rows(self) -> int:
        with self._lock:
            return sum(a.count for a in self.appends if a.outcome is Outcome.ACKED)


def _examples(keys: Iterable[int]) -> str:
    return str(sorted(keys)[:EXAMPLES_MAX])


def check_replicas_identical(table: str, rows_by_alias: dict[str, list[int]]) -> list[str]:
    """Every replica holds the same keys in the same order."""
    problems: list[str] = []
    if not rows_by_alias:
        return problems
    reference_alias = min(rows_by_alias)
    reference = rows_by_alias[reference_alias]
    for alias, rows in sorted(rows_by_alias.items()):
        if rows == reference:
            continue
        diverge = next(
            (i for i, (a, b) in enumerate(zip(rows, reference, strict=False)) if a != b),
            min(len(rows), len(reference)),
        )
        problems.append(
            f"{table}: {alias} ({len(rows)} rows) differs from {reference_alias} "
            f"({len(reference)} rows) from offset {diverge}: "
            f"{rows[diverge : diverge + 3]} vs {reference[diverge : diverge + 3]}"
        )
    return problems


def check_rows(
    table: str, rows: Sequence[int], appends: Sequence[Append], drops: Sequence[Drop] = ()
) -> list[str]:
    """One replica's keys of `table` against what was sent (see the module docstring).
    `rows` is empty when the table does not exist at the end."""
    problems: list[str] = []
    present = set(rows)
    if len(present) != len(rows):
        twice = [key for key, count in collections.Counter(rows).items() if count > 1]
        problems.append(
            f"{table}: {len(rows) - len(present)} duplicated rows, e.g. {_examples(twice)}"
        )
    sent: set[int] = set()
    for append in appends:
        if append.outcome is not Outcome.REFUSED:
            sent.update(append.keys)
    phantoms = present - sent
    if phantoms:
        problems.append(
            f"{table}: {len(phantoms)} rows nobody sent (or refused), e.g. {_examples(phantoms)}"
        )
    problems += _check_writer_order(table, rows)
    problems += _check_acked_present(table, present, appends, drops)
    problems += _check_never_said_missing(table, appends, drops)
    return problems


def _check_never_said_missing(
    table: str, appends: Sequence[Append], drops: Sequence[Drop]
) -> list[str]:
    """A table created before its writers started and never dropped exists throughout: no
    node may answer one of its appends "table not found" (a lagging replica or a leader
    still replaying sends the client on instead)."""
    if drops:
        return []
    said = [append for append in appends if NOT_FOUND_TEXT in append.error]
    if not said:
        return []
    return [
        f"{table}: {len(said)} appends were told the table does not exist, e.g. "
        f"{said[0].error!r} at {said[0].ended_s:.1f}s"
    ]


def _check_writer_order(table: str, rows: Sequence[int]) -> list[str]:
    last_by_writer: dict[int, tuple[int, int]] = {}  # writer -> (key, offset)
    for offset, key in enumerate(rows):
        writer = writer_of(key)
        previous = last_by_writer.get(writer)
        if previous is not None and key <= previous[0]:
            return [
                f"{table}: writer {writer}'s rows out of order: key {key} at offset {offset} "
                f"after key {previous[0]} at offset {previous[1]}"
            ]
        last_by_writer[writer] = (key, offset)
    return []


def _check_acked_present(
    table: str, present: set[int], appends: Sequence[Append], drops: Sequence[Drop]
) -> list[str]:
    last_drop_s = max((drop.effective_until_s for drop in drops), default=-math.inf)
    lost: list[int] = []
    for append in appends:
        if append.outcome is not Outcome.ACKED or append.started_s < last_drop_s:
            continue  # not acknowledged, or a drop may have removed it legitimately
        lost += [key for key in append.keys if key not in present]
    if not lost:
        return []
    return [f"{table}: {len(lost)} acknowledged rows lost, e.g. {_examples(lost)}"]


def check_subscriber(
    table: str, deliveries: Sequence[tuple[int, list[int]]], rows: Sequence[int]
) -> list[str]:
    """A subscriber's handler calls `(first_offset, keys)` must form a gap-free,
    duplicate-free prefix of the table's rows, in order."""
    expected_offset = deliveries[0][0] if deliveries else 0
    if expected_offset != 0:
        return [f"{table}: subscriber's first delivery starts at offset {expected_offset}"]
    for number, (first_offset, keys) in enumerate(deliveries):
        if first_offset != expected_offset:
            kind = "gap" if first_offset > expected_offset else "repeat"
            return [
                f"{table}: subscriber delivery {number} starts at offset {first_offset}, "
                f"expected {expected_offset} (a {kind})"
            ]
        if list(rows[first_offset : first_offset + len(keys)]) != keys:
            return [
                f"{table}: subscriber delivery {number} at offset {first_offset} "
                f"({len(keys)} rows) differs from the replicas' rows there"
            ]
        expected_offset += len(keys)
    return []


def check_committed_offset(
    topic: str, offsets: dict[str, int | None], commits: Sequence[Commit]
) -> list[str]:
    """Every replica holds the same persisted offset of `topic`: the last acknowledged
    commit, or a later one whose outcome is unknown (commits go out in increasing order
    from one client, so an earlier one cannot be the last applied)."""
    values = set(offsets.values())
    if len(values) > 1:
        return [f"{topic}: replicas disagree on the committed offset: {offsets}"]
    last_acked = max(
        (index for index, commit in enumerate(commits) if commit.outcome is Outcome.ACKED),
        default=None,
    )
    if last_acked is None:
        return []
    allowed = {
        commit.offset for commit in commits[last_acked:] if commit.outcome is not Outcome.REFUSED
    }
    value = values.pop() if values else None
    if value not in allowed:
        return [f"{topic}: committed offset {value}, expected one of {sorted(allowed)}"]
    return []


# Errors a replica may answer a read with: it is down or starting, or says "not here, not
# now" (retryable: NodeUnavailable, or ReplicaInDoubt while an environment error stalls it or
# a repair runs). Never TableNotFound: the tables read exist throughout, and a replica that
# has not applied one (or is reopening its files) sends the reader on instead.
READ_ERRORS_ALLOWED: Final = frozenset(
    {
        "StatusCode.UNAVAILABLE",
        # A node stopping (SIGTERM) cancels the streams in flight; the client's transport
        # takes CANCELLED as SiteUnavailable and reads elsewhere.
        "StatusCode.CANCELLED",
        "StatusCode.DEADLINE_EXCEEDED",
        "NodeUnavailable",
        "ReplicaInDoubt",
        "NotLeader",
    }
)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first offset where `a` and `b` differ within the shorter one; None if one is a
    prefix of the other."""
    for offset, (left, right) in enumerate(zip(a, b, strict=False)):
        if left != right:
            return offset
    return None


@dataclass
class ReadHistory:
    """Whole-table reads of one table from any replica during a run. A replica may lag but
    never diverge: every answer is a prefix of every longer one (so only the longest is
    kept), and at the end a prefix of the table's final rows."""

    table: str
    longest: list[int] = field(default_factory=list)
    longest_from: str = ""
    reads: int = 0
    divergent_reads: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    problems: list[str] = field(default_factory=list)

    def add(self, alias: str, keys: list[int] | None, error: str = "") -> None:
        self.reads += 1
        if keys is None:
            self.errors[error] += 1
            if error not in READ_ERRORS_ALLOWED and self.errors[error] == 1:
                self.problems.append(f"{self.table}: a read on {alias} failed with {error}")
            return
        offset = first_difference(keys, self.longest)
        if offset is not None and len(self.problems) >= EXAMPLES_MAX:
            self.divergent_reads += 1
        elif offset is not None:
            self.divergent_reads += 1
            self.problems.append(
                f"{self.table}: a read on {alias} ({len(keys)} rows) and one on "
                f"{self.longest_from} ({len(self.longest)} rows) differ from offset {offset}"
            )
        elif len(keys) > len(self.longest):
            self.longest, self.longest_from = keys, alias

    def check(self, rows: Sequence[int]) -> list[str]:
        problems = list(self.problems)
        if self.divergent_reads > len(self.problems):
            problems.append(f"{self.table}: {self.divergent_reads} divergent reads in all")
        offset = first_difference(self.longest, rows)
        if offset is not None or len(self.longest) > len(rows):
            return [
                *problems,
                f"{self.table}: a read on {self.longest_from} ({len(self.longest)} rows) is "
                f"not a prefix of the final {len(rows)} rows (from offset {offset})",
            ]
        return problems
