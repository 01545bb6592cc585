"""The publish port's wire format, shared by the node (raftstore/publish_port.py) and the
client (api_clients/publish_port.py).

A waited publish over gRPC costs ~0.3 ms of latency and ~300 us of CPU on each side in
Python's gRPC alone (an echo call, docs/benchmark.md); the same exchange over a plain TCP
connection with a length-prefixed frame costs ~17 us and ~16 us. The publish port carries
the two publish exchanges and nothing else: a unary publish (a PublishRequest in, its
PublishResponse or typed error out), or a pipelined stream (PublishStream's PublishBatch
messages in, its PublishAcks out). Every other call stays on gRPC.

A frame is a 5-byte header, the body's length (little-endian u32) and its kind (u8), then
the body:

    HELLO    client -> node: BANNER; node -> client: BANNER, a space, the node's alias.
             The first frame each way: a client that dialled some other service, or a
             node that is not a publish port, is told apart before any request is sent.
    PUBLISH  client -> node: the login token's length (u16) and its ASCII bytes (empty
             when the cluster runs without logins), then a serialized PublishRequest.
    ANSWER   node -> client: a serialized PublishResponse.
    STREAM   client -> node: the login token as in PUBLISH, nothing after it. The rest of
             the connection is one PublishStream call: BATCH frames in, ACKS frames out;
             the client sends END after its last BATCH (gRPC's half-close; TLS has no
             half-close of its own), and the node closes once it answered them all, or
             after an ERROR that ends the stream (as gRPC's PublishStream ends with its
             status; raftstore/pipeline.py). A client that leaves without END ends the
             stream too: the answers of what was read still go out while it listens.
    BATCH    client -> node: a serialized PublishBatch.
    ACKS     node -> client: a serialized PublishAcks.
    END      client -> node: no more BATCH frames (empty body).
    ERROR    node -> client: the typed error as JSON, {"type": ..., "fields": {...}}
             (what errors.to_wire puts in gRPC's trailing metadata). After an error
             about the frame itself (garbage, a body over its bound, a wrong kind) the
             node closes the connection; after a unary publish's own error (NotLeader,
             SchemaMismatch, Unauthenticated...) the connection stays usable.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import struct
from collections.abc import Callable
from typing import Final

from hastream import wire
from hastream.errors import WIRE_FIELDS_KEY, WIRE_TYPE_KEY, RaftStoreError, from_wire

HEADER: Final = struct.Struct("<IB")
TOKEN_LENGTH: Final = struct.Struct("<H")
BANNER: Final = b"hastream-publish/1"

HELLO: Final = 1
PUBLISH: Final = 2
ANSWER: Final = 3
ERROR: Final = 4
STREAM: Final = 5
BATCH: Final = 6
ACKS: Final = 7
END: Final = 8
KINDS: Final = frozenset((HELLO, PUBLISH, ANSWER, ERROR, STREAM, BATCH, ACKS, END))

# The bound of a gRPC message, for the same messages: a request's payload is at most
# wire.BATCH_BYTES_MAX (the client splits bigger data), a PublishBatch packs requests up
# to that, and the rest is the token and protobuf's fields. The node reads a whole frame
# before it looks at it: connections x this bounds what the port holds.
FRAME_BYTES_MAX: Final = wire.GRPC_MESSAGE_BYTES_MAX
PAYLOAD_BYTES_MAX: Final = wire.BATCH_BYTES_MAX
HELLO_BYTES_MAX: Final = 256
TOKEN_BYTES_MAX: Final = 1024


class FrameError(ValueError):
    """Bytes on the publish port that are not a frame of this protocol."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"publish port: {detail}")
        self.detail = detail


def header(kind: int, body_bytes: int) -> bytes:
    return HEADER.pack(body_bytes, kind)


def frame(kind: int, *parts: bytes) -> bytes:
    """One whole frame, its body `parts` joined (small frames; see `send_frame`)."""
    return b"".join((header(kind, sum(len(part) for part in parts)), *parts))


def send_frame(connection: socket.socket, kind: int, *parts: bytes) -> None:
    """Sends one frame whose body is `parts`, without joining them on a plain socket (a
    request's payload is copied once, into the kernel); a TLS socket has no sendmsg, so
    there they are joined. Raises OSError."""
    buffers = [header(kind, sum(len(part) for part in parts)), *parts]
    if isinstance(connection, ssl.SSLSocket):
        connection.sendall(b"".join(buffers))
        return
    views = [memoryview(buffer) for buffer in buffers if len(buffer)]
    while views:  # bounded: every round sends at least one byte or raises
        sent = connection.sendmsg(views)
        while sent:
            if sent < len(views[0]):
                views[0], sent = views[0][sent:], 0
            else:
                sent -= len(views.pop(0))


def read_frame(read: Callable[[int], bytes], body_bytes_max: int) -> tuple[int, bytes]:
    """The next frame's (kind, body). `read(n)` returns n bytes, fewer only at the end of
    the connection (a buffered reader's read). EOFError when the peer closed between
    frames; FrameError for a bad header or a frame cut off by the peer."""
    head = read(HEADER.size)
    if not head:
        raise EOFError("the connection ended")
    if len(head) < HEADER.size:
        raise FrameError("connection closed inside a frame header")
    kind, length = parse_header(head, body_bytes_max)
    body = read(length) if length else b""
    if len(body) < length:
        raise FrameError("connection closed inside a frame")
    return kind, body


def shut(connection: socket.socket) -> None:
    """Closes `connection` at once, both ways (a thread blocked reading it wakes up)."""
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)
    connection.close()


def parse_header(data: bytes, body_bytes_max: int) -> tuple[int, int]:
    """(kind, body length) of a 5-byte header. Raises FrameError for an unknown kind or a
    body over `body_bytes_max`."""
    length, kind = HEADER.unpack(data)
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if length > body_bytes_max:
        raise FrameError(f"frame of {length} bytes > {body_bytes_max}")
    return kind, length


def publish_body(token: str, request: bytes) -> list[bytes]:
    """The parts of a PUBLISH body (sent with one sendmsg, never joined)."""
    encoded = token.encode("ascii")
    if len(encoded) > TOKEN_BYTES_MAX:
        raise FrameError(f"login token of {len(encoded)} bytes > {TOKEN_BYTES_MAX}")
    return [TOKEN_LENGTH.pack(len(encoded)), encoded, request]


def stream_body(token: str) -> bytes:
    """A STREAM body: the token alone."""
    return b"".join(publish_body(token, b""))


def split_publish(body: bytes | bytearray) -> tuple[str, memoryview]:
    """(token, request bytes) of a PUBLISH body; the request is a view of `body`."""
    view = memoryview(body)
    if len(view) < TOKEN_LENGTH.size:
        raise FrameError("publish frame shorter than its token length")
    (length,) = TOKEN_LENGTH.unpack_from(view)
    end = TOKEN_LENGTH.size + length
    if length > TOKEN_BYTES_MAX or end > len(view):
        raise FrameError(f"token length {length} beyond the frame or the limit")
    try:
        token = bytes(view[TOKEN_LENGTH.size : end]).decode("ascii")
    except UnicodeDecodeError:
        raise FrameError("login token is not ASCII") from None
    return token, view[end:]


def error_body(error: RaftStoreError) -> bytes:
    return json.dumps({"type": type(error).__name__, "fields": error.fields()}).encode()


def parse_error(body: bytes) -> RaftStoreError | None:
    """The typed error an ERROR body carries; None when it is not one this client knows."""
    try:
        document = json.loads(body)
        metadata = {
            WIRE_TYPE_KEY: str(document["type"]),
            WIRE_FIELDS_KEY: json.dumps(document["fields"]),
        }
    except (ValueError, KeyError, TypeError):
        return None
    return from_wire(metadata)
