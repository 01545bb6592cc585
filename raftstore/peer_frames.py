"""The bytes of one Raft peer link: frames in, frames out, without copying them around.

pysyncobj frames every message as `i32 length | body` and buffers both directions in
`bytes` objects: every `recv` allocates its own 4 MiB string and is appended with
`buffer += incoming` (the whole buffer copied again each time), every frame is sliced out
of it and the rest sliced again; a send joins its pieces twice and re-slices the unsent
rest after each partial send. With multi-MiB entries that is quadratic copying plus fresh
multi-MiB allocations that the kernel page-faults in for each message: about half of a
follower's CPU under pipelined 10,000-row appends (bench.profile).

`Inbox` receives straight into a buffer kept from one read to the next (`recv_into`), and
hands out each complete frame as a view of it; a frame longer than the buffer gets a buffer
of its own length, which is kept for the next frame up to `keep_bytes`. `Outbox` queues the
pieces of each frame as they are (length, head, body) and sends them with one `sendmsg`,
cutting a partly sent piece with a view. The frames on the wire are byte for byte
pysyncobj's. Nothing here knows pysyncobj; pysyncobj_patches.py installs these in its
TcpConnection.
"""

from __future__ import annotations

import collections
import socket
import struct
from collections.abc import Sequence
from typing import Final

from raftstore import limits

LENGTH: Final = struct.Struct("i")  # pysyncobj's frame header: a native int
# A link's receive buffer starts at this size; below this much free space a read first
# makes room (moves the pending bytes to the front, or grows the buffer).
INBOX_INITIAL_BYTES: Final = 256 * 1024
_READ_MIN_BYTES: Final = 64 * 1024
# A frame up to this long is sent as one joined buffer (a copy costs less than sendmsg's
# setup for a heartbeat or an acknowledgement).
_JOIN_BYTES_MAX: Final = 64 * 1024
# sendmsg takes at most IOV_MAX (1,024 on Linux) buffers per call.
_SEND_PARTS_MAX: Final = 512


class FrameTooLong(ValueError):
    """A peer declared a frame longer than the node reads, or left too much unparsed."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Inbox:
    """Received bytes of one link: [start, end) of the buffer, not yet taken as frames."""

    __slots__ = ("_buffer", "_end", "_frame_max", "_keep_bytes", "_start", "_view")

    def __init__(
        self,
        *,
        frame_max: int = limits.RAFT_FRAME_BYTES_MAX,
        keep_bytes: int = limits.RAFT_INBOX_KEEP_BYTES,
    ) -> None:
        self._frame_max = frame_max
        self._keep_bytes = keep_bytes
        self._start = 0
        self._end = 0
        self._replace(bytearray(INBOX_INITIAL_BYTES))

    def __len__(self) -> int:
        """Bytes received and not yet taken as frames."""
        return self._end - self._start

    @property
    def capacity(self) -> int:
        return len(self._buffer)

    def receive(self, sock: socket.socket) -> int:
        """One `recv_into` of what the socket holds, as far as there is room; returns what
        it returned (0: the peer closed). Raises the socket's OSError, or FrameTooLong
        (a declared length past `frame_max`, or more than two such frames unparsed)."""
        self._make_room(_READ_MIN_BYTES)
        count = sock.recv_into(self._view[self._end :])
        self._end += count
        if self._end - self._start >= LENGTH.size:
            self._check_head()
        return count

    def take(self) -> memoryview | None:
        """The next complete frame's body as a view of the buffer, or None. The frame counts
        as taken; the caller releases the view before the next `receive` (which may move
        the bytes it shows)."""
        length = self._head_length()
        if length is None or self._end - self._start - LENGTH.size < length:
            return None
        first = self._start + LENGTH.size
        self._start = first + length
        return self._view[first : first + length]

    def feed(self, data: bytes) -> None:
        """Append `data` as if it had been received (tests: no socket)."""
        self._make_room(len(data))
        self._view[self._end : self._end + len(data)] = data
        self._end += len(data)
        if self._end - self._start >= LENGTH.size:
            self._check_head()

    def _replace(self, buffer: bytearray) -> None:
        # Views handed out by `take` keep the old buffer alive until they are released.
        self._buffer = buffer
        self._view = memoryview(buffer)

    def _head_length(self) -> int | None:
        if self._end - self._start < LENGTH.size:
            return None
        (length,) = LENGTH.unpack_from(self._buffer, self._start)
        return int(length)

    def _check_head(self) -> None:
        length = self._head_length()
        if length is not None and not 0 <= length <= self._frame_max:
            raise FrameTooLong(f"declared frame length {length}")
        if self._end - self._start > 2 * (self._frame_max + LENGTH.size):
            raise FrameTooLong(f"{self._end - self._start} bytes unparsed")

    def _make_room(self, wanted: int) -> None:
        """At least `wanted` free bytes after `end`, and room for the whole head frame:
        pending bytes move to the front of the buffer, or into a larger one."""
        pending = self._end - self._start
        if pending == 0:
            self._start = self._end = 0
            if len(self._buffer) > self._keep_bytes:
                self._replace(bytearray(INBOX_INITIAL_BYTES))
            if len(self._buffer) >= wanted:
                return
        length = self._head_length()
        head_incomplete = length is not None and LENGTH.size + length > pending
        if head_incomplete:
            assert length is not None
            # Room for the whole head frame, then a read's worth: it is received in place.
            needed = LENGTH.size + length + wanted
        else:
            needed = pending + wanted
        if len(self._buffer) - self._start >= needed:
            return
        if len(self._buffer) >= needed:
            # Enough room once the pending bytes sit at the front.
            self._view[:pending] = self._view[self._start : self._end]
        else:
            # A long head frame gets a buffer of its size; anything else grows geometrically
            # (pysyncobj drains the socket before it parses: several frames may come in).
            capacity = needed if head_incomplete else max(needed, 2 * len(self._buffer))
            grown = bytearray(capacity)
            grown[:pending] = self._view[self._start : self._end]
            self._replace(grown)
        self._start, self._end = 0, pending


class Outbox:
    """Frames waiting to be sent on one link, as the pieces they were built from."""

    __slots__ = ("_bytes", "_parts")

    def __init__(self) -> None:
        self._parts: collections.deque[bytes | memoryview] = collections.deque()
        self._bytes = 0

    def __len__(self) -> int:
        """Bytes not yet sent."""
        return self._bytes

    def add_frame(self, body: Sequence[bytes]) -> None:
        """Queue one frame: its length, then its body's pieces (not copied, unless the
        frame is small: one buffer then makes the common case one plain `send`)."""
        length = 0
        for piece in body:
            length += len(piece)
        if length <= _JOIN_BYTES_MAX:
            self._parts.append(LENGTH.pack(length) + b"".join(body))
        else:
            self._parts.append(LENGTH.pack(length))
            self._parts.extend(piece for piece in body if len(piece))
        self._bytes += LENGTH.size + length

    def send(self, sock: socket.socket) -> int:
        """One `sendmsg` of the queued pieces; returns what it sent, and forgets that. Raises
        the socket's OSError (BlockingIOError when the kernel buffer is full)."""
        if len(self._parts) == 1:
            sent = sock.send(self._parts[0])
        else:
            parts = [self._parts[i] for i in range(min(len(self._parts), _SEND_PARTS_MAX))]
            sent = sock.sendmsg(parts)
        if sent > 0:
            self._consume(sent)
        return sent

    def _consume(self, count: int) -> None:
        self._bytes -= count
        while count:
            head = self._parts[0]
            if len(head) <= count:
                count -= len(head)
                self._parts.popleft()
            else:
                self._parts[0] = memoryview(head)[count:]
                count = 0
