"""A publish-port connection served by the leader's Raft event loop, not a thread of its own.

A waited publish on a connection thread (publish_port.py) crosses threads twice on the
leader: the connection's thread reads it and proposes it, the Raft tick thread takes the
followers' acknowledgements and applies the entry, and the connection's thread is woken to
write the answer (a futex wake-up and a GIL hand-over, with cold caches, ~0.1 ms of its
1.3 ms here). Served from the tick thread's own poll, the request is read, checked and
proposed (journal add, append_entries to the followers) where the acknowledgements arrive,
and the answer leaves from the apply that completes it: one thread for the whole path.
Measured in docs/benchmark.md (twenty-second session).

The connection keeps the port's contract (publish_frames.py): one PUBLISH answered at a time,
in order (a client may send the next before its answer; it waits, buffered); its typed
errors; a frame that is not a PUBLISH, or not a frame, gets InvalidArgument and the
connection closes; IDLE_TIMEOUT_S of silence closes it. A STREAM frame hands the connection
back to a thread of its own (`Port.serve_stream`): a stream's reads and writes overlap.

Threads: everything but the answer runs on the host's tick thread, under its tick lock
(`on_event`, `on_tick`, what `call_soon` runs). An answer is written by the thread that
completes the publish's future: the host's tick thread, or another group's when the table
lives there. Only the host's thread reads, starts publishes, closes the socket and takes it
out of the poll (`ConnectionHost.release`): a socket closed elsewhere could have its
descriptor number reused by a new peer link while still registered here. Elsewhere it is
only shut down, which the poll then reports.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, Protocol

from hastream import publish_frames as frames
from hastream.errors import InvalidArgument, Overloaded, RaftStoreError
from raftstore.group import WouldWait
from raftstore.replica import ConnectionHost
from raftstore.service import StartedPublish

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S: Final = 120.0  # as a connection thread's (publish_port.IDLE_TIMEOUT_S)
_RECV_BYTES: Final = 256 * 1024
# What a connection may hold unanswered: one whole frame and what a client sent after it
# (a pipelined PUBLISH). A thread would leave the rest in the socket; a poll that did not
# read it would be woken by it again and again, so past this the client is refused.
BUFFERED_BYTES_MAX: Final = frames.FRAME_BYTES_MAX + _RECV_BYTES


class Port(Protocol):
    """What the publish port does for a connection its loop serves (publish_port.py)."""

    def begin(self, body: bytes | bytearray, *, wait: bool = True) -> StartedPublish:
        """Parse a PUBLISH body and hand it to group commit; raises its typed error, and
        without `wait` WouldWait where the leader would hold it (service.begin_publish)."""
        ...

    def answered(self) -> None:
        """Count one answered publish."""
        ...

    def serve_stream(self, connection: socket.socket, leftover: bytes, body: bytes) -> None:
        """Serve the STREAM frame `body` and the rest of `connection` on a thread
        (`leftover`: what was read after that frame)."""
        ...

    def forget(self, connection: socket.socket) -> None:
        """The connection is closed: it no longer counts toward the port's limit."""
        ...


@dataclass
class _Frame:
    kind: int
    body: bytes | bytearray


@dataclass
class _BigFrame:
    """A frame whose body is received straight into a buffer of its size: a big body
    gathered in the connection's buffer would be grown several times, then copied out
    (three times its size held at once, per connection: the 211-column grid's 12.7 MB
    publishes took a node's peak RSS past 600 MiB)."""

    kind: int
    body: bytearray
    have: int


class LoopedConnection:
    """One publish-port connection served on `host`'s event loop, after its greeting."""

    def __init__(
        self,
        connection: socket.socket,
        leftover: bytes,
        port: Port,
        host: ConnectionHost,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connection = connection
        self._fd = connection.fileno()
        self._port = port
        self._host = host
        self._clock = clock
        self._buffer = bytearray(leftover)  # bytes read and not served, from a frame's start
        self._big: _BigFrame | None = None  # a big frame's body being received, after them
        self._ready: collections.deque[_Frame] = collections.deque()  # big frames received
        # Reentrant: a future that completes while its callback is added runs it at once.
        self._lock = threading.RLock()
        self._in_flight = False  # a PUBLISH handed to group commit, not yet answered
        self._starting = False  # _serve_buffered is on the stack (its answers come back)
        self._closed = False
        self._last_active = clock()

    def fileno(self) -> int:
        return self._fd

    def start(self) -> bool:
        """Hand the connection to the host's loop; False when it takes none (closing)."""
        self._connection.setblocking(False)
        if not self._host.host(self):
            self._connection.setblocking(True)
            return False
        if self._buffer:  # a request the thread read after its last one: no poll event tells
            self._host.call_soon(self._resume)
        return True

    # --- the host's tick thread, under its tick lock ---

    def on_event(self, _fd: int, _event: int) -> None:
        """The socket is readable, or hung up, or failed: read what it holds, serve it."""
        with self._guard():
            with self._lock:
                if self._closed:
                    return
                if not self._receive():
                    self.close()
                    return
                started = self._serve_buffered()
            if started:
                # Added and sent to the followers now, in this tick, not after the next poll.
                self._host.propose_now()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """A bug in serving one connection ends that connection, as it would end its
        thread, and leaves the Raft loop it runs on going."""
        try:
            yield
        except Exception:
            log.exception("publish port: a connection served by the raft loop failed")
            self.close()

    def on_tick(self) -> None:
        """Closes the connection once it has been silent for IDLE_TIMEOUT_S with nothing
        in flight (a frame cut off half-way included)."""
        with self._lock:
            idle = self._clock() - self._last_active > IDLE_TIMEOUT_S
            if idle and not self._closed and not self._in_flight:
                self.close()

    def close(self) -> None:
        """Out of the poll, closed, and no longer counted by the port (host thread)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._host.release(self._fd)
        frames.shut(self._connection)
        self._port.forget(self._connection)

    def _receive(self) -> bool:
        """Reads what the socket holds; False when the peer left or the link failed."""
        while True:
            try:
                if self._big is not None:
                    count = self._receive_big(self._big)
                else:
                    chunk = self._connection.recv(_RECV_BYTES)
                    count = len(chunk)
                    self._buffer += chunk
                    self._start_big()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as error:
                return error.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
            if count == 0:
                return False
            self._last_active = self._clock()
            if self._held() > BUFFERED_BYTES_MAX:
                self._refuse(Overloaded("publish port unanswered bytes", BUFFERED_BYTES_MAX))
                return False

    def _receive_big(self, big: _BigFrame) -> int:
        with memoryview(big.body) as view:
            count = self._connection.recv_into(view[big.have :])
        big.have += count
        if big.have == len(big.body):
            self._ready.append(_Frame(big.kind, big.body))
            self._big = None
        return count

    def _start_big(self) -> None:
        """When the buffer starts with the header of a big frame not all here yet, its
        body goes on in a buffer of its own (`_BigFrame`)."""
        buffer = self._buffer
        if len(buffer) < frames.HEADER.size:
            return
        length, kind = frames.HEADER.unpack_from(buffer)
        have = len(buffer) - frames.HEADER.size
        if kind not in (frames.PUBLISH, frames.STREAM) or length > frames.FRAME_BYTES_MAX:
            return  # refused by _next_frame
        if length <= _RECV_BYTES or have >= length:
            return
        body = bytearray(length)
        body[:have] = buffer[frames.HEADER.size :]
        buffer.clear()
        self._big = _BigFrame(kind, body, have)

    def _held(self) -> int:
        """Bytes read and not served yet."""
        big = 0 if self._big is None else self._big.have
        return len(self._buffer) + big + sum(len(frame.body) for frame in self._ready)

    def _serve_buffered(self) -> bool:
        """Starts the buffered frames' publishes, one at a time (caller holds the lock);
        True when one went to group commit. A refused frame ends the connection."""
        started = False
        self._starting = True
        try:
            while not self._in_flight and not self._closed:
                try:
                    frame = self._next_frame()
                except frames.FrameError as error:
                    log.info("publish port: closing a connection reason=%s", error.detail)
                    self._refuse(InvalidArgument("publish port frame", error.detail))
                    self._shut()
                    return started
                if frame is None:
                    return started
                if frame.kind == frames.STREAM:
                    self._hand_back(frame.body)
                    return started
                try:
                    publish = self._port.begin(frame.body, wait=False)
                except RaftStoreError as error:
                    self._send(frames.ERROR, frames.error_body(error))
                    continue
                except WouldWait:
                    # A transfer under way, or a new term's first entry not applied: the
                    # wait for either needs this very thread. A thread of its own waits.
                    self._in_flight = True
                    threading.Thread(
                        target=self._begin_waiting,
                        args=(frame.body,),
                        name="publish-conn",
                        daemon=True,
                    ).start()
                    return started
                self._in_flight = started = True
                publish.future.add_done_callback(functools.partial(self._on_done, publish))
            return started
        finally:
            self._starting = False

    def _next_frame(self) -> _Frame | None:
        if self._ready:
            return self._ready.popleft()
        buffer = self._buffer
        if len(buffer) < frames.HEADER.size:
            return None
        head = bytes(buffer[: frames.HEADER.size])
        kind, length = frames.parse_header(head, frames.FRAME_BYTES_MAX)
        if kind not in (frames.PUBLISH, frames.STREAM):
            raise frames.FrameError(f"frame kind {kind} where a PUBLISH was expected")
        end = frames.HEADER.size + length
        if len(buffer) < end:
            return None
        body = bytes(buffer[frames.HEADER.size : end])
        del buffer[:end]
        self._start_big()  # the next frame may be a big one, begun in this buffer
        return _Frame(kind, body)

    def _hand_back(self, body: bytes | bytearray) -> None:
        """A STREAM: the rest of the connection is served by a thread (host thread)."""
        self._closed = True  # to this object: the thread owns the socket from here
        self._host.release(self._fd)
        self._connection.setblocking(True)
        self._port.serve_stream(self._connection, self._unserved(), bytes(body))

    def _unserved(self) -> bytes:
        """Every byte read and not served, in the order it came (the frames whose bodies
        were received apart with their headers again)."""
        parts = [frames.header(f.kind, len(f.body)) + bytes(f.body) for f in self._ready]
        big = self._big
        if big is not None:
            parts.append(frames.header(big.kind, len(big.body)) + bytes(big.body[: big.have]))
        parts.append(bytes(self._buffer))
        self._ready.clear()
        self._big = None
        self._buffer = bytearray()
        return b"".join(parts)

    def _begin_waiting(self, body: bytes | bytearray) -> None:
        """A publish the leader holds for a moment, on a thread of its own."""
        try:
            publish = self._port.begin(body)
        except RaftStoreError as error:
            with self._lock:
                if not self._closed:
                    self._send(frames.ERROR, frames.error_body(error))
                    self._in_flight = False
                    self._host.call_soon(self._resume)
            return
        except Exception:
            # A bug, as it would be on a connection's own thread: the connection ends.
            log.exception("publish port: a held publish failed")
            self._shut()
            return
        publish.future.add_done_callback(functools.partial(self._on_done, publish))

    # --- the thread that completes a publish's future ---

    def _on_done(self, publish: StartedPublish, _future: object) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                response = publish.answer()
            except RaftStoreError as error:
                self._send(frames.ERROR, frames.error_body(error))
            else:
                if self._send(frames.ANSWER, response.SerializeToString()):
                    self._port.answered()
            self._in_flight = False
            if not self._starting and (self._buffer or self._ready):
                # A pipelined PUBLISH waited behind this one: its turn, on the host's
                # thread (this may be another group's).
                self._host.call_soon(self._resume)

    def _resume(self) -> None:
        """Serves what waited behind an answer (host thread, tick lock)."""
        with self._guard():
            with self._lock:
                if self._closed:
                    return
                started = self._serve_buffered()
            if started:
                self._host.propose_now()

    def _send(self, kind: int, body: bytes) -> bool:
        """Writes one frame without blocking. An answer is small and the client reads it
        before it sends again, so the socket takes it whole; when it does not (a client
        that stopped reading), the connection is shut: the client's retry of the same
        sequence is answered from the producer window."""
        data = frames.frame(kind, body)
        try:
            sent = self._connection.send(data)
        except OSError:
            sent = -1
        if sent == len(data):
            return True
        self._shut()
        return False

    def _refuse(self, error: RaftStoreError) -> None:
        self._send(frames.ERROR, frames.error_body(error))

    def _shut(self) -> None:
        """Ends the connection from any thread: the host's poll sees it hang up and
        closes it (`on_event`)."""
        with contextlib.suppress(OSError):
            self._connection.shutdown(socket.SHUT_RDWR)
