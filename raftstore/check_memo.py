"""The leader's checks of publish payloads, kept for the apply of the entries that carry them.

A leader reads every publish's Arrow IPC payload twice: once to refuse a bad one before it
is proposed, and again when the committed entry is applied (apply must decide from the
entry alone, identically on every replica). The second read is on the way to the
publisher's answer (apply runs before it), and it is the same computation on the same bytes
against the same table: a cold pyarrow read costs 30-50 us in a node (its code and data out
of the CPU's caches between appends), about as much for one row as for a thousand. So the
first read is remembered, with the payload and the table incarnation it was made against
(`owner`, compared by identity): apply takes it back only for byte-identical bytes of the
same incarnation, and otherwise reads the payload as every follower does. The remembered
value never decides anything a fresh read would not.

Found by the payload's table, length and CRC-32 (zlib-ng: ~1.3 us for 64 KiB), then
compared byte for byte with the remembered payload (a memcmp), so a collision is only a
miss. A key of the payload's own bytes cost a copy and a hash of them per look-up (~30 us
for 64 KiB): payloads above 16 KiB were not kept then.

Bounded: payloads up to `payload_bytes_max` (the leader keeps a copy of each), at most
`entries_max` entries and `bytes_max` bytes of memory kept (each entry's `cost`: its
payload and what its value keeps alive, e.g. the Arrow arrays of a wide table's batch,
~30 KB for one row of 60 columns); the oldest go first. A check whose entry is never
applied here (a lost leadership, a refused proposal) ages out the same way. Any thread: one
lock, held for dict operations only.
"""

from __future__ import annotations

import threading
from typing import Final, Generic, NamedTuple, TypeVar

from hastream.checksum import crc32

# What a proposal may write after a checked payload in the same blob (a seal,
# checked_payload.py: 44 bytes), which the entry's bytes are compared with too.
SUFFIX_BYTES_MAX: Final = 64

Owner = TypeVar("Owner")
Value = TypeVar("Value")


class _Kept(NamedTuple, Generic[Owner, Value]):
    payload: bytes  # compared with the entry's bytes on a take
    suffix: bytes  # and what the entry holds after them (the leader's seal)
    owner: Owner
    value: Value
    cost: int  # bytes of memory it keeps alive


class CheckMemo(Generic[Owner, Value]):
    def __init__(self, *, entries_max: int, bytes_max: int, payload_bytes_max: int) -> None:
        if entries_max < 1 or payload_bytes_max < 1 or bytes_max < payload_bytes_max:
            raise ValueError(
                f"CheckMemo bounds entries_max={entries_max} bytes_max={bytes_max} "
                f"payload_bytes_max={payload_bytes_max}"
            )
        self._entries_max = entries_max
        self._bytes_max = bytes_max
        self.payload_bytes_max = payload_bytes_max
        self._lock = threading.Lock()
        # (table, payload length, payload CRC-32) -> what was kept; insertion order is age.
        self._values: dict[tuple[str, int, int], _Kept[Owner, Value]] = {}
        self._bytes = 0
        self.hits = 0

    def fits(self, payload: bytes | memoryview) -> bool:
        return memoryview(payload).nbytes <= self.payload_bytes_max

    def remember(
        self,
        table: str,
        payload: bytes,
        owner: Owner,
        value: Value,
        cost: int,
        suffix: bytes = b"",
    ) -> None:
        """Keep `value`, the check of `payload` (immutable bytes: `value` may view them),
        which keeps `cost` bytes of memory alive (>= the payload's); not if it alone would
        pass `bytes_max`. Taken back by the entry bytes `payload + suffix`."""
        assert len(payload) <= self.payload_bytes_max, len(payload)
        assert len(suffix) <= SUFFIX_BYTES_MAX, len(suffix)
        assert cost >= len(payload), (cost, len(payload))
        if cost > self._bytes_max:
            return
        key = (table, len(payload) + len(suffix), crc32(suffix, crc32(payload)))
        with self._lock:
            replaced = self._values.pop(key, None)
            if replaced is not None:  # these bytes again, or a collision: the newest stays
                self._bytes -= replaced.cost
            self._values[key] = _Kept(payload, suffix, owner, value, cost)
            self._bytes += cost
            while len(self._values) > self._entries_max or self._bytes > self._bytes_max:
                self._bytes -= _pop_oldest(self._values).cost

    def take(self, table: str, payload: bytes | memoryview, owner: Owner) -> Value | None:
        """The value kept for exactly these bytes of `table` checked against `owner` (and
        forgotten), or None."""
        if not self._values:  # a follower's case: nothing is ever remembered there
            return None
        view = memoryview(payload)
        if view.nbytes > self.payload_bytes_max + SUFFIX_BYTES_MAX:
            return None
        key = (table, view.nbytes, crc32(view))
        with self._lock:
            kept = self._values.pop(key, None)
            if kept is not None:
                self._bytes -= kept.cost
        if kept is None or kept.owner is not owner:
            return None
        # The same length (the key's): startswith is a memcmp (memoryview's == compares
        # byte by byte in a loop, ~2 ms per MiB; fine for the few bytes of a suffix).
        size = len(kept.payload)
        if not kept.payload.startswith(view[:size]) or view[size:] != kept.suffix:
            return None  # a collision's check is dropped: its own apply reads its payload
        self.hits += 1
        return kept.value

    def clear(self) -> None:
        """Forget every check (a leader that steps down: a follower never takes one back, so
        they would only hold memory until its next term as leader)."""
        with self._lock:
            self._values.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._values)

    @property
    def bytes_kept(self) -> int:
        return self._bytes


def _pop_oldest(values: dict[tuple[str, int, int], _Kept[Owner, Value]]) -> _Kept[Owner, Value]:
    key = next(iter(values))  # dicts keep insertion order: the first key is the oldest
    return values.pop(key)
