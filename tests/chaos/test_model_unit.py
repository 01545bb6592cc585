"""The chaos checks themselves, on hand-made histories: each catches what it must and
accepts what a correct cluster may legitimately do."""

from __future__ import annotations

import math
import random

import pytest

from tests.chaos.faults import journal_entry_spans, record_spans
from tests.chaos.model import (
    WRITER_SPAN,
    Append,
    Commit,
    Drop,
    Outcome,
    ReadHistory,
    check_committed_offset,
    check_replicas_identical,
    check_rows,
    check_subscriber,
)

pytestmark = pytest.mark.unit

W1 = WRITER_SPAN
W2 = 2 * WRITER_SPAN


def _append(first: int, count: int, outcome: Outcome = Outcome.ACKED, at: float = 1.0) -> Append:
    return Append("t", first, count, at, at + 0.1, outcome)


def test_rows_acknowledged_present_once_in_order_pass() -> None:
    appends = [_append(W1, 3), _append(W2, 2), _append(W1 + 3, 1)]
    assert check_rows("t", [W1, W1 + 1, W2, W1 + 2, W2 + 1, W1 + 3], appends) == []


def test_lost_duplicated_phantom_and_reordered_rows_are_named() -> None:
    appends = [_append(W1, 3)]
    assert "lost" in check_rows("t", [W1, W1 + 1], appends)[0]
    assert "duplicated" in check_rows("t", [W1, W1 + 1, W1 + 1, W1 + 2], appends)[0]
    assert "nobody sent" in check_rows("t", [W1, W1 + 1, W1 + 2, W2], appends)[0]
    assert "out of order" in check_rows("t", [W1, W1 + 2, W1 + 1], appends)[0]


def test_unknown_rows_may_be_absent_or_present_refused_ones_never() -> None:
    appends = [_append(W1, 2), _append(W1 + 2, 2, Outcome.UNKNOWN), _append(W1 + 4, 1)]
    assert check_rows("t", [W1, W1 + 1, W1 + 4], appends) == []
    assert check_rows("t", [W1, W1 + 1, W1 + 2, W1 + 3, W1 + 4], appends) == []
    refused = [_append(W1, 2, Outcome.REFUSED)]
    assert check_rows("t", [W1], refused) != []


def test_a_drop_excuses_only_rows_acknowledged_before_it_could_take_effect() -> None:
    before = _append(W1, 2, at=1.0)
    after = _append(W1 + 2, 2, at=5.0)
    drop = Drop("t", 2.0, 3.0, Outcome.ACKED)
    assert check_rows("t", [W1 + 2, W1 + 3], [before, after], [drop]) == []
    assert "lost" in check_rows("t", [], [before, after], [drop])[0]
    unknown = Drop("t", 2.0, 3.0, Outcome.UNKNOWN)
    assert unknown.effective_until_s == math.inf
    assert check_rows("t", [], [before, after], [unknown]) == []


def test_a_table_never_dropped_must_never_be_said_missing() -> None:
    said = "PublishAborted: aborted: request 1 of this pipeline failed first: table not found: 't'"
    missing = Append("t", W1 + 2, 2, 1.0, 1.1, Outcome.UNKNOWN, said)
    appends = [_append(W1, 2), missing]
    assert "told the table does not exist" in check_rows("t", [W1, W1 + 1], appends)[0]
    drop = Drop("t", 2.0, 3.0, Outcome.ACKED)
    assert check_rows("t", [], appends, [drop]) == []  # a churned table may be missing
    other = Append("t", W1 + 2, 2, 1.0, 1.1, Outcome.UNKNOWN, "SiteUnavailable: refused")
    assert check_rows("t", [W1, W1 + 1], [_append(W1, 2), other]) == []


def test_replicas_must_match_row_for_row() -> None:
    assert check_replicas_identical("t", {"a": [1, 2], "b": [1, 2]}) == []
    (problem,) = check_replicas_identical("t", {"a": [1, 2, 3], "b": [1, 3, 2]})
    assert "from offset 1" in problem


def test_subscriber_must_deliver_a_gap_free_duplicate_free_prefix() -> None:
    rows = [10, 11, 12, 13]
    assert check_subscriber("t", [(0, [10, 11]), (2, [12])], rows) == []
    assert "gap" in check_subscriber("t", [(0, [10]), (2, [12])], rows)[0]
    assert "repeat" in check_subscriber("t", [(0, [10, 11]), (1, [11])], rows)[0]
    assert "differs" in check_subscriber("t", [(0, [11])], rows)[0]


def test_committed_offset_is_the_last_acknowledged_or_a_later_unknown_one() -> None:
    commits = [
        Commit("t/a", 1, Outcome.ACKED),
        Commit("t/a", 2, Outcome.ACKED),
        Commit("t/a", 3, Outcome.UNKNOWN),
    ]
    assert check_committed_offset("t/a", {"n1": 2, "n2": 2}, commits) == []
    assert check_committed_offset("t/a", {"n1": 3, "n2": 3}, commits) == []
    assert check_committed_offset("t/a", {"n1": 1, "n2": 1}, commits) != []
    assert "disagree" in check_committed_offset("t/a", {"n1": 2, "n2": 3}, commits)[0]


def test_record_and_journal_spans_follow_the_documented_layouts() -> None:
    rng = random.Random(1)
    records = b""
    for length in (5, 0, 17):
        header = bytearray(48)
        header[8:12] = length.to_bytes(4, "little")
        records += bytes(header) + rng.randbytes(length)
    assert record_spans(records + b"\0" * 10) == [(0, 53), (53, 101), (101, 166)]
    journal = b"HSRJ\1\0\0\0"
    for index, length in ((7, 3), (8, 9), (2, 5)):  # the last: a reused segment's older one
        journal += b"\0" * 4 + length.to_bytes(4, "little") + index.to_bytes(8, "little")
        journal += b"\0" * 8 + rng.randbytes(length)
    assert journal_entry_spans(journal) == [(8, 35), (35, 68)]


def test_replica_reads_may_lag_but_never_diverge() -> None:
    history = ReadHistory("t")
    history.add("a", [1, 2])
    history.add("b", [1])
    history.add("c", None, "NodeUnavailable")
    assert history.check([1, 2, 3]) == []
    history.add("b", [1, 3])
    assert "differ from offset 1" in history.check([1, 2, 3])[0]
    corrupt = ReadHistory("t")
    corrupt.add("a", None, "CorruptionError")
    assert "failed with CorruptionError" in corrupt.check([])[0]
    longer = ReadHistory("t")
    longer.add("a", [1, 2, 3])
    assert "not a prefix" in longer.check([1, 2])[0]
