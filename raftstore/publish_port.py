"""The publish port: publishes over framed TCP, beside the gRPC port.

A waited one-row publish spends about a third of its CPU, and ~0.3 ms of its latency, in
Python's gRPC (the client's call and the node's serving thread and worker; bench
thread_costs). Here the same requests arrive on a plain connection, framed as
hastream/publish_frames.py describes, and are answered on it, with one thread per
connection at first:
- a unary publish (PUBLISH): checked by the same `service.begin_publish` as gRPC's
  Publish, handed to group commit; the thread waits for its answer and writes it back.
  After that first answer, a plain connection to a group this node leads moves to that
  group's Raft loop (port_loop.py), which serves its next publishes on the tick thread;
- a pipelined stream (STREAM, then BATCH frames): served by the same
  `raftstore/pipeline.PublishStream` as gRPC's PublishStream (its reader thread takes the
  BATCH frames, this thread writes the ACKS), for the rest of the connection.
Nothing else is served here. A client learns the port from a gRPC Publish's answer
(`PublishResponse.publish_port`) or the node's status, and falls back to gRPC whenever
the port does not answer (api_clients/publish_port.py).

Bounded: at most `connections_max` connections (one more is told Overloaded and closed),
frames of at most publish_frames.FRAME_BYTES_MAX (gRPC's message bound), a stream's
requests in flight as PublishStream bounds them, and a connection idle for
IDLE_TIMEOUT_S (or a frame that stops arriving half-way) is closed. Garbage gets an
InvalidArgument frame and the connection is closed; nothing reaches group commit unless
it parsed. A node with TLS on its client port serves TLS here too, with the same
certificate (and client certificates required with `tlsClientAuth=require`): waited
publishes only, as one connection's reads and writes would otherwise run on two threads.
"""

from __future__ import annotations

import contextlib
import io
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Final, cast

from hastream import publish_frames as frames
from hastream.errors import InvalidArgument, Overloaded, RaftStoreError
from raftstore import port_loop, publish_wire
from raftstore.auth import TOKEN_METADATA_KEY
from raftstore.pipeline import StreamedPublish
from raftstore.port_loop import LoopedConnection
from raftstore.replica import ConnectionHost
from raftstore.service import (
    NodeView,
    StartedPublish,
    begin_publish,
    open_publish_stream,
    publish_acks,
    streamed,
)
from raftstore.threads import Spawn

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S: Final = port_loop.IDLE_TIMEOUT_S
_READ_BYTES: Final = 64 * 1024
HELLO_TIMEOUT_S: Final = 10.0
ACCEPT_POLL_S: Final = 0.5  # how soon the accept loop sees close()


class PublishPort:
    """Listens on `host:port` (0: any free port, see `port`) once `start` is called."""

    def __init__(
        self,
        node: NodeView,
        host: str,
        port: int,
        *,
        spawn: Spawn,
        connections_max: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._node = node
        self._tls = tls
        self._spawn = spawn
        self._connections_max = connections_max
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.settimeout(ACCEPT_POLL_S)
        self._port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._looped: set[socket.socket] = set()  # of those, the ones a Raft loop serves
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._answered = 0

    @property
    def port(self) -> int:
        return self._port

    def start(self) -> None:
        self._thread = self._spawn("publish-port", self._accept_loop)

    def close(self) -> None:
        """Stops accepting and closes every connection (a publish in flight still commits;
        its client sees the connection end and resends it, deduplicated)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
            looped = set(self._looped)
        for connection in connections:
            if connection in looped:
                # Its loop closes it, once its poll sees it hang up: closed here, its
                # descriptor number could be reused while the loop still polls it.
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
            else:
                frames.shut(connection)

    def status(self) -> dict[str, int]:
        """The port, its open connections and the publishes it answered (GetNodeStatus,
        /metrics)."""
        with self._lock:
            return {
                "port": self.port,
                "connections": len(self._connections),
                "answered": self._answered,
            }

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                connection, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as error:  # EMFILE and the like: the client retries elsewhere
                if self._closed.is_set():
                    return
                log.warning("publish port accept failed error=%s", error)
                self._closed.wait(ACCEPT_POLL_S)
                continue
            with self._lock:
                admitted = len(self._connections) < self._connections_max
                if admitted:
                    self._connections.add(connection)
            if not admitted:
                _refuse(connection, Overloaded("publish port connections", self._connections_max))
                continue
            # Per connection, not registered with the node's Threads: it lives as long as
            # its client (see threads.py), and close() ends it by shutting its socket.
            threading.Thread(
                target=self._serve,
                args=(connection, f"{peer[0]}:{peer[1]}"),
                name="publish-conn",
                daemon=True,
            ).start()

    def _serve(self, connection: socket.socket, peer: str) -> None:
        with self._connection_ends(connection, peer) as ending:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.settimeout(HELLO_TIMEOUT_S)
            if self._tls is not None:
                connection = ending.connection = self._handshake(connection)
            reader = _buffered_reader(connection)
            kind, body = frames.read_frame(reader.read, frames.HELLO_BYTES_MAX)
            if kind != frames.HELLO or body != frames.BANNER:
                raise frames.FrameError("the first frame is not this protocol's HELLO")
            greeting = frames.BANNER + b" " + self._node.alias.encode()
            frames.send_frame(connection, frames.HELLO, greeting)
            connection.settimeout(IDLE_TIMEOUT_S)
            while not self._closed.is_set():
                kind, body = frames.read_frame(reader.read, frames.FRAME_BYTES_MAX)
                if kind == frames.STREAM:
                    if self._tls is not None:
                        # Its reader thread would read the TLS connection while this one
                        # writes: OpenSSL does not allow that on one connection.
                        raise frames.FrameError("no publish streams over TLS: use gRPC's")
                    self._stream(connection, reader.read, body)
                    return  # a stream is the rest of its connection
                if kind != frames.PUBLISH:
                    raise frames.FrameError(f"frame kind {kind} where a PUBLISH was expected")
                host = self._answer(connection, body)
                if host is not None and self._hand_to_loop(connection, reader, host):
                    ending.handed_over = True
                    return

    def _hand_to_loop(
        self, connection: socket.socket, reader: io.BufferedReader, host: ConnectionHost
    ) -> bool:
        """After its first answer, a plain connection to a leader moves to the leader's
        Raft event loop (port_loop.py), with what its reader holds past that request.
        False: it stays on this thread (TLS, or the port closing)."""
        if self._tls is not None:
            return False
        with self._lock:
            # Under the lock `close` takes its list with: either it is closing already, or
            # it will find this connection looped and leave the closing to the loop.
            if self._closed.is_set():
                return False
            self._looped.add(connection)
        # Non-blocking, peek hands over what the reader buffered (a request sent before
        # the answer came), or what the socket holds now, and never waits.
        connection.setblocking(False)
        pending = reader.peek()
        leftover = reader.read1(len(pending)) if pending else b""
        looped = LoopedConnection(connection, leftover, self, host)
        if looped.start():
            return True
        with self._lock:
            self._looped.discard(connection)
        # The loop is closing (its member stops): so does the connection, whose reader
        # gave its bytes to the loop. The client resends elsewhere.
        raise ConnectionAbortedError("the raft loop is closing")

    @contextlib.contextmanager
    def _connection_ends(self, connection: socket.socket, peer: str) -> Iterator[_Ending]:
        """Ends a connection's thread: the error it ended with is answered or logged, and
        the connection closed, unless the thread handed it over to a loop."""
        ending = _Ending(connection)
        try:
            yield ending
        except frames.FrameError as error:
            log.info("publish port: closing a connection peer=%s reason=%s", peer, error.detail)
            _refuse(ending.connection, InvalidArgument("publish port frame", error.detail))
        except (ConnectionError, TimeoutError, EOFError):
            pass  # the client left, or went quiet: its retry goes elsewhere or reconnects
        except OSError as error:
            log.debug("publish port connection ended peer=%s error=%s", peer, error)
        finally:
            if not ending.handed_over:
                self.forget(ending.connection)
                frames.shut(ending.connection)

    def _handshake(self, connection: socket.socket) -> socket.socket:
        """The TLS connection over `connection` (the handshake under the greeting's
        timeout; ssl.SSLError, an OSError, ends the connection). It replaces `connection`
        among those close() shuts."""
        assert self._tls is not None
        wrapped = self._tls.wrap_socket(connection, server_side=True)
        with self._lock:
            self._connections.discard(connection)
            self._connections.add(wrapped)
        return wrapped

    def _answer(self, connection: socket.socket, body: bytes) -> ConnectionHost | None:
        """Hands one PUBLISH to group commit, waits for it and sends its answer. Returns
        the event loop of the group it went to when this node leads it (else None)."""
        try:
            started = self.begin(body)
            response = started.answer()
        except RaftStoreError as error:
            frames.send_frame(connection, frames.ERROR, frames.error_body(error))
            return None
        self.answered()
        frames.send_frame(connection, frames.ANSWER, response.SerializeToString())
        return started.host

    # --- port_loop.Port: for the connections a Raft loop serves (any thread) ---

    def begin(self, body: bytes | bytearray, *, wait: bool = True) -> StartedPublish:
        token, request_bytes = frames.split_publish(body)
        try:
            request = publish_wire.parse_publish(request_bytes)
        except publish_wire.WireError as error:
            raise InvalidArgument("publish request", error.detail) from None
        metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
        return begin_publish(self._node, request, metadata, wait=wait)

    def answered(self) -> None:
        with self._lock:
            self._answered += 1

    def serve_stream(self, connection: socket.socket, leftover: bytes, body: bytes) -> None:
        with self._lock:
            self._looped.discard(connection)
        threading.Thread(
            target=self._serve_stream,
            args=(connection, leftover, body),
            name="publish-conn",
            daemon=True,
        ).start()

    def forget(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.discard(connection)
            self._looped.discard(connection)

    def _serve_stream(self, connection: socket.socket, leftover: bytes, body: bytes) -> None:
        """A STREAM that came in on a connection a Raft loop served (port_loop.py)."""
        with self._connection_ends(connection, "a looped connection"):
            connection.settimeout(IDLE_TIMEOUT_S)
            reader = _buffered_reader(connection)
            read = reader.read if not leftover else _Chained(leftover, reader).read
            self._stream(connection, read, body)

    def _stream(self, connection: socket.socket, read: Callable[[int], bytes], body: bytes) -> None:
        """One PublishStream call on this connection (publish_frames' STREAM), served by
        raftstore/pipeline.py as gRPC's is: its reader thread takes the BATCH frames, this
        thread sends the ACKS frames, then the error that ends the stream, if one does."""
        token, rest = frames.split_publish(body)
        if rest:
            raise frames.FrameError("a STREAM frame carries the token alone")
        metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
        garbage: list[frames.FrameError] = []  # what the reader thread found, if anything
        try:
            stream = open_publish_stream(
                self._node,
                metadata,
                _batches(read, garbage),
                is_active=lambda: not self._closed.is_set(),
            )
        except RaftStoreError as error:
            frames.send_frame(connection, frames.ERROR, frames.error_body(error))
            return
        try:
            for acks in publish_acks(stream):
                frames.send_frame(connection, frames.ACKS, acks.SerializeToString())
                with self._lock:
                    self._answered += len(acks.responses)
        except RaftStoreError as error:
            frames.send_frame(connection, frames.ERROR, frames.error_body(error))
        finally:
            stream.close()
        if garbage:  # after the answers of the requests before it, as gRPC's status
            raise garbage[0]


class _Ending:
    """How a connection's thread ends (`PublishPort._connection_ends`)."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection  # the TLS connection once the handshake replaced it
        self.handed_over = False  # to a Raft loop: not closed by the thread


def _buffered_reader(connection: socket.socket) -> io.BufferedReader:
    """The connection's frames read through C's buffered reader (typeshed types a
    makefile with a buffer size as IOBase; "rb" with one is a BufferedReader)."""
    return cast(io.BufferedReader, connection.makefile("rb", buffering=_READ_BYTES))


class _Chained:
    """Reads `first`, then `rest`: a stream's frames after what a loop had read of them."""

    def __init__(self, first: bytes, rest: io.BufferedReader) -> None:
        self._first = first
        self._rest = rest

    def read(self, size: int) -> bytes:
        if not self._first:
            return self._rest.read(size)
        data, self._first = self._first[:size], self._first[size:]
        if len(data) < size:
            data += self._rest.read(size - len(data))
        return data


def _batches(
    read: Callable[[int], bytes], garbage: list[frames.FrameError]
) -> Iterator[list[StreamedPublish]]:
    """A stream's requests, one BATCH frame at a time (on the stream's reader thread).
    Ends at the client's END frame or when it leaves; a frame that is not a well-formed BATCH
    ends it too, noted in `garbage` for the connection's thread to answer."""
    while True:
        try:
            kind, body = frames.read_frame(read, frames.FRAME_BYTES_MAX)
            if kind == frames.END:
                return  # the client's last request was read
            if kind != frames.BATCH:
                raise frames.FrameError(f"frame kind {kind} inside a publish stream")
            try:
                requests = publish_wire.parse_publish_batch(body)
            except publish_wire.WireError as error:
                raise frames.FrameError(error.detail) from None
        except frames.FrameError as error:
            garbage.append(error)
            return
        except (OSError, EOFError):
            return  # gone: the answers of what was read still go out
        yield streamed(requests)


def _refuse(connection: socket.socket, error: RaftStoreError) -> None:
    """Tells the peer why (best effort), then closes."""
    with contextlib.suppress(OSError):
        connection.settimeout(1.0)
        frames.send_frame(connection, frames.ERROR, frames.error_body(error))
    frames.shut(connection)
