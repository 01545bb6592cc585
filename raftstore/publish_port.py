"""The publish port: waited publishes over framed TCP, beside the gRPC port.

A waited one-row publish spends about a third of its CPU, and ~0.3 ms of its latency, in
Python's gRPC (the client's call and the node's serving thread and worker; bench
thread_costs). Here the same request (a serialized PublishRequest, checked by the same
`service.begin_publish`) arrives on a plain connection, framed as hastream/publish_frames.py
describes, and is answered on it: one thread per connection reads a request, hands it to
group commit, waits for its answer and writes it back. Nothing else is served here; a
client learns the port from a gRPC Publish's answer (`PublishResponse.publish_port`) and
falls back to gRPC whenever the port does not answer (api_clients/publish_port.py).

Bounded: at most `connections_max` connections (one more is told Overloaded and closed),
frames of at most publish_frames.FRAME_BYTES_MAX, a connection idle for IDLE_TIMEOUT_S (or
a frame that stops arriving half-way) is closed. Garbage gets an InvalidArgument frame and
the connection is closed; nothing reaches group commit unless it parsed. Plaintext: a node
with TLS on its client port does not open one (config.py refuses `publishPort` then).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from typing import Final

from hastream import publish_frames as frames
from hastream.errors import InvalidArgument, Overloaded, RaftStoreError
from raftstore import publish_wire
from raftstore.auth import TOKEN_METADATA_KEY
from raftstore.service import NodeView, StartedPublish, begin_publish
from raftstore.threads import Spawn

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S: Final = 120.0
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
    ) -> None:
        self._node = node
        self._spawn = spawn
        self._connections_max = connections_max
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.settimeout(ACCEPT_POLL_S)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._answered = 0

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

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
        for connection in connections:
            _shut(connection)

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
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            read = connection.makefile("rb", buffering=64 * 1024).read
            connection.settimeout(HELLO_TIMEOUT_S)
            kind, body = _read_frame(read, frames.HELLO_BYTES_MAX)
            if kind != frames.HELLO or body != frames.BANNER:
                raise frames.FrameError("the first frame is not this protocol's HELLO")
            _send(connection, frames.HELLO, frames.BANNER + b" " + self._node.alias.encode())
            connection.settimeout(IDLE_TIMEOUT_S)
            while not self._closed.is_set():
                kind, body = _read_frame(read, frames.FRAME_BYTES_MAX)
                if kind != frames.PUBLISH:
                    raise frames.FrameError(f"frame kind {kind} where a PUBLISH was expected")
                self._answer(connection, body)
        except frames.FrameError as error:
            log.info("publish port: closing a connection peer=%s reason=%s", peer, error.detail)
            _refuse(connection, InvalidArgument("publish port frame", error.detail))
        except (ConnectionError, TimeoutError, EOFError):
            pass  # the client left, or went quiet: its retry goes elsewhere or reconnects
        except OSError as error:
            log.debug("publish port connection ended peer=%s error=%s", peer, error)
        finally:
            with self._lock:
                self._connections.discard(connection)
            _shut(connection)

    def _answer(self, connection: socket.socket, body: bytes) -> None:
        """Hands one PUBLISH to group commit, waits for it and sends its answer. (Sending
        the answer from the Raft thread that applied the entry, as gRPC's deferred Publish
        does, measured no faster here: bench.checkouts_ab wait:1, x0.96-0.98 rows/s.)"""
        token, request_bytes = frames.split_publish(body)
        try:
            try:
                request = publish_wire.parse_publish(request_bytes)
            except publish_wire.WireError as error:
                raise InvalidArgument("publish request", error.detail) from None
            metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
            started = begin_publish(self._node, request, metadata)
        except RaftStoreError as error:
            _send(connection, frames.ERROR, frames.error_body(error))
            return
        connection.sendall(self._answer_frame(started))

    def _answer_frame(self, started: StartedPublish) -> bytes:
        """The frame answering a publish once its entry was applied (or it failed)."""
        try:
            response = started.answer()
        except RaftStoreError as error:
            return _frame(frames.ERROR, frames.error_body(error))
        with self._lock:
            self._answered += 1
        return _frame(frames.ANSWER, response.SerializeToString())


def _frame(kind: int, body: bytes) -> bytes:
    return frames.header(kind, len(body)) + body


def _read_frame(read: Callable[[int], bytes], body_bytes_max: int) -> tuple[int, bytes]:
    """The next frame's (kind, body), read with `read` (a buffered reader's). EOFError
    when the peer closed between frames; FrameError for a bad header or a frame cut off."""
    head = read(frames.HEADER.size)
    if not head:
        raise EOFError
    if len(head) < frames.HEADER.size:
        raise frames.FrameError("connection closed inside a frame header")
    kind, length = frames.parse_header(head, body_bytes_max)
    body = read(length) if length else b""
    if len(body) < length:
        raise frames.FrameError("connection closed inside a frame")
    return kind, body


def _send(connection: socket.socket, kind: int, body: bytes) -> None:
    connection.sendall(_frame(kind, body))


def _refuse(connection: socket.socket, error: RaftStoreError) -> None:
    """Tells the peer why (best effort), then closes."""
    try:
        connection.settimeout(1.0)
        _send(connection, frames.ERROR, frames.error_body(error))
    except OSError:
        pass
    _shut(connection)


def _shut(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)
    connection.close()
