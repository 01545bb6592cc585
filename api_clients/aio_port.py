"""The asyncio client's publishes over a node's publish port (raftstore/publish_port.py).

api_clients/publish_port.py does this for the threaded Session; here the same exchange runs
on the session's event loop: a waited publish over `grpc.aio` costs a Python gRPC call on
each side (~0.3 ms), the framed exchange on a plain connection a few tens of microseconds.
Same frames (hastream/publish_frames.py), same rules:

- a site's port is learned from a gRPC Publish's answer (`PublishResponse.publish_port`);
- the port is an optimisation, never a requirement: a port that cannot be dialled, or that
  does not greet like a publish port, raises PortRefused with nothing sent (the attempt
  goes over gRPC) and is tried again after publish_port.PORT_RETRY_S;
- once a request was sent, a lost connection is the attempt's failure (SiteUnavailable,
  retried by the session with the same producer id and sequence, so a publish that did
  commit is answered as a duplicate), and no answer within the attempt's timeout is
  DeadlineExceeded;
- TLS as on the client port (the session's CA and client certificate, the node's name
  checked).

Waited publishes only: the asyncio client has no pipelines. Bounded as the threaded client's:
at most publish_port.CONNECTIONS_PER_SITE_MAX connections per site (beyond them, gRPC), a
frame read only up to publish_frames.FRAME_BYTES_MAX. A connection serves one request at a
time; one whose request was cut short (a timeout, a cancelled task) is closed, never reused
with an answer still on its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass

from api_clients.publish_port import (
    CONNECT_TIMEOUT_S,
    CONNECTIONS_PER_SITE_MAX,
    KnownPort,
    PortPool,
    PortRefused,
    answer_of,
)
from api_clients.transport import DeadlineExceeded, SiteUnavailable
from hastream import publish_frames as frames
from hastream.errors import RaftStoreError
from proto import hastream_pb2

_Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class _Site(KnownPort[_Connection]):
    busy: int = 0  # connections out for a request, dials included


class AioPublishPorts(PortPool[_Site]):
    """One AioSession's publish-port connections, used on its event loop (the pool's
    bookkeeping is PortPool's; a connection is used by one task at a time)."""

    def _new_site(self) -> _Site:
        return _Site()

    def _close(self, connection: _Connection) -> None:
        _close(connection)

    async def publish(
        self, site: str, request: hastream_pb2.PublishRequest, token: str, timeout_s: float
    ) -> hastream_pb2.PublishResponse:
        """Sends `request` over `site`'s publish port and waits for its answer. Raises
        PortRefused when the port cannot be used (nothing sent: use gRPC), the node's
        typed error, or SiteUnavailable / DeadlineExceeded / RpcFailed."""
        known, port, (reader, writer) = await self._take(site)
        healthy = False
        try:
            body_parts = frames.publish_body(token, request.SerializeToString())
            writer.write(frames.frame(frames.PUBLISH, *body_parts))
            try:
                kind, body = await asyncio.wait_for(_exchange(reader, writer), timeout_s)
            except TimeoutError:
                raise DeadlineExceeded(site, timeout_s) from None
            except (OSError, EOFError, asyncio.IncompleteReadError, frames.FrameError) as error:
                raise SiteUnavailable(
                    site, "UNAVAILABLE", f"publish port connection lost: {error!r}"
                ) from None
            outcome, healthy = answer_of(site, kind, body)
            if isinstance(outcome, RaftStoreError):
                raise outcome
            return outcome
        finally:
            # Also when the task was cancelled mid-request: an unhealthy connection is
            # closed, so no late answer is ever read as the next request's.
            self._give_back(known, port, (reader, writer), healthy)

    async def close(self) -> None:
        """Closes every idle connection; one out for a request is closed when it returns."""
        with self._lock:
            self._closed = True
            writers = [writer for known in self._sites.values() for _, writer in known.idle]
            for known in self._sites.values():
                known.idle = []
        for writer in writers:
            writer.close()
        for writer in writers:
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()

    async def _take(self, site: str) -> tuple[_Site, int, _Connection]:
        """An idle connection to `site`'s port, or a new one; with the port it goes to."""
        with self._lock:
            known = self._sites.get(site)
            if self._closed or known is None or known.port == 0:
                raise PortRefused(site)
            port = known.port
            while known.idle:
                reader, writer = known.idle.pop()
                # The node's FIN (an idle connection it closed, or a restart): a request
                # sent on it would fail although the node is there.
                if reader.at_eof() or writer.is_closing():
                    writer.close()
                    continue
                known.busy += 1
                return known, port, (reader, writer)
            if known.busy >= CONNECTIONS_PER_SITE_MAX:
                raise PortRefused(site)
            known.busy += 1  # before the dial's awaits: concurrent dials count to the bound
        try:
            return known, port, await self._dial(site, port)
        except BaseException:
            with self._lock:
                known.busy -= 1
            raise

    async def _dial(self, site: str, port: int) -> _Connection:
        """A greeted connection to `site`'s host on `port`; PortRefused (and the port put
        aside for PORT_RETRY_S) when there is none."""
        host = site.rsplit(":", 1)[0]
        name = None if self._tls is None else self._server_name or host
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=self._tls, server_hostname=name),
                CONNECT_TIMEOUT_S,
            )
        except (OSError, TimeoutError) as error:  # ssl.SSLError is an OSError
            self._set_aside(site, port, f"cannot connect: {error!r}")
            raise PortRefused(site) from None
        try:
            writer.write(frames.frame(frames.HELLO, frames.BANNER))
            kind, body = await asyncio.wait_for(
                _exchange(reader, writer, frames.HELLO_BYTES_MAX), CONNECT_TIMEOUT_S
            )
            if kind != frames.HELLO or not body.startswith(frames.BANNER + b" "):
                raise frames.FrameError(f"greeted with frame kind {kind}")
        except (
            OSError,
            EOFError,
            TimeoutError,
            asyncio.IncompleteReadError,
            frames.FrameError,
        ) as error:
            writer.close()
            self._set_aside(site, port, f"no publish port greeting: {error!r}")
            raise PortRefused(site) from None
        except BaseException:  # cancelled while greeting: no half-greeted connection left
            writer.close()
            raise
        return reader, writer

    def _give_back(self, known: _Site, port: int, connection: _Connection, healthy: bool) -> None:
        """A connection back from a request: kept for the next one when it is healthy and
        the site still has that port, else closed."""
        with self._lock:
            known.busy -= 1
            if healthy and not self._closed and known.port == port:
                known.idle.append(connection)
                return
        _close(connection)


def _close(connection: _Connection) -> None:
    connection[1].close()


async def _exchange(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    body_bytes_max: int = frames.FRAME_BYTES_MAX,
) -> tuple[int, bytes]:
    """Flushes what was written, then reads the next frame's (kind, body)."""
    await writer.drain()
    head = await reader.readexactly(frames.HEADER.size)
    kind, length = frames.parse_header(head, body_bytes_max)
    body = await reader.readexactly(length) if length else b""
    return kind, body


__all__ = ["AioPublishPorts"]
