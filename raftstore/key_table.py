"""An insert-only hash table of 64-bit integer keys -> the offset of their latest row,
whose lookups and inserts take a whole batch of keys at once (numpy, no per-key Python).

The key window of a table keyed by an integer or temporal column (`dedup.KeyWindow`) is
two of these. A Python dict did the same one key at a time: `to_pylist`, a dict lookup, an
insert and an eviction per row cost 1.4-2.3 ms per 10,000 rows on each replica, which
made a keyed table's publishes half again as slow as an unkeyed one's.

Open addressing with linear probing, at most half full, each slot a (key, offset) pair in
one row so that a probe touches one cache line (offset -1: empty): a batch probes all its
keys in rounds, each round one gather over the keys still unresolved. The table knows the
smallest and largest key it holds, and only keys inside that range are probed: rising
keys (an id, a timestamp) are all new and cost no probe at all. Nothing is ever deleted
(the window drops a whole table once every offset in it has left the window), so there
are no tombstones.

Slots come from a multiply-shift hash of the key xor a salt drawn once per process: the
layout never changes a result (every answer depends on keys and offsets only), and a
publisher who cannot know the salt cannot choose keys that all land on one chain.
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
# Dense mode holds up to this many slots per key (plus the slack) before the table turns
# to hashing: ids and millisecond timestamps stay dense.
_DENSE_SPREAD: Final = 4
_DENSE_SLACK: Final = 1024


class KeyTable:
    """key -> latest offset; `lookup` and `upsert` take arrays. Not thread-safe."""

    __slots__ = ("_base", "_bits", "_bits_hint", "_count", "_dense", "_high", "_low", "_slots")

    def __init__(self, like: KeyTable | None = None) -> None:
        self._bits = _SLOTS_MIN_BITS
        self._slots = _empty_slots(self._bits)
        # A table that replaces `like` hashes at its size at once: it will hold about as
        # many keys.
        self._bits_hint = _SLOTS_MIN_BITS if like is None else like._bits
        # Dense mode (until the keys spread out): the offset of key k at _dense[k - _base].
        self._dense: Offsets | None = np.empty(0, dtype=np.int64)
        self._base = 0
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
        if self._dense is not None:
            found[pending] = self._dense[keys[pending] - self._base]
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
        if self._dense is not None and not self._dense_upsert(keys, offsets, low, high):
            self._to_hash()
        if self._dense is None:
            self._hash_upsert(keys, offsets)
        self._low, self._high = low, high

    def _dense_upsert(self, keys: Keys, offsets: Offsets, low: int, high: int) -> bool:
        """Upserts in dense mode; False (nothing done) when the keys are too spread out."""
        span = high - low + 1
        if span > _DENSE_SPREAD * (self._count + len(keys)) + _DENSE_SLACK:
            return False
        assert self._dense is not None
        if low < self._base or high >= self._base + len(self._dense):
            grown = np.full(span + span // 2, _EMPTY, dtype=np.int64)
            if self._count:
                start = self._low - low
                grown[start : start + self._high - self._low + 1] = self._dense[
                    self._low - self._base : self._high - self._base + 1
                ]
            self._dense, self._base = grown, low
        slots = keys - self._base
        self._count += int(np.count_nonzero(self._dense[slots] == _EMPTY))
        self._dense[slots] = offsets
        return True

    def _to_hash(self) -> None:
        keys, offsets = self.items()
        self._dense = None
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
        if self._dense is not None:
            at = np.flatnonzero(self._dense != _EMPTY)
            return at.astype(np.int64) + self._base, self._dense[at]
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
