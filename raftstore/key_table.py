"""An insert-only table of 64-bit integer keys -> the offset of their latest row, whose
lookups and inserts take a whole batch of keys at once (numpy, no per-key Python).

The key window of a table keyed by an integer or temporal column (`dedup.KeyWindow`) is
two of these. A Python dict did the same one key at a time: `to_pylist`, a dict lookup, an
insert and an eviction per row cost 1.4-2.3 ms per 10,000 rows on each replica, which
made a keyed table's publishes half again as slow as an unkeyed one's.

Two modes:
- **dense** while the keys lie close together (ids, millisecond timestamps, a few writers'
  id ranges): blocks of 1,024 consecutive key values, each a row of offsets, found by a
  sorted array of block ids: a batch is a few searches and one gather or scatter. A table
  holds at most 4 block slots per key (plus one block); past that it turns to
- **hashing**: open addressing with linear probing, at most half full, each slot a (key,
  offset) pair in one row so that a probe touches one cache line (offset -1: empty): a
  batch probes all its keys in rounds, each round one gather over the keys still
  unresolved. Slots come from a multiply-shift hash of the key xor a salt drawn once per
  process: the layout never changes a result (every answer depends on keys and offsets
  only), and a publisher who cannot know the salt cannot choose keys that all land on one
  chain.

In both, the table knows the smallest and largest key it holds and looks up only keys
inside that range: rising keys are all new and cost no lookup at all. Nothing is ever
deleted (the window drops a whole table once every offset in it has left the window).
"""

from __future__ import annotations

import secrets
from typing import Final

import numpy as np
import numpy.typing as npt

Keys = npt.NDArray[np.int64]
Offsets = npt.NDArray[np.int64]
Indexes = npt.NDArray[np.intp]

_SALT: Final = np.uint64(secrets.randbits(64))
_MULTIPLIER: Final = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, odd
_SLOTS_MIN_BITS: Final = 6
_KEY, _OFFSET = 0, 1  # The columns of a slot.
_EMPTY: Final = -1
# Dense mode: keys in blocks of 1,024 consecutive values (8 KiB of offsets each). A table
# holds up to this many block slots per key (plus one block) before it turns to hashing:
# ids and millisecond timestamps stay dense, as do a few writers' separate id ranges.
_BLOCK_BITS: Final = 10
_BLOCK: Final = 1 << _BLOCK_BITS
_DENSE_SPREAD: Final = 4


class KeyTable:
    """key -> latest offset; `lookup` and `upsert` take arrays. Not thread-safe."""

    __slots__ = ("_bits", "_bits_hint", "_blocks", "_count", "_high", "_low", "_slots")

    def __init__(self, like: KeyTable | None = None) -> None:
        self._bits = _SLOTS_MIN_BITS
        self._slots = _empty_slots(self._bits)
        # A table that replaces `like` will hold keys like its: it starts in its mode, and
        # hashes at its size at once.
        self._bits_hint = _SLOTS_MIN_BITS if like is None else like._bits
        dense = like is None or like._blocks is not None
        self._blocks: _Blocks | None = _Blocks() if dense else None  # Until keys spread out.
        self._count = 0
        self._low, self._high = 0, -1  # The range of the keys held (empty: none).

    def __len__(self) -> int:
        return self._count

    def lookup(self, keys: Keys) -> Offsets:
        """The latest offset of each key, -1 for a key not in the table."""
        found = np.full(len(keys), _EMPTY, dtype=np.int64)
        pending = np.flatnonzero((keys >= self._low) & (keys <= self._high))
        if not len(pending):
            return found
        if self._blocks is not None:
            found[pending] = self._blocks.lookup(keys[pending])
            return found
        slots = self._home(keys)
        mask = (1 << self._bits) - 1
        while len(pending):  # Rounds: each resolves every key at an empty slot or its own.
            at = slots[pending]
            held = self._slots[at]
            occupied = held[:, _OFFSET] != _EMPTY
            mine = occupied & (held[:, _KEY] == keys[pending])
            found[pending[mine]] = held[mine, _OFFSET]
            further = occupied & ~mine
            pending = pending[further]
            slots[pending] = (at[further] + 1) & mask
        return found

    def upsert(self, keys: Keys, offsets: Offsets) -> None:
        """Sets each key's offset (inserting the keys not in the table). The keys must be
        distinct."""
        if not len(keys):
            return
        low, high = int(keys.min()), int(keys.max())
        if self._high >= self._low:
            low, high = min(low, self._low), max(high, self._high)
        if self._blocks is not None:
            new = self._blocks.new_blocks(keys)
            blocks = len(self._blocks) + len(new)
            if blocks * _BLOCK <= _DENSE_SPREAD * (self._count + len(keys)) + _BLOCK:
                self._count += self._blocks.upsert(keys, offsets, new)
            else:
                self._to_hash()
        if self._blocks is None:
            self._hash_upsert(keys, offsets)
        self._low, self._high = low, high

    def _to_hash(self) -> None:
        keys, offsets = self.items()
        self._blocks = None
        self._count = 0
        self._hash_upsert(keys, offsets)

    def _hash_upsert(self, keys: Keys, offsets: Offsets) -> None:
        if not len(keys):
            return
        self._reserve(self._count + len(keys))
        slots = self._home(keys)
        pending = np.arange(len(keys))
        mask = (1 << self._bits) - 1
        while len(pending):
            at = slots[pending]
            held = self._slots[at]
            empty = held[:, _OFFSET] == _EMPTY
            mine = ~empty & (held[:, _KEY] == keys[pending])
            self._slots[at[mine], _OFFSET] = offsets[pending[mine]]
            # Keys that met an empty slot all write their key there and read it back: one
            # write per slot lands (the keys are distinct), and that key claims the slot. A
            # key that lost it looks at it again next round, finds it taken and moves on.
            contenders = pending[empty]
            contested = at[empty]
            self._slots[contested, _KEY] = keys[contenders]
            won = self._slots[contested, _KEY] == keys[contenders]
            self._slots[contested[won], _OFFSET] = offsets[contenders[won]]
            self._count += int(np.count_nonzero(won))
            taken = ~empty & ~mine
            slots[pending[taken]] = (at[taken] + 1) & mask
            taken[np.flatnonzero(empty)[~won]] = True  # the losers stay, at the same slot
            pending = pending[taken]

    def items(self) -> tuple[Keys, Offsets]:
        """Every (key, offset) held, in no particular order."""
        if self._blocks is not None:
            return self._blocks.items()
        held = self._slots[self._slots[:, _OFFSET] != _EMPTY]
        return held[:, _KEY].copy(), held[:, _OFFSET].copy()

    def _reserve(self, count: int) -> None:
        """Grow (and re-insert) until `count` keys fill at most half the slots."""
        bits = max(self._bits, self._bits_hint)
        while count * 2 > 1 << bits:
            bits += 1
        if bits == self._bits:
            return
        keys, offsets = self.items()
        self._bits = bits
        self._slots = _empty_slots(bits)
        self._count = 0
        self._hash_upsert(keys, offsets)

    def _home(self, keys: Keys) -> npt.NDArray[np.int64]:
        """Each key's first slot."""
        mixed = (keys.view(np.uint64) ^ _SALT) * _MULTIPLIER
        return (mixed >> np.uint64(64 - self._bits)).astype(np.int64)


class _Blocks:
    """Dense mode: the offsets of keys `b * _BLOCK ...` in a row of `_BLOCK` (-1: absent)
    per block id b in use; the block ids sorted, beside the row each one has."""

    __slots__ = ("_ids", "_offsets", "_rows")

    def __init__(self) -> None:
        self._ids: Keys = np.empty(0, dtype=np.int64)  # Sorted.
        self._rows: Indexes = np.empty(0, dtype=np.intp)  # The row of each id.
        self._offsets: Offsets = np.empty((0, _BLOCK), dtype=np.int64)

    def __len__(self) -> int:
        return len(self._ids)

    def new_blocks(self, keys: Keys) -> Keys:
        """The block ids `keys` need that are not in use yet, sorted."""
        ids: Keys = keys >> _BLOCK_BITS
        if len(ids) > 1 and bool(np.all(ids[1:] >= ids[:-1])):  # rising: no sort
            ids = ids[np.concatenate(([True], ids[1:] != ids[:-1]))]
        else:
            ids = np.unique(ids)
        if not len(self._ids):
            return ids
        at = np.minimum(np.searchsorted(self._ids, ids), len(self._ids) - 1)
        new: Keys = ids[self._ids[at] != ids]
        return new

    def lookup(self, keys: Keys) -> Offsets:
        found = np.full(len(keys), _EMPTY, dtype=np.int64)
        if not len(self._ids):
            return found
        ids = keys >> _BLOCK_BITS
        at = np.minimum(np.searchsorted(self._ids, ids), len(self._ids) - 1)
        hit = np.flatnonzero(self._ids[at] == ids)
        slots = (self._rows[at[hit]] << _BLOCK_BITS) + (keys[hit] & (_BLOCK - 1))
        found[hit] = np.take(self._offsets, slots)  # indexes into the rows laid end to end
        return found

    def upsert(self, keys: Keys, offsets: Offsets, new: Keys) -> int:
        """Sets each (distinct) key's offset, adding the blocks `new_blocks` named; returns
        how many keys are new."""
        if len(new):
            used = len(self._ids)
            if used + len(new) > len(self._offsets):
                grown = np.full((max(2 * len(self._offsets), used + len(new)), _BLOCK), _EMPTY)
                grown[:used] = self._offsets[:used]
                self._offsets = grown
            ids = np.concatenate([self._ids, new])
            rows = np.concatenate([self._rows, np.arange(used, used + len(new))])
            order = np.argsort(ids, kind="stable")
            self._ids, self._rows = ids[order], rows[order]
        rows = self._rows[np.searchsorted(self._ids, keys >> _BLOCK_BITS)]
        slots = (rows << _BLOCK_BITS) + (keys & (_BLOCK - 1))
        fresh = int(np.count_nonzero(np.take(self._offsets, slots) == _EMPTY))
        np.put(self._offsets, slots, offsets)
        return fresh

    def items(self) -> tuple[Keys, Offsets]:
        held = self._offsets[self._rows] != _EMPTY  # Rows in block-id order.
        block, column = np.nonzero(held)
        keys = (self._ids[block] << _BLOCK_BITS) + column
        return keys, self._offsets[self._rows[block], column]


def _empty_slots(bits: int) -> npt.NDArray[np.int64]:
    slots = np.empty((1 << bits, 2), dtype=np.int64)
    slots[:, _OFFSET] = _EMPTY
    return slots


def distinct(keys: Keys) -> bool:
    """Whether no key repeats (one sort; rising keys without it)."""
    if len(keys) < 2 or bool(np.all(keys[1:] > keys[:-1])):
        return True
    ordered = np.sort(keys)
    return bool(np.all(ordered[1:] != ordered[:-1]))


def first_occurrences(keys: Keys) -> npt.NDArray[np.bool_]:
    """Mask of each distinct key's first occurrence."""
    if distinct(keys):
        return np.ones(len(keys), dtype=bool)
    _, index = np.unique(keys, return_index=True)
    first = np.zeros(len(keys), dtype=bool)
    first[index] = True
    return first


def last_occurrences(keys: Keys) -> Indexes:
    """Indexes of each distinct key's last occurrence, in ascending order."""
    if distinct(keys):
        return np.arange(len(keys))
    _, from_end = np.unique(keys[::-1], return_index=True)
    return np.sort(len(keys) - 1 - from_end)
