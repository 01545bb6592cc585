"""bench.publish_rows: the two ways the publish benchmarks hand N rows to the hastream client
give the same rows, and one row stays a row tuple either way."""

from __future__ import annotations

import pytest

from bench.publish_rows import POOL_ROWS, ROWS_FROM, SCHEMA, RowPool, hastream_builder, one_row


@pytest.fixture(scope="module")
def pool() -> RowPool:
    return RowPool.make()


@pytest.mark.parametrize("rows", [100, 1_000, 10_000])
def test_a_slice_of_the_pools_table_holds_the_rows_built_from_numpy(
    pool: RowPool, rows: int
) -> None:
    from_numpy = hastream_builder(pool, rows, "numpy")
    from_arrow = hastream_builder(pool, rows, "arrow")
    # Call numbers past the pool's end wrap around to its start, alike for both.
    for number in (0, 1, POOL_ROWS // rows, POOL_ROWS // rows + 3):
        built, sliced = from_numpy(number), from_arrow(number)
        assert sliced.schema.equals(SCHEMA, check_metadata=True)
        assert sliced.num_rows == rows
        assert sliced.equals(built)
        assert sliced.column("id")[0].as_py() == f"{pool.first_row(number, rows):020d}"


@pytest.mark.parametrize("rows_from", ROWS_FROM)
def test_one_row_is_a_row_tuple_of_python_values_either_way(pool: RowPool, rows_from: str) -> None:
    build = hastream_builder(pool, 1, rows_from)
    assert build(7) == one_row(7)
    (row,) = build(7)
    assert row[0] == f"{7:020d}"
    assert len(row) == 11


def test_an_unknown_way_is_refused(pool: RowPool) -> None:
    with pytest.raises(ValueError, match="pandas"):
        hastream_builder(pool, 100, "pandas")
