"""Deduplication windows, pure and deterministic (the same on every replica).

- `KeyWindow`: a keyed table drops a row whose key is among the keys of the table's last
  `window_rows` rows, or appeared earlier in the same batch. Bounded: it holds the keys of
  at most twice `window_rows` rows and a batch (integer keys: two generations of tables,
  the older one dropped whole; other keys: exactly the window's). Offsets are row numbers
  since table creation; the window covers the half-open range `[offset_from, offset_to)`
  and `offset_to` is the table's row count.
- `ProducerWindow`: an item whose `(producer_id, sequence)` is not above the producer's last
  applied sequence is a retry; it is answered with the stored result and not applied.
  Bounded: the least recently written producers beyond `producers_max` are forgotten.

Neither class is thread-safe: the owner (the state machine, on the apply thread) serializes
calls. Not checkpointed as such: the producer window travels in the state machine snapshot
(`to_json`), the key window is rebuilt from the table's last rows (`rebuild`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from raftstore.key_table import KeyTable, first_occurrences, last_occurrences

PRODUCER_ID_BYTES: Final = 16

# NaN != NaN in Python, so every NaN key would be new. Keys use one NaN instead.
_NAN_KEY: Final = ("NaN",)


def _python_keys(keys: pa.Array | pa.ChunkedArray) -> list[Hashable]:
    """The keys as hashable Python values, one `to_pylist` per batch.

    Temporal keys are compared by their integer storage (a timestamp beyond year 9999 has no
    Python datetime); dictionary keys by their values; every NaN is one key; None (null) is
    a key like any other."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    key_type = keys.type
    if pa.types.is_dictionary(key_type):
        return _python_keys(keys.dictionary_decode())
    if pa.types.is_temporal(key_type) and key_type.bit_width in (32, 64):
        return _python_keys(keys.view(pa.int32() if key_type.bit_width == 32 else pa.int64()))
    values: list[Any] = keys.to_pylist()
    if pa.types.is_floating(key_type):
        return [_NAN_KEY if value != value else value for value in values]
    return values


class KeyWindow:
    """The keys of a table's last `window_rows` rows: a row whose key is among them, or
    appeared earlier in its batch, is dropped.

    Keys of an integer or 32/64-bit temporal column (the usual key: an id, a timestamp) are
    kept in tables that take a whole batch at once (`_IntegerKeys`, `key_table.KeyTable`),
    any other type in a dict of Python values (`_PythonKeys`); both answer alike
    (tests/test_dedup.py runs them side by side).
    The first keys the window sees choose; a table's key column has one type."""

    __slots__ = ("_keys", "_window_rows")

    def __init__(self, window_rows: int) -> None:
        assert window_rows >= 1, window_rows
        self._window_rows = window_rows
        self._keys: _PythonKeys | _IntegerKeys | None = None

    @property
    def window_rows(self) -> int:
        return self._window_rows

    @property
    def offset_from(self) -> int:
        """First offset the window covers (inclusive)."""
        return 0 if self._keys is None else self._keys.offset_from

    @property
    def offset_to(self) -> int:
        """End of the range the window covers (exclusive): the next row's offset."""
        return 0 if self._keys is None else self._keys.offset_to

    def __len__(self) -> int:
        return 0 if self._keys is None else len(self._keys)

    def __contains__(self, key: object) -> bool:
        return self._keys is not None and key in self._keys

    def entries(self) -> list[tuple[int, Hashable]]:
        """(offset, key) of every key in the window at its latest row, in offset order."""
        return [] if self._keys is None else self._keys.entries()

    def filter(self, keys: pa.Array | pa.ChunkedArray, first_offset: int) -> pa.BooleanArray:
        """Mask of the rows to keep (True) of a batch that starts at `first_offset`.

        A row is dropped if its key is in the window or appeared earlier in the batch. The
        window is the one before the batch: it does not slide within the batch. Pure."""
        return self._for(keys).filter(keys, first_offset)

    def admit(self, keys: pa.Array | pa.ChunkedArray, first_offset: int) -> pa.BooleanArray | None:
        """`filter`, then `add` of the kept rows' keys. Returns the mask of the rows to
        keep, or None when all are kept."""
        return self._for(keys).admit(keys, first_offset)

    def add(self, kept_keys: pa.Array | pa.ChunkedArray, first_offset: int) -> None:
        """Record the kept rows' keys at offsets first_offset, first_offset + 1, ...; then
        evict the keys of rows with offset < new row count - window_rows."""
        self._for(kept_keys).add(kept_keys, first_offset)

    def rebuild(self, keys: pa.Array | pa.ChunkedArray, first_offset: int) -> None:
        """Reset the window from the key column of the table's rows
        `[first_offset, first_offset + len(keys))`, the last rows of the table."""
        self._for(keys).rebuild(keys, first_offset)

    def _for(self, keys: pa.Array | pa.ChunkedArray) -> _PythonKeys | _IntegerKeys:
        integer = _integer_type(keys.type)
        if self._keys is None:
            self._keys = (
                _IntegerKeys(self._window_rows, keys.type)
                if integer
                else _PythonKeys(self._window_rows)
            )
        assert integer == isinstance(self._keys, _IntegerKeys), keys.type
        return self._keys


def _integer_type(key_type: pa.DataType) -> bool:
    """Whether keys of this type are kept as 64-bit integers (`_integer_keys`)."""
    if pa.types.is_dictionary(key_type):
        return _integer_type(key_type.value_type)
    if pa.types.is_temporal(key_type):
        return key_type.bit_width in (32, 64)
    return bool(pa.types.is_integer(key_type))


def _integer_keys(
    keys: pa.Array | pa.ChunkedArray,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_] | None]:
    """The keys as int64 (unsigned 64-bit ones by their bits) and the mask of the nulls
    (None when there are none); a null's value is 0 and means nothing."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if pa.types.is_dictionary(keys.type):
        keys = keys.dictionary_decode()
    if pa.types.is_temporal(keys.type):
        keys = keys.view(pa.int32() if keys.type.bit_width == 32 else pa.int64())
    nulls = None
    if keys.null_count:
        nulls = keys.is_null().to_numpy(zero_copy_only=False)
        keys = pc.fill_null(keys, 0)
    values = keys.to_numpy()
    if values.dtype == np.uint64:
        return values.view(np.int64), nulls
    return values.astype(np.int64, copy=False), nulls


class _Range:
    """What both kinds of key window share: the rows `[offset_from, offset_to)` it covers,
    at most `window_rows` of them."""

    __slots__ = ("_offset_from", "_offset_to", "_window_rows")

    def __init__(self, window_rows: int) -> None:
        assert window_rows >= 1, window_rows
        self._window_rows = window_rows
        self._offset_from = self._offset_to = 0

    @property
    def window_rows(self) -> int:
        return self._window_rows

    @property
    def offset_from(self) -> int:
        """First offset the window covers (inclusive)."""
        return self._offset_from

    @property
    def offset_to(self) -> int:
        """End of the range the window covers (exclusive): the next row's offset."""
        return self._offset_to

    def __len__(self) -> int:
        return self._offset_to - self._offset_from


class _IntegerKeys(_Range):
    """A key window over 64-bit integer keys in `KeyTable`s, one per generation of
    `window_rows` offsets: the youngest takes every new key; a generation is dropped once
    the next one starts at or below `offset_from` (every offset it holds has left the
    window), so at most two are held. A key is in the window when its latest offset (that
    of the youngest table holding it) is at least `offset_from`; rising keys are never
    probed in the older table (`KeyTable`'s key range). Generations of a quarter of the
    window were measured too: random keys then cost a lookup in five tables (x1.4 the
    time at a 1,000,000-row window) and rising ones gained nothing. The null key's latest
    offset is kept beside the tables."""

    __slots__ = ("_generations", "_null_offset", "_unsigned")

    def __init__(self, window_rows: int, key_type: pa.DataType) -> None:
        super().__init__(window_rows)
        # (first offset, table), oldest first; the last one takes the writes.
        self._generations: deque[tuple[int, KeyTable]] = deque([(0, KeyTable())])
        self._null_offset = -1
        # uint64 keys are held by their bits: `entries` shows them as what they were.
        if pa.types.is_dictionary(key_type):
            key_type = key_type.value_type
        self._unsigned = pa.types.is_uint64(key_type)

    def __contains__(self, key: object) -> bool:
        if key is None:
            return self._null_offset >= self._offset_from
        if not isinstance(key, int):
            return False
        dtype = np.uint64 if key >= 2**63 else np.int64
        values = np.array([key], dtype=dtype).view(np.int64)
        return bool(self._known(values, None)[0])

    def entries(self) -> list[tuple[int, Hashable]]:
        held = [table.items() for _, table in self._generations]
        keys = np.concatenate([table_keys for table_keys, _ in held])
        offsets = np.concatenate([table_offsets for _, table_offsets in held])
        # A key in several generations: its newest offset (the largest) counts.
        order = np.lexsort((-offsets, keys))
        keys, offsets = keys[order], offsets[order]
        newest = np.ones(len(keys), dtype=bool)
        newest[1:] = keys[1:] != keys[:-1]
        inside = newest & (offsets >= self._offset_from)
        keys, offsets = keys[inside], offsets[inside]
        if self._unsigned:
            keys = keys.view(np.uint64)
        found: list[tuple[int, Hashable]] = list(zip(offsets.tolist(), keys.tolist(), strict=True))
        if self._null_offset >= self._offset_from:
            found.append((self._null_offset, None))
        return sorted(found)

    def filter(self, keys: pa.Array | pa.ChunkedArray, first_offset: int) -> pa.BooleanArray:
        assert first_offset == self._offset_to, (first_offset, self._offset_to)
        values, nulls = _integer_keys(keys)
        return pa.array(self._keep(values, nulls), type=pa.bool_())

    def admit(self, keys: pa.Array | pa.ChunkedArray, first_offset: int) -> pa.BooleanArray | None:
        assert first_offset == self._offset_to, (first_offset, self._offset_to)
        values, nulls = _integer_keys(keys)
        keep = self._keep(values, nulls)
        if keep.all():
            self._append(values, nulls, distinct=True)
            return None
        self._append(values[keep], None if nulls is None else nulls[keep], distinct=True)
        return pa.array(keep, type=pa.bool_())

    def add(self, kept_keys: pa.Array | pa.ChunkedArray, first_offset: int) -> None:
        assert first_offset == self._offset_to, (first_offset, self._offset_to)
        self._append(*_integer_keys(kept_keys), distinct=False)

    def rebuild(self, keys: pa.Array | pa.ChunkedArray, first_offset: int) -> None:
        assert first_offset >= 0, first_offset
        values, nulls = _integer_keys(keys)
        skip = max(0, len(values) - self._window_rows)
        self._offset_from = self._offset_to = first_offset + skip
        self._generations = deque([(self._offset_to, KeyTable())])
        self._null_offset = -1
        self._append(values[skip:], None if nulls is None else nulls[skip:], distinct=False)

    def _known(
        self, values: npt.NDArray[np.int64], nulls: npt.NDArray[np.bool_] | None
    ) -> npt.NDArray[np.bool_]:
        """Mask of the keys in the window."""
        latest = np.full(len(values), -1, dtype=np.int64)
        missing = np.arange(len(values))
        for _, table in reversed(self._generations):  # Newest first: its offset is latest.
            if not len(missing):
                break
            latest[missing] = table.lookup(values[missing])
            missing = missing[latest[missing] < 0]
        known = latest >= self._offset_from
        if nulls is not None:
            known[nulls] = self._null_offset >= self._offset_from
        return known

    def _keep(
        self, values: npt.NDArray[np.int64], nulls: npt.NDArray[np.bool_] | None
    ) -> npt.NDArray[np.bool_]:
        """Mask of the rows to keep: the first row of each key not in the window."""
        if nulls is None:
            first = first_occurrences(values)
        else:
            first = np.zeros(len(values), dtype=bool)
            present = np.flatnonzero(~nulls)
            first[present] = first_occurrences(values[present])
            first[np.argmax(nulls)] = True
        return first & ~self._known(values, nulls)

    def _append(
        self,
        values: npt.NDArray[np.int64],
        nulls: npt.NDArray[np.bool_] | None,
        *,
        distinct: bool,
    ) -> None:
        """Record rows at offsets offset_to, offset_to + 1, ... (a key repeated among them
        at its last row; `distinct`: the caller knows none repeats, as `_keep` made them),
        then slide the window."""
        young_from, young = self._generations[-1]
        if self._offset_to - young_from >= self._window_rows:
            self._generations.append((self._offset_to, KeyTable(like=young)))
        rows = len(values)
        offsets = np.arange(self._offset_to, self._offset_to + rows, dtype=np.int64)
        if nulls is not None:
            null_rows = np.flatnonzero(nulls)
            if len(null_rows):
                self._null_offset = int(offsets[null_rows[-1]])
            present = np.flatnonzero(~nulls)
            values, offsets = values[present], offsets[present]
        if not distinct:
            last = last_occurrences(values)
            values, offsets = values[last], offsets[last]
        self._generations[-1][1].upsert(values, offsets)
        self._offset_to += rows
        self._offset_from = max(self._offset_from, self._offset_to - self._window_rows)
        # Every offset of a generation is below the next one's first offset.
        while len(self._generations) > 1 and self._generations[1][0] <= self._offset_from:
            self._generations.popleft()


class _PythonKeys(_Range):
    """A key window over Python values (any key type): key -> offset of the row holding it."""

    __slots__ = ("_keys", "_offsets")

    def __init__(self, window_rows: int) -> None:
        super().__init__(window_rows)
        self._keys: deque[Hashable] = deque()  # Keys of rows offset_from, offset_from + 1, ...
        self._offsets: dict[Hashable, int] = {}  # Key -> its latest offset in the window.

    def __contains__(self, key: object) -> bool:
        return key in self._offsets

    def entries(self) -> list[tuple[int, Hashable]]:
        return sorted((offset, key) for key, offset in self._offsets.items())

    def filter(self, keys: pa.Array | pa.ChunkedArray, first_offset: int) -> pa.BooleanArray:
        """Mask of the rows to keep (True) of a batch that starts at `first_offset`.

        A row is dropped if its key is in the window or appeared earlier in the batch. The
        window is the one before the batch: it does not slide within the batch. Pure."""
        assert first_offset == self._offset_to, (first_offset, self._offset_to)
        return pa.array(self._mask(_python_keys(keys)), type=pa.bool_())

    def admit(self, keys: pa.Array | pa.ChunkedArray, first_offset: int) -> pa.BooleanArray | None:
        """`filter`, then `add` of the kept rows' keys, converting the keys to Python once.
        Returns the mask of the rows to keep, or None when all are kept: new keys, none
        repeated (the common case, decided by set operations without a per-row loop)."""
        assert first_offset == self._offset_to, (first_offset, self._offset_to)
        values = _python_keys(keys)
        if self._offsets.keys().isdisjoint(values) and len(set(values)) == len(values):
            self._extend(values)
            self._evict()
            return None
        mask = self._mask(values)
        self._extend([key for key, keep in zip(values, mask, strict=True) if keep])
        self._evict()
        return pa.array(mask, type=pa.bool_())

    def _mask(self, values: list[Hashable]) -> list[bool]:
        window = self._offsets
        seen: set[Hashable] = set()
        mask: list[bool] = []
        for key in values:
            keep = key not in window and key not in seen
            if keep:
                seen.add(key)
            mask.append(keep)
        return mask

    def add(self, kept_keys: pa.Array | pa.ChunkedArray, first_offset: int) -> None:
        """Record the kept rows' keys at offsets first_offset, first_offset + 1, ...; then
        evict the keys of rows with offset < new row count - window_rows."""
        assert first_offset == self._offset_to, (first_offset, self._offset_to)
        self._extend(_python_keys(kept_keys))
        self._evict()

    def rebuild(self, keys: pa.Array | pa.ChunkedArray, first_offset: int) -> None:
        """Reset the window from the key column of the table's rows
        `[first_offset, first_offset + len(keys))`, the last rows of the table."""
        assert first_offset >= 0, first_offset
        skip = max(0, len(keys) - self._window_rows)
        self._keys.clear()
        self._offsets.clear()
        self._offset_from = first_offset + skip
        self._offset_to = first_offset + skip
        self._extend(_python_keys(keys[skip:]))
        self._evict()

    def _extend(self, keys: list[Hashable]) -> None:
        offset = self._offset_to
        # A key already present (only after a rebuild with a larger window) moves to its
        # latest row; eviction of the older row then leaves it in place.
        self._offsets.update(zip(keys, range(offset, offset + len(keys)), strict=True))
        self._keys.extend(keys)
        self._offset_to = offset + len(keys)

    def _evict(self) -> None:
        offset_from_min = self._offset_to - self._window_rows
        offsets = self._offsets
        keys = self._keys
        offset = self._offset_from
        while offset < offset_from_min:
            key = keys.popleft()
            if offsets.get(key) == offset:
                del offsets[key]
            offset += 1
        self._offset_from = offset
        assert self._offset_from >= 0, self._offset_from
        assert self._offset_from <= self._offset_to, (self._offset_from, self._offset_to)
        assert self._offset_to - self._offset_from <= self._window_rows
        assert len(keys) == self._offset_to - self._offset_from
        assert len(offsets) <= len(keys)


@dataclass(frozen=True, slots=True)
class ProducerRecord:
    """A producer's last applied item and its result."""

    sequence: int
    first_offset: int
    row_count: int  # Rows kept.
    duplicates: int  # Rows dropped by key dedup.


class ProducerWindow:
    """producer_id -> its last applied item, for the `producers_max` most recently written
    producers. Only the last item is stored, so a retry of an older sequence is answered
    with the last item's result."""

    __slots__ = ("_producers_max", "_records")

    def __init__(self, producers_max: int) -> None:
        assert producers_max >= 1, producers_max
        self._producers_max = producers_max
        # Least recently written first.
        self._records: OrderedDict[bytes, ProducerRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, producer_id: object) -> bool:
        return producer_id in self._records

    def last(self, producer_id: bytes) -> ProducerRecord | None:
        return self._records.get(producer_id)

    def check(self, producer_id: bytes, sequence: int) -> ProducerRecord | None:
        """The stored record if `sequence` is a retry (<= the last applied sequence), else
        None (apply it). Reads do not count as writes for eviction."""
        record = self._records.get(producer_id)
        if record is not None and sequence <= record.sequence:
            return record
        return None

    def record(self, producer_id: bytes, record: ProducerRecord) -> None:
        """Store `record` as the producer's last applied item, evicting the least recently
        written producer beyond producers_max."""
        assert len(producer_id) == PRODUCER_ID_BYTES, len(producer_id)
        previous = self._records.pop(producer_id, None)
        if previous is not None:
            assert record.sequence > previous.sequence, (record.sequence, previous.sequence)
        self._records[producer_id] = record
        while len(self._records) > self._producers_max:
            self._records.popitem(last=False)

    def to_json(self) -> list[list[str | int]]:
        """JSON-ready form, least recently written first (the order eviction depends on):
        [[producer_id hex, sequence, first_offset, row_count, duplicates], ...]."""
        return [
            [
                producer_id.hex(),
                record.sequence,
                record.first_offset,
                record.row_count,
                record.duplicates,
            ]
            for producer_id, record in self._records.items()
        ]

    @classmethod
    def from_json(cls, data: list[list[Any]], producers_max: int) -> ProducerWindow:
        """Inverse of `to_json`. Raises ValueError, TypeError or KeyError on malformed data
        (the caller maps them to its own error)."""
        window = cls(producers_max)
        for producer_id_hex, sequence, first_offset, row_count, duplicates in data:
            producer_id = bytes.fromhex(producer_id_hex)
            if len(producer_id) != PRODUCER_ID_BYTES:
                raise ValueError(f"producer_id {producer_id_hex!r} is not 16 bytes")
            values = (sequence, first_offset, row_count, duplicates)
            if not all(type(value) is int for value in values):
                raise TypeError(f"producer {producer_id_hex}: non-integer field in {values}")
            if producer_id in window._records:
                raise ValueError(f"producer {producer_id_hex} appears twice")
            window.record(producer_id, ProducerRecord(*values))
        return window
