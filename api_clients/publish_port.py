"""Publishes over a node's publish port (raftstore/publish_port.py) instead of gRPC.

A node that serves a publish port says so in every answer to a gRPC Publish
(`PublishResponse.publish_port`) and in its status; the session remembers it per site,
and the next publishes to that site go over a plain TCP connection to the site's host and
that port, framed as hastream/publish_frames.py describes: a Python gRPC call costs ~0.3
ms and ~300 us of CPU on each side, the framed exchange ~20 us. Waited publishes share a
few pooled connections (`publish`); a pipeline's PublishStream takes a connection of its
own for as long as it runs (`open_stream`, `PortStream`, used as gRPC's stream is). Same
requests, same answers, same typed errors; the session's retry policy (call_policy) and
the pipeline's (pipeline.py) treat both transports alike.

The port is an optimisation, never a requirement: when it cannot be dialled or does not
greet like a publish port (a firewall, a published Docker port that maps only gRPC, some
other service behind the number), nothing was sent, and the attempt goes over gRPC; the
site's port is tried again after PORT_RETRY_S. Once a request was sent, a lost connection
is the attempt's failure (SiteUnavailable or StreamBroken, retried with the same producer
id and sequence, so a publish that did commit is answered as a duplicate, not appended
twice); no answer within a waited attempt's timeout is DeadlineExceeded. A session with TLS
speaks TLS to the port as to the client port (same CA, same client certificate, the
node's name checked); over TLS only waited publishes use it, pipelines stay on gRPC.

Bounded: at most CONNECTIONS_PER_SITE_MAX connections per site, pooled and streams
together (beyond them, gRPC), and a frame is read only up to
publish_frames.FRAME_BYTES_MAX.
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from api_clients.transport import (
    DeadlineExceeded,
    RpcFailed,
    SiteUnavailable,
    Stream,
    StreamBroken,
)
from hastream import publish_frames as frames
from hastream.errors import RaftStoreError
from hastream.tls import ClientTls
from proto import hastream_pb2

log = logging.getLogger(__name__)

CONNECTIONS_PER_SITE_MAX: Final = 8
# A port that could not be dialled, or did not greet, is tried again after this long.
PORT_RETRY_S: Final = 30.0
CONNECT_TIMEOUT_S: Final = 2.0


class PortRefused(Exception):
    """The site's publish port cannot be used now (nothing was sent): use gRPC."""


Connection = TypeVar("Connection")


@dataclass
class KnownPort(Generic[Connection]):
    """What a pool knows of one site's publish port."""

    port: int = 0  # as the node said; 0: none known
    retry_at: float = 0.0  # monotonic time before which the port is not dialled again
    idle: list[Connection] = field(default_factory=list)


SiteT = TypeVar("SiteT", bound=KnownPort[Any])


class PortPool(Generic[SiteT]):
    """What the threaded and the asyncio client's pools of publish-port connections share
    (this module's PublishPorts, aio_port.py's AioPublishPorts): the port each site named,
    when a port that failed is dialled again, the idle connections. Thread-safe."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        self._clock = clock
        self._tls = tls  # the session's TLS: the port speaks it as the client port does
        self._server_name = server_name
        self._lock = threading.Lock()
        self._sites: dict[str, SiteT] = {}
        self._closed = False

    def _new_site(self) -> SiteT:
        """A pool's record of a site it has not heard of yet."""
        raise NotImplementedError

    def _close(self, connection: Any) -> None:
        """Close one idle connection of the pool's kind."""
        raise NotImplementedError

    def learn(self, site: str, port: int) -> None:
        """`site` (host:port of its gRPC) serves publishes on `port` (0: it does not)."""
        with self._lock:
            known = self._sites.setdefault(site, self._new_site())
            if known.port == port:
                return
            known.port, known.retry_at = port, 0.0
            stale, known.idle = known.idle, []
        for connection in stale:
            self._close(connection)

    def usable(self, site: str, payload_bytes: int) -> bool:
        """Whether a publish of `payload_bytes` to `site` should try the port."""
        if payload_bytes > frames.PAYLOAD_BYTES_MAX:
            return False
        with self._lock:
            known = self._sites.get(site)
            return (
                not self._closed
                and known is not None
                and known.port != 0
                and known.retry_at <= self._clock()
            )

    def _set_aside(self, site: str, port: int, reason: str) -> None:
        log.info("publish port not used site=%s port=%d reason=%s", site, port, reason)
        with self._lock:
            known = self._sites.get(site)
            if known is not None and known.port == port:
                known.retry_at = self._clock() + PORT_RETRY_S


@dataclass
class _Site(KnownPort[socket.socket]):
    busy: set[socket.socket] = field(default_factory=set)
    left: int = 0  # how often the session left the site (drop)


class PublishPorts(PortPool[_Site]):
    """One Session's publish-port connections. Thread-safe: a connection serves one
    request at a time; publishing threads take idle ones or dial more, up to the bound."""

    def _new_site(self) -> _Site:
        return _Site()

    def _close(self, connection: socket.socket) -> None:
        frames.shut(connection)

    def publish(
        self, site: str, request: hastream_pb2.PublishRequest, token: str, timeout_s: float
    ) -> hastream_pb2.PublishResponse:
        """Sends `request` over `site`'s publish port and waits for its answer. Raises
        PortRefused when the port cannot be used (nothing sent: use gRPC), the node's
        typed error, or SiteUnavailable / DeadlineExceeded / RpcFailed."""
        left = self._times_left(site)
        try:
            connection = self._take(site, timeout_s)
        except PortRefused:
            if self._times_left(site) != left:
                # The session's hedge left this (silent) site while the port was dialled:
                # the attempt is over, not to be made again over gRPC (whose new channel
                # nobody would close).
                raise SiteUnavailable(site, "CANCELLED", "the session left this site") from None
            raise
        healthy = False
        try:
            body_parts = frames.publish_body(token, request.SerializeToString())
            try:
                # In the try: the session's hedge may have closed the connection (`drop`).
                connection.settimeout(timeout_s)
                frames.send_frame(connection, frames.PUBLISH, *body_parts)
                kind, body = _read_frame(connection, frames.FRAME_BYTES_MAX)
            except TimeoutError:
                raise DeadlineExceeded(site, timeout_s) from None
            except (OSError, EOFError, frames.FrameError) as error:
                raise SiteUnavailable(
                    site, "UNAVAILABLE", f"publish port connection lost: {error}"
                ) from None
            outcome, healthy = answer_of(site, kind, body)
            if isinstance(outcome, RaftStoreError):
                raise outcome
            return outcome
        finally:
            self._give_back(site, connection, healthy)

    @property
    def streams(self) -> bool:
        """Whether pipelines may use the port (not over TLS: see `open_stream`)."""
        return self._tls is None

    def known(self, site: str) -> bool:
        """Whether the session knows if `site` serves a publish port (either way)."""
        with self._lock:
            return site in self._sites

    def open_stream(
        self, site: str, requests: Iterator[hastream_pb2.PublishBatch], token: str
    ) -> PortStream:
        """A PublishStream call over `site`'s publish port, on a connection of its own
        (counted with the site's others until the stream ends). Raises PortRefused when
        the port cannot be used: nothing was sent, use gRPC. Not over TLS: the stream
        reads and writes its connection from two threads, which one OpenSSL connection
        does not allow (the node refuses it too)."""
        if self._tls is not None:
            raise PortRefused(site)
        connection = self._take(site, CONNECT_TIMEOUT_S, fresh=True)
        try:
            connection.settimeout(None)  # a stream waits for answers as long as it runs
            frames.send_frame(connection, frames.STREAM, frames.stream_body(token))
        except OSError:
            self._give_back(site, connection, healthy=False)
            raise PortRefused(site) from None
        return PortStream(
            connection,
            site,
            requests,
            ended=lambda: self._give_back(site, connection, healthy=False),
        )

    def drop(self, site: str) -> None:
        """Closes `site`'s connections, idle and in use (a request waiting on one fails
        SiteUnavailable at once): the session left a silent site. The ones in use leave the
        site's books too: a request whose answer came just before is given its connection
        back closed, and `_give_back` must not keep it as idle (the next request on it
        failed with a bare OSError, EBADF)."""
        with self._lock:
            known = self._sites.get(site)
            connections = [] if known is None else [*known.idle, *known.busy]
            if known is not None:
                known.idle = []
                known.busy = set()
                known.left += 1
        for connection in connections:
            frames.shut(connection)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sites = list(self._sites)
        for site in sites:
            self.drop(site)

    def _times_left(self, site: str) -> int:
        with self._lock:
            known = self._sites.get(site)
            return 0 if known is None else known.left

    def _take(self, site: str, timeout_s: float, *, fresh: bool = False) -> socket.socket:
        with self._lock:
            known = self._sites.get(site)
            if self._closed or known is None or known.port == 0:
                raise PortRefused(site)
            while known.idle and not fresh:
                connection = known.idle.pop()
                if _closed_by_node(connection):  # idle too long, or the node restarted
                    frames.shut(connection)
                    continue
                known.busy.add(connection)
                return connection
            if len(known.busy) >= CONNECTIONS_PER_SITE_MAX:
                raise PortRefused(site)
            port = known.port
        connection = self._dial(site, port, min(timeout_s, CONNECT_TIMEOUT_S))
        with self._lock:
            known.busy.add(connection)
        return connection

    def _dial(self, site: str, port: int, timeout_s: float) -> socket.socket:
        """A greeted connection to `site`'s host on `port`; PortRefused (and the port put
        aside for PORT_RETRY_S) when there is none."""
        host = site.rsplit(":", 1)[0]
        try:
            connection = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as error:
            self._set_aside(site, port, f"cannot connect: {error}")
            raise PortRefused(site) from None
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:  # the handshake, under the dial's timeout
                connection = self._tls.wrap_socket(
                    connection, server_hostname=self._server_name or host
                )
            frames.send_frame(connection, frames.HELLO, frames.BANNER)
            kind, body = _read_frame(connection, frames.HELLO_BYTES_MAX)
            if kind != frames.HELLO or not body.startswith(frames.BANNER + b" "):
                raise frames.FrameError(f"greeted with frame kind {kind}")
        except (OSError, EOFError, frames.FrameError) as error:
            frames.shut(connection)
            self._set_aside(site, port, f"no publish port greeting: {error}")
            raise PortRefused(site) from None
        return connection

    def _give_back(self, site: str, connection: socket.socket, healthy: bool) -> None:
        with self._lock:
            known = self._sites.get(site)
            kept = known is not None and connection in known.busy
            if kept:
                assert known is not None
                known.busy.discard(connection)
                if healthy and not self._closed:
                    known.idle.append(connection)
                    return
        frames.shut(connection)


def client_context(tls: ClientTls) -> ssl.SSLContext:
    """The session's TLS as an ssl context for the publish port: the same CA (the system's
    roots without one), the same client certificate, the node's name checked."""
    context = ssl.create_default_context(cafile=tls.ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert_file is not None and tls.key_file is not None:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


class PortStream(Stream):
    """A PublishStream call over a publish port, used as gRPC's (transport.Stream):
    iterating yields the PublishAcks and raises the call's typed failure; `cancel()`, from
    any thread, ends it. A sender thread writes the requests' BATCH frames (as gRPC's own
    thread pulls a request iterator) and an END frame after the last."""

    def __init__(
        self,
        connection: socket.socket,
        site: str,
        requests: Iterator[hastream_pb2.PublishBatch],
        *,
        ended: Callable[[], None],
    ) -> None:
        super().__init__(None, site, None)
        self._connection = connection
        self._ended = ended
        self._sender = threading.Thread(
            target=self._send, args=(requests,), name="publish-port-stream", daemon=True
        )
        self._sender.start()

    def _send(self, requests: Iterator[hastream_pb2.PublishBatch]) -> None:
        try:
            for batch in requests:
                frames.send_frame(self._connection, frames.BATCH, batch.SerializeToString())
            frames.send_frame(self._connection, frames.END)
        except OSError:
            pass  # the connection ended: the reader says how

    def __iter__(self) -> Iterator[Any]:
        try:
            while True:
                try:
                    kind, body = _read_frame(self._connection, frames.FRAME_BYTES_MAX)
                except EOFError:
                    return  # the node answered everything after our END
                except (OSError, frames.FrameError) as error:
                    raise StreamBroken(self.site, f"publish port stream: {error}") from None
                if kind == frames.ACKS:
                    yield hastream_pb2.PublishAcks.FromString(body)
                elif kind == frames.ERROR:
                    typed = frames.parse_error(body)
                    if typed is None:
                        raise RpcFailed(self.site, "UNKNOWN", f"publish port: {body[:200]!r}")
                    raise typed
                else:
                    raise StreamBroken(self.site, f"publish port sent frame kind {kind}")
        finally:
            self._ended()

    def cancel(self) -> None:
        frames.shut(self._connection)


def _closed_by_node(connection: socket.socket) -> bool:
    """Whether the node closed an idle connection (its FIN or RST has arrived): a request
    sent on it would fail although the node is there. One closed on this side (EBADF) is
    closed too."""
    try:
        # Non-blocking: with a timeout set, CPython would first poll for up to that long.
        connection.settimeout(0.0)
        # The socket's own bytes, under TLS too (an SSLSocket refuses recv flags): the
        # node's FIN reads as b"", a TLS record waiting (a session ticket) as data.
        return socket.socket.recv(connection, 1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False  # open, nothing to read: as it should be between requests
    except OSError:
        return True


def answer_of(
    site: str, kind: int, body: bytes
) -> tuple[hastream_pb2.PublishResponse | RaftStoreError, bool]:
    """What the frame answering a PUBLISH says: the response, or the error to raise (the
    node's typed one, else RpcFailed); and whether the connection may carry the next
    request."""
    if kind == frames.ANSWER:
        return hastream_pb2.PublishResponse.FromString(body), True
    if kind == frames.ERROR:
        typed = frames.parse_error(body)
        if typed is None:
            return RpcFailed(site, "UNKNOWN", f"publish port error: {body[:200]!r}"), False
        # The node closes the connection after an error about the frame itself.
        return typed, getattr(typed, "argument", None) != "publish port frame"
    return RpcFailed(site, "INTERNAL", f"publish port answered frame kind {kind}"), False


def _read_frame(connection: socket.socket, body_bytes_max: int) -> tuple[int, bytes]:
    """publish_frames.read_frame on the socket itself: no buffered reader, whose state a
    timeout would leave undefined on a pooled connection."""
    return frames.read_frame(functools.partial(_read_exactly, connection), body_bytes_max)


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    """`size` bytes, fewer only when the node closed first."""
    chunks: list[bytes] = []
    left = size
    while left:
        chunk = connection.recv(min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
