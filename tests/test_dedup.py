"""dedup.py: the key window (last N rows' keys) and the producer window."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raftstore.dedup import KeyWindow, ProducerRecord, ProducerWindow
from raftstore.key_table import KeyTable, first_occurrences, last_occurrences


def _keep(window: KeyWindow, keys: list[Any], key_type: pa.DataType | None = None) -> list[bool]:
    """filter + add, the way the state machine uses the window; returns the mask."""
    array = pa.array(keys, type=key_type or pa.int64())
    mask = window.filter(array, window.offset_to)
    window.add(array.filter(mask), window.offset_to)
    result: list[bool] = mask.to_pylist()
    return result


# --- KeyWindow -------------------------------------------------------------------------


@pytest.mark.unit
def test_new_keys_are_kept_and_known_keys_dropped() -> None:
    window = KeyWindow(10)
    assert _keep(window, [1, 2, 3]) == [True, True, True]
    assert _keep(window, [3, 4, 1]) == [False, True, False]
    assert window.offset_to == 4
    assert window.entries() == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.unit
def test_duplicates_within_a_batch_keep_the_first() -> None:
    window = KeyWindow(10)
    assert _keep(window, [5, 5, 6, 5, 6]) == [True, False, True, False, False]
    assert window.entries() == [(0, 5), (1, 6)]


@pytest.mark.unit
def test_null_is_a_key_like_any_other() -> None:
    window = KeyWindow(10)
    assert _keep(window, [None, 1, None]) == [True, True, False]
    assert _keep(window, [None, 2]) == [False, True]


@pytest.mark.unit
def test_every_nan_is_one_key() -> None:
    window = KeyWindow(10)
    nan = float("nan")
    assert _keep(window, [nan, 1.0, nan], pa.float64()) == [True, True, False]
    assert _keep(window, [nan], pa.float64()) == [False]


@pytest.mark.unit
def test_string_dictionary_and_timestamp_keys() -> None:
    window = KeyWindow(10)
    assert _keep(window, ["a", "b", "a"], pa.string()) == [True, True, False]
    dictionary = pa.array(["b", "c"]).dictionary_encode()
    mask = window.filter(dictionary, window.offset_to)
    assert mask.to_pylist() == [False, True]
    far_future = KeyWindow(10)  # beyond year 9999: no Python datetime, still a key
    assert _keep(far_future, [2**62, 2**62, 0], pa.timestamp("ms")) == [True, False, True]


@pytest.mark.unit
def test_chunked_keys_are_accepted() -> None:
    window = KeyWindow(10)
    keys = pa.chunked_array([[1, 2], [2, 3]])
    assert window.filter(keys, 0).to_pylist() == [True, True, False, True]


@pytest.mark.unit
def test_eviction_boundary_is_exactly_window_rows() -> None:
    window = KeyWindow(3)
    assert _keep(window, [1, 2, 3]) == [True, True, True]
    assert window.offset_from == 0
    assert _keep(window, [4]) == [True]  # rows 0..3; the window is rows [1, 4)
    assert (window.offset_from, window.offset_to) == (1, 4)
    assert window.filter(pa.array([1, 2]), 4).to_pylist() == [True, False]
    assert len(window) == 3


@pytest.mark.unit
def test_window_does_not_slide_within_a_batch() -> None:
    window = KeyWindow(2)
    _keep(window, [1, 2])
    # 1 is among the last 2 rows before the batch, so it is dropped even though two new
    # rows come before it in the batch.
    assert _keep(window, [3, 4, 1]) == [True, True, False]


@pytest.mark.unit
def test_batch_larger_than_the_window_keeps_only_its_last_rows() -> None:
    window = KeyWindow(2)
    assert _keep(window, [1, 2, 3, 4]) == [True] * 4
    assert window.entries() == [(2, 3), (3, 4)]
    assert _keep(window, [1, 2, 3]) == [True, True, False]


@pytest.mark.unit
def test_filter_is_pure() -> None:
    window = KeyWindow(5)
    _keep(window, [1])
    window.filter(pa.array([2, 3]), 1)
    assert window.entries() == [(0, 1)]
    assert window.offset_to == 1


@pytest.mark.unit
def test_rebuild_keeps_only_the_last_window_rows() -> None:
    window = KeyWindow(3)
    window.rebuild(pa.array([1, 2, 3, 4, 5]), 10)
    assert window.entries() == [(12, 3), (13, 4), (14, 5)]
    assert window.offset_to == 15
    assert window.filter(pa.array([2, 3]), 15).to_pylist() == [True, False]


@pytest.mark.unit
def test_rebuild_with_repeated_keys_keeps_the_latest_occurrence() -> None:
    # Repeats only happen after the window grew; the key stays until its last row leaves.
    window = KeyWindow(3)
    window.rebuild(pa.array([7, 8, 7]), 0)
    _keep(window, [9])  # evicts row 0 (7); 7 is still at row 2
    assert 7 in window
    _keep(window, [10])  # evicts row 1 (8)
    assert 8 not in window
    _keep(window, [11])  # evicts row 2 (7)
    assert 7 not in window


@pytest.mark.unit
def test_offsets_must_be_contiguous() -> None:
    window = KeyWindow(3)
    _keep(window, [1])
    with pytest.raises(AssertionError):
        window.filter(pa.array([2]), 5)
    with pytest.raises(AssertionError):
        window.add(pa.array([2]), 0)


@pytest.mark.property
@given(
    window_rows=st.integers(1, 8),
    batches=st.lists(st.lists(st.none() | st.integers(0, 12), max_size=6), max_size=12),
)
def test_incremental_window_matches_model_and_rebuild(
    window_rows: int, batches: list[list[int | None]]
) -> None:
    window = KeyWindow(window_rows)
    rows: list[int | None] = []  # The table: kept keys in offset order.
    for batch in batches:
        recent = set(rows[-window_rows:]) if rows else set()
        expected: list[bool] = []
        seen: set[int | None] = set()
        for key in batch:
            expected.append(key not in recent and key not in seen)
            seen.add(key)
        assert _keep(window, batch) == expected
        rows.extend(key for key, keep in zip(batch, expected, strict=True) if keep)
        assert window.offset_to == len(rows)
        assert window.offset_from == max(0, len(rows) - window_rows)

    first_offset = max(0, len(rows) - window_rows)
    rebuilt = KeyWindow(window_rows)
    rebuilt.rebuild(pa.array(rows[first_offset:], type=pa.int64()), first_offset)
    assert rebuilt.entries() == window.entries()
    whole = KeyWindow(window_rows)
    whole.rebuild(pa.array(rows, type=pa.int64()), 0)
    assert whole.entries() == window.entries()
    probe = [None, *range(13)]
    assert _keep(rebuilt, probe) == _keep(window, probe)
    assert rebuilt.entries() == window.entries()


@pytest.mark.unit
@given(
    window_rows=st.integers(1, 8),
    batches=st.lists(st.lists(st.none() | st.integers(0, 12), max_size=6), max_size=12),
)
def test_admit_is_filter_then_add(window_rows: int, batches: list[list[int | None]]) -> None:
    """`admit` (what the state machine calls) answers and learns as filter + add do."""
    admitted, reference = KeyWindow(window_rows), KeyWindow(window_rows)
    for batch in batches:
        array = pa.array(batch, type=pa.int64())
        mask = admitted.admit(array, admitted.offset_to)
        kept = [True] * len(batch) if mask is None else mask.to_pylist()
        assert kept == _keep(reference, batch)
        assert admitted.entries() == reference.entries()
        assert (admitted.offset_from, admitted.offset_to) == (
            reference.offset_from,
            reference.offset_to,
        )


@pytest.mark.property
@given(
    window_rows=st.integers(1, 40),
    steps=st.lists(
        st.one_of(
            st.lists(st.none() | st.integers(-20, 60), max_size=30),
            st.integers(0, 80).map(lambda rows: ("rebuild", rows)),
        ),
        max_size=25,
    ),
)
def test_integer_and_python_windows_answer_alike(
    window_rows: int, steps: list[list[int | None] | tuple[str, int]]
) -> None:
    """Integer keys go to the vectorized window, the same keys as strings to the dict one:
    every mask, bound and entry agrees, through rebuilds from the table's last rows."""
    integers, strings = KeyWindow(window_rows), KeyWindow(window_rows)
    rows: list[int | None] = []  # The table: kept keys in offset order.
    for step in steps:
        if isinstance(step, tuple):
            first = max(0, len(rows) - step[1])
            integers.rebuild(pa.array(rows[first:], type=pa.int64()), first)
            strings.rebuild(pa.array([_text(key) for key in rows[first:]], pa.string()), first)
        else:
            kept = integers.admit(pa.array(step, type=pa.int64()), len(rows))
            as_text = strings.admit(pa.array([_text(key) for key in step], pa.string()), len(rows))
            assert (kept is None) == (as_text is None)
            mask = [True] * len(step) if kept is None else kept.to_pylist()
            assert as_text is None or as_text.to_pylist() == mask
            rows.extend(key for key, keep in zip(step, mask, strict=True) if keep)
        assert (integers.offset_from, integers.offset_to, len(integers)) == (
            strings.offset_from,
            strings.offset_to,
            len(strings),
        )
        assert integers.offset_to == len(rows)
        assert [(offset, _text(key)) for offset, key in integers.entries()] == strings.entries()
        for probe in (None, -20, 0, 7, 60):
            assert (probe in integers) == (_text(probe) in strings)


@pytest.mark.unit
def test_integer_windows_of_every_width_and_temporal_type() -> None:
    for key_type, keys in (
        (pa.int8(), [-128, 127, -128, None, 5, None]),
        (pa.uint64(), [2**64 - 1, 0, 2**64 - 1, 2**63, None]),
        (pa.date32(), [0, 19000, 0, None]),
        (pa.timestamp("ns"), [2**62, -(2**62), 2**62, None]),
        (pa.duration("s"), [1, 1, 2]),
    ):
        window = KeyWindow(100)
        array = pa.array(keys, type=key_type)
        expected = [key not in keys[:index] for index, key in enumerate(keys)]
        assert window.filter(array, 0).to_pylist() == expected, key_type
        assert window.admit(array, 0) is not None
        assert window.admit(array, window.offset_to).to_pylist() == [False] * len(keys)
        stored = [key for key, keep in zip(keys, expected, strict=True) if keep]
        assert [key for _, key in window.entries()] == stored, key_type  # temporal: storage
    large = KeyWindow(10)
    large.admit(pa.array([2**64 - 1], type=pa.uint64()), 0)
    assert 2**64 - 1 in large
    assert large.entries() == [(0, 2**64 - 1)]
    chunked = KeyWindow(10)
    mask = chunked.admit(pa.chunked_array([[1, 2], [2, None], [None]]), 0)
    assert mask is not None
    assert mask.to_pylist() == [True, True, False, True, False]
    dictionary = KeyWindow(10)
    assert dictionary.filter(pa.array([3, 4, 3]).dictionary_encode(), 0).to_pylist() == [
        True,
        True,
        False,
    ]


@pytest.mark.property
@given(
    batches=st.lists(
        st.lists(
            st.integers(-(2**63), 2**63 - 1)
            | st.integers(0, 300)
            | st.integers(-3000, 3000)
            | st.integers(2**62, 2**62 + 5000),
            max_size=200,
        ),
        max_size=12,
    )
)
def test_key_table_matches_a_dict(batches: list[list[int]]) -> None:
    """Lookups and upserts through every growth of the table, against a dict."""
    table, model = KeyTable(), {}
    for offset, batch in enumerate(batches):
        keys = np.array(batch, dtype=np.int64)
        assert table.lookup(keys).tolist() == [model.get(key, -1) for key in batch]
        last = last_occurrences(keys)
        assert sorted(set(batch)) == sorted(keys[last].tolist())
        first = first_occurrences(keys).tolist()
        assert first == [key not in batch[:index] for index, key in enumerate(batch)]
        offsets = np.arange(len(last), dtype=np.int64) + offset * 1000
        table.upsert(keys[last], offsets)
        model.update(zip(keys[last].tolist(), offsets.tolist(), strict=True))
        assert len(table) == len(model)
    held_keys, held_offsets = table.items()
    assert dict(zip(held_keys.tolist(), held_offsets.tolist(), strict=True)) == model


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(6))
def test_integer_window_matches_the_dict_window_at_scale(seed: int) -> None:
    """Thousands of rows per batch, windows of up to 5,000 rows: rising ranges that
    overlap (dense blocks), random keys (hashing), the two mixed (a table turning from one
    to the other), nulls, and rebuilds from the table's last rows. Seeded: a failure
    names its seed."""
    rng = np.random.default_rng(seed)
    window_rows = int(rng.integers(1, 5000))
    integers, strings = KeyWindow(window_rows), KeyWindow(window_rows)
    rows: list[int | None] = []
    rising = 0
    for step in range(40):
        count = int(rng.integers(0, 3000))
        shape = (seed + step // 10) % 3
        if shape == 0:
            keys = rng.integers(0, 20_000, count)
        elif shape == 1:
            keys = np.arange(rising, rising + count) - rng.integers(0, 50, count)
            rising += count
        else:
            keys = rng.integers(-(2**63), 2**63 - 1, count, dtype=np.int64)
        nulls = rng.random(count) < 0.01
        as_list = [None if null else int(key) for key, null in zip(keys, nulls, strict=True)]
        if rng.random() < 0.1:
            first = max(0, len(rows) - int(rng.integers(0, 2 * window_rows)))
            integers.rebuild(pa.array(rows[first:], type=pa.int64()), first)
            strings.rebuild(pa.array([_text(key) for key in rows[first:]], pa.string()), first)
        kept = integers.admit(pa.array(as_list, type=pa.int64()), len(rows))
        expected = strings.admit(pa.array([_text(key) for key in as_list], pa.string()), len(rows))
        mask = [True] * count if kept is None else kept.to_pylist()
        assert mask == ([True] * count if expected is None else expected.to_pylist()), (seed, step)
        rows.extend(key for key, keep in zip(as_list, mask, strict=True) if keep)
        assert (integers.offset_from, integers.offset_to) == (strings.offset_from, len(rows))
    assert [(offset, _text(key)) for offset, key in integers.entries()] == strings.entries()


def _text(key: int | None) -> str | None:
    return None if key is None else str(key)


@pytest.mark.unit
def test_a_million_row_window_of_ten_thousand_row_batches() -> None:
    """The window's two tables take turns: after 300 batches, exactly the last 1,000,000
    rows' keys are known (dense ids, then a batch of repeats of every age)."""
    window = KeyWindow(1_000_000)
    for batch in range(300):
        ids = np.arange(batch * 10_000, (batch + 1) * 10_000, dtype=np.int64)
        assert window.admit(pa.array(ids), window.offset_to) is None
    assert (window.offset_from, window.offset_to) == (2_000_000, 3_000_000)
    probe = pa.array([0, 1_999_999, 2_000_000, 2_999_999, 3_000_000, 2_000_000])
    assert window.filter(probe, window.offset_to).to_pylist() == [
        True,
        True,
        False,
        False,
        True,
        False,
    ]


# --- ProducerWindow --------------------------------------------------------------------

P1, P2, P3 = (bytes([n]) * 16 for n in (1, 2, 3))


def _record(sequence: int, first_offset: int = 0) -> ProducerRecord:
    return ProducerRecord(sequence, first_offset, row_count=2, duplicates=1)


@pytest.mark.unit
def test_unknown_producer_and_newer_sequences_are_not_duplicates() -> None:
    window = ProducerWindow(10)
    assert window.check(P1, 0) is None
    window.record(P1, _record(5))
    assert window.check(P1, 6) is None


@pytest.mark.unit
def test_retry_of_the_last_sequence_returns_its_record() -> None:
    window = ProducerWindow(10)
    window.record(P1, _record(5, first_offset=40))
    assert window.check(P1, 5) == _record(5, first_offset=40)


@pytest.mark.unit
def test_older_sequence_returns_the_last_record() -> None:
    window = ProducerWindow(10)
    window.record(P1, _record(4, first_offset=10))
    window.record(P1, _record(5, first_offset=40))
    assert window.check(P1, 2) == _record(5, first_offset=40)


@pytest.mark.unit
def test_least_recently_written_producer_is_evicted() -> None:
    window = ProducerWindow(2)
    window.record(P1, _record(1))
    window.record(P2, _record(1))
    window.check(P1, 1)  # a read is not a write
    window.record(P1, _record(2))
    window.record(P3, _record(1))
    assert P2 not in window
    assert P1 in window
    assert P3 in window
    assert len(window) == 2


@pytest.mark.unit
def test_sequences_only_grow() -> None:
    window = ProducerWindow(2)
    window.record(P1, _record(3))
    with pytest.raises(AssertionError):
        window.record(P1, _record(3))


@pytest.mark.unit
def test_json_round_trip_keeps_records_and_eviction_order() -> None:
    window = ProducerWindow(3)
    window.record(P2, _record(1))
    window.record(P1, _record(7, first_offset=3))
    window.record(P3, _record(2))
    data = json.loads(json.dumps(window.to_json()))
    assert data[0][0] == P2.hex()
    restored = ProducerWindow.from_json(data, 3)
    assert restored.to_json() == window.to_json()
    for producers in (window, restored):
        producers.record(bytes([9]) * 16, _record(1))
    assert restored.to_json() == window.to_json()
    assert P2 not in restored


@pytest.mark.unit
@pytest.mark.parametrize(
    "data",
    [
        [["zz", 1, 0, 0, 0]],
        [["01", 1, 0, 0, 0]],
        [[P1.hex(), "1", 0, 0, 0]],
        [[P1.hex(), 1, 0, 0]],
        [[P1.hex(), 1, 0, 0, 0], [P1.hex(), 2, 0, 0, 0]],
    ],
    ids=["hex", "length", "type", "fields", "twice"],
)
def test_malformed_json_raises(data: list[list[Any]]) -> None:
    with pytest.raises((ValueError, TypeError)):
        ProducerWindow.from_json(data, 10)
