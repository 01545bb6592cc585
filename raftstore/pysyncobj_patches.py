"""Everything this project changes inside pysyncobj, in one place, for one version.

pysyncobj has no extension points for what replication.py needs, so some of its module
globals and private (name-mangled) methods are replaced. Each replacement depends on the
exact code of the version pinned in requirements.txt; `check_pysyncobj` refuses to run on
another version or when a name a patch relies on is gone, rather than patch code that may
have changed under it (tests/test_pysyncobj_patches.py has a test per patch).

Process-wide (`install`):
- `pysyncobj.pickle.__protocol` = 5 (protocol 2 copies every bytes object again);
- `tcp_connection.zlib` = no compression (Arrow batches are compact; zlib cost ~70 ms/MiB);
- `syncobj.createJournal` = our fsynced journal (`PysyncobjJournal` over DurableJournal);
- `syncobj.getEncryptor` = `AesGcmEncryptor` (every peer message encrypted, and
  authenticated before pysyncobj unpickles it);
- `TcpConnection`'s buffers: `send`, `getSendBufferSize`, `__processSend`, `__processRead`
  and `__processParseMessage` move the same frames through peer_frames.py's Outbox and
  Inbox (no quadratic copies, no fresh multi-MiB buffer per message); a link whose unsent
  bytes pass RAFT_SEND_BUFFER_BYTES_MAX, or that declares a frame longer than
  RAFT_FRAME_BYTES_MAX, is dropped before the bytes are buffered; a send that leaves bytes
  unsent has the link polled for writability until they are out (pysyncobj left them for
  the next message on the link);
- `TcpConnection.__processConnectionTimeout` (a silent link is dropped only when this node
  has been talking on it and nothing waits to be read);
- `TCPTransport._onNewIncomingConnection` and `_onTick` (at most RAFT_UNAUTHENTICATED_MAX
  accepted links wait for their handshake, each at most RAFT_HANDSHAKE_S; the connection
  upkeep runs on at most one tick per RAFT_TRANSPORT_TICK_S);
- the tick thread's per-tick overhead: `monotonicTime` in syncobj, tcp_connection and
  transport is a C partial of the same clock instead of a lambda around it, and
  `Node.__hash__`/`__eq__` read the id without its property.
Per class, in replication.py's `_SyncObj` (listed in `SYNCOBJ_METHODS` for the guard):
`__applyLogEntries`, `__doApplyCommand`, `__getEntries`, `__onMessageReceived`,
`__sendNextNodeIdx`, `__tryLogCompaction`, `_applyCommand`, `_checkCommandsToApply`, and the
instance's `PollPoller.poll` (its wait lets go of the tick lock; `POLLER_ATTRIBUTES`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.metadata
import itertools
import logging
import os
import pickle
import socket
import struct
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import pysyncobj.node as pysyncobj_node
import pysyncobj.pickle as pysyncobj_pickle
import pysyncobj.pipe_notifier as pysyncobj_pipe_notifier
import pysyncobj.poller as pysyncobj_poller
import pysyncobj.syncobj as pysyncobj_syncobj
import pysyncobj.tcp_connection as pysyncobj_tcp_connection
import pysyncobj.tcp_server as pysyncobj_tcp_server
import pysyncobj.transport as pysyncobj_transport
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from raftstore import limits, trace
from raftstore.log_limits import OncePerInterval
from raftstore.peer_frames import FrameTooLong, Inbox, Outbox
from raftstore.storage.journal import DurableJournal

log = logging.getLogger(__name__)

# The version every patch below was written against (requirements.txt pins it).
PYSYNCOBJ_VERSION: Final = "0.3.17"
# v3: split tokens (AesGcmEncryptor.seal_split); nodes of another frame format never connect.
_AUTH_SALT: Final = b"hastream-raft-peer-aead-v3"
# Every peer message: pysyncobj's default (2) copies every bytes object again.
_PICKLE_PROTOCOL: Final = 5

_POLL_READ_WRITE_ERROR: Final = (
    pysyncobj_poller.POLL_EVENT_TYPE.READ
    | pysyncobj_poller.POLL_EVENT_TYPE.WRITE
    | pysyncobj_poller.POLL_EVENT_TYPE.ERROR
)

# Private methods of SyncObj that replication.py replaces or calls.
SYNCOBJ_METHODS: Final = (
    "_SyncObj__applyLogEntries",
    "_SyncObj__sendAppendEntries",
    "_SyncObj__getPrevLogIndexTerm",
    "_SyncObj__doApplyCommand",
    "_SyncObj__onMessageReceived",
    "_SyncObj__sendNextNodeIdx",
    "_SyncObj__tryLogCompaction",
    "_SyncObj__getEntries",
    "_SyncObj__setState",
    "_SyncObj__generateRaftTimeout",
    "_SyncObj__getCurrentLogIndex",
    "_SyncObj__getCurrentLogTerm",
    "_SyncObj__connectedToAnyone",
    "_SyncObj__callErrCallback",
    "_applyCommand",
    "_checkCommandsToApply",
    "_doDestroy",
)
# Instance attributes of SyncObj that replication.py reads or writes (checked by the tests
# on a live instance: they exist only once SyncObj.__init__ ran).
SYNCOBJ_ATTRIBUTES: Final = (
    "_SyncObj__commandsQueue",
    "_SyncObj__commandsWaitingCommit",
    "_SyncObj__conf",
    "_SyncObj__destroying",
    "_SyncObj__connectedNodes",
    "_SyncObj__forceLogCompaction",
    "_SyncObj__lastSerializedEntry",
    "_SyncObj__leaderCommitIndex",
    "_SyncObj__newAppendEntriesTime",
    "_SyncObj__noopIDx",
    "_SyncObj__otherNodes",
    "_SyncObj__readonlyNodes",
    "_SyncObj__pipeNotifier",
    "_SyncObj__raftCommitIndex",
    "_SyncObj__raftElectionDeadline",
    "_SyncObj__raftLastApplied",
    "_SyncObj__raftLeader",
    "_SyncObj__raftLog",
    "_SyncObj__raftMatchIndex",
    "_SyncObj__raftNextIndex",
    "_SyncObj__raftState",
    "_SyncObj__selfNode",
    "_SyncObj__serializer",
    "_SyncObj__transferInProgress",
    "_SyncObj__transport",
    "_poller",
)
# The deque inside pysyncobj's FastQueue (its commands queue), which replication.py reads.
QUEUE_ATTRIBUTE: Final = "_FastQueue__queue"
# pysyncobj's Serializer: 0 while no checkpoint is being written or waits to be taken
# (replication.py reads it to look at compaction only with its housekeeping otherwise).
SERIALIZER_PID_ATTRIBUTE: Final = "_Serializer__pid"
# Instance attributes of pysyncobj's PollPoller that replication.py's poll reads.
POLLER_ATTRIBUTES: Final = ("_PollPoller__poll", "_PollPoller__descrToCallbacks")
_MODULE_NAMES: Final = (
    (pysyncobj_pickle, "__protocol"),
    (pysyncobj_tcp_connection, "zlib"),
    (pysyncobj_tcp_connection, "monotonicTime"),
    (pysyncobj_tcp_connection, "CONNECTION_STATE"),
    (pysyncobj_syncobj, "createJournal"),
    (pysyncobj_syncobj, "getEncryptor"),
    (pysyncobj_syncobj, "HAS_CRYPTO"),
    (pysyncobj_tcp_connection.TcpConnection, "send"),
    (pysyncobj_tcp_connection.TcpConnection, "getSendBufferSize"),
    (pysyncobj_tcp_connection.TcpConnection, "_TcpConnection__processConnectionTimeout"),
    (pysyncobj_tcp_connection.TcpConnection, "_TcpConnection__processRead"),
    (pysyncobj_tcp_connection.TcpConnection, "_TcpConnection__processSend"),
    (pysyncobj_tcp_connection.TcpConnection, "_TcpConnection__processParseMessage"),
    (pysyncobj_tcp_connection.TcpConnection, "_TcpConnection__trySendBuffer"),
    (pysyncobj_tcp_connection.TcpConnection, "_TcpConnection__processConnection"),
    (pysyncobj_poller, "POLL_EVENT_TYPE"),
    (pysyncobj_poller, "PollPoller"),
    (pysyncobj_transport.TCPTransport, "_onNewIncomingConnection"),
    (pysyncobj_transport.TCPTransport, "_onTick"),
    (pysyncobj_tcp_server.TcpServer, "_TcpServer__onNewConnection"),
    (pysyncobj_tcp_server.TcpServer, "bind"),
    (pysyncobj_tcp_server, "SERVER_STATE"),
    (pysyncobj_syncobj, "monotonicTime"),
    (pysyncobj_transport, "monotonicTime"),
    (pysyncobj_node.Node, "__hash__"),
    (pysyncobj_pipe_notifier.PipeNotifier, "_PipeNotifier__onNewNotification"),
)

_installed = False


class UnsupportedPysyncobj(RuntimeError):
    """The installed pysyncobj is not the version these patches were written for."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"pysyncobj {detail}; this node patches pysyncobj {PYSYNCOBJ_VERSION} "
            "(install requirements.txt)"
        )
        self.detail = detail


def check_pysyncobj(version: str | None = None) -> None:
    """Raise UnsupportedPysyncobj unless pysyncobj is PYSYNCOBJ_VERSION with every private
    name the patches rely on."""
    installed = version if version is not None else importlib.metadata.version("pysyncobj")
    if installed != PYSYNCOBJ_VERSION:
        raise UnsupportedPysyncobj(f"{installed} is installed")
    for owner, name in _MODULE_NAMES:
        if not hasattr(owner, name):
            raise UnsupportedPysyncobj(
                f"{installed} has no {getattr(owner, '__name__', owner)}.{name}"
            )
    for name in SYNCOBJ_METHODS:
        if not hasattr(pysyncobj_syncobj.SyncObj, name):
            raise UnsupportedPysyncobj(f"{installed} has no SyncObj.{name}")


class AesGcmEncryptor:
    """Stands in for pysyncobj's Fernet encryptor: encrypts and authenticates every peer
    message.

    Token: timestamp i64 | nonce (12) | ciphertext | tag (16): AES-GCM of the message with
    the timestamp as associated data, keyed from the cluster secret by PBKDF2. pysyncobj
    calls `extract_timestamp` then `decrypt` on every message; a bad tag raises and pysyncobj
    drops the connection before anything is unpickled. AES-GCM runs at GB/s with AES-NI (the
    multi-MiB batches sent to every follower), far above Fernet's AES-CBC + HMAC. Nonces
    are a random per-process prefix and a counter, so they never repeat within a process and
    collide across processes with odds of 2^-32 per pair. Replays within a connection are
    refused by pysyncobj (timestamps must not go back, and every message carries the
    connection's random key).

    Split token (an append_entries message whose big commands travel as pieces of their
    own, `seal_split`): marker i64 (-1, where a token has its timestamp, never negative) |
    head token bytes u32 | piece count u32 | per piece: nonce (12), sealed bytes u64 | the
    head token (a token as above of the pickled message without the pieces, whose
    associated data is its timestamp followed by everything before it, so the piece table
    is authenticated) | each piece: ciphertext | tag, with `_PIECE_AAD`. A piece's nonce
    names its plaintext: a piece sealed once is sent unchanged on every link within a tick
    (`seal_piece`), instead of the whole message pickled and encrypted per follower.
    """

    _TIMESTAMP: Final = struct.Struct("<q")
    _NONCE_BYTES: Final = 12
    _TAG_BYTES: Final = 16
    _HEAD: Final = _TIMESTAMP.size + _NONCE_BYTES
    _SPLIT_MARKER: Final = -1
    _SPLIT: Final = struct.Struct("<qII")  # marker, head token bytes, piece count
    _PIECE: Final = struct.Struct("<12sQ")  # nonce, sealed bytes
    _PIECE_AAD: Final = b"hastream-raft-piece"

    def __init__(self, secret: str) -> None:
        key = hashlib.pbkdf2_hmac("sha256", secret.encode(), _AUTH_SALT, 100_000, dklen=16)
        self._aead = AESGCM(key)
        self._nonce_prefix = os.urandom(4)
        self._counter = itertools.count()
        self._opened: tuple[bytes, bytes] | None = None  # (token, plaintext)
        # id(plaintext) -> (plaintext, nonce, sealed, when sealed): the pieces sealed since
        # `forget_pieces`, oldest first (plaintext held so that its id cannot be reused
        # while it is here).
        self._pieces: dict[int, tuple[Any, bytes, bytes, float]] = {}
        self._pieces_bytes = 0

    def _nonce(self) -> bytes:
        return self._nonce_prefix + next(self._counter).to_bytes(8, "little")

    def seal(self, data: bytes, current_time: int) -> tuple[bytes, bytes]:
        """The token in two pieces, head (timestamp, nonce) and ciphertext with its tag, so
        that a frame can be sent without joining them (peer_frames.Outbox)."""
        timestamp = self._TIMESTAMP.pack(current_time)
        nonce = self._nonce()
        return timestamp + nonce, self._aead.encrypt(nonce, data, timestamp)

    def seal_piece(self, data: bytes) -> tuple[bytes, bytes]:
        """(nonce, ciphertext | tag) of one piece. The same object sealed again before
        `forget_pieces` gets the same answer, not a second encryption: the same plaintext
        under the same nonce, so sending it on every link reuses no nonce."""
        held = self._pieces.get(id(data))
        if held is not None and held[0] is data:
            return held[1], held[2]
        nonce = self._nonce()
        sealed = self._aead.encrypt(nonce, data, self._PIECE_AAD)
        if self._pieces_bytes + len(sealed) <= limits.RAFT_SHARED_PIECES_BYTES_MAX:
            now = pysyncobj_tcp_connection.monotonicTime()
            self._pieces[id(data)] = (data, nonce, sealed, now)
            self._pieces_bytes += len(sealed)
        return nonce, sealed

    def forget_pieces(self, sealed_before: float | None = None) -> None:
        """Let the sealed pieces go (the links' outboxes hold what is unsent): all of them,
        or those sealed before `sealed_before` (monotonic seconds), which a follower the
        leader holds back (pacing.py) will not be sent any more."""
        pieces = self._pieces
        if sealed_before is None:
            pieces.clear()
            self._pieces_bytes = 0
            return
        for key, (_, _, sealed, sealed_at) in list(pieces.items()):
            if sealed_at >= sealed_before:
                break
            del pieces[key]
            self._pieces_bytes -= len(sealed)

    def seal_split(self, head: bytes, pieces: list[Any], current_time: int) -> list[bytes]:
        """A split token's parts: the pickled message without its pieces, and the pieces
        (bytes-like, in the order the message's out-of-band buffers were pickled)."""
        sealed = [self.seal_piece(piece) for piece in pieces]
        head_bytes = self._HEAD + len(head) + self._TAG_BYTES
        table = self._SPLIT.pack(self._SPLIT_MARKER, head_bytes, len(sealed)) + b"".join(
            self._PIECE.pack(nonce, len(ciphertext)) for nonce, ciphertext in sealed
        )
        timestamp = self._TIMESTAMP.pack(current_time)
        nonce = self._nonce()
        head_sealed = self._aead.encrypt(nonce, head, timestamp + table)
        return [table + timestamp + nonce, head_sealed, *(ciphertext for _, ciphertext in sealed)]

    @classmethod
    def is_split(cls, token: bytes | memoryview) -> bool:
        return (
            len(token) >= cls._SPLIT.size
            and cls._TIMESTAMP.unpack_from(token)[0] == cls._SPLIT_MARKER
        )

    def open_split(self, token: bytes | memoryview) -> tuple[int, bytes, list[bytes]]:
        """(timestamp, head plaintext, pieces' plaintexts) of a split token; raises
        InvalidTag on a forged or damaged one, ValueError on one whose layout is wrong. The
        head (and with it the piece table) is authenticated before any piece is opened."""
        view = memoryview(token)
        _, head_bytes, count = self._SPLIT.unpack_from(view)
        table_end = self._SPLIT.size + count * self._PIECE.size
        pieces_at = table_end + head_bytes
        if head_bytes < self._HEAD + self._TAG_BYTES or pieces_at > len(view):
            raise ValueError("split token layout")
        table = bytes(view[:table_end])
        timestamp = bytes(view[table_end : table_end + self._TIMESTAMP.size])
        nonce = bytes(view[table_end + self._TIMESTAMP.size : table_end + self._HEAD])
        head = self._aead.decrypt(
            nonce, view[table_end + self._HEAD : pieces_at], timestamp + table
        )
        pieces = []
        at = pieces_at
        for piece_nonce, sealed_bytes in self._PIECE.iter_unpack(table[self._SPLIT.size :]):
            if sealed_bytes < self._TAG_BYTES or at + sealed_bytes > len(view):
                raise ValueError("split token layout")
            pieces.append(
                self._aead.decrypt(piece_nonce, view[at : at + sealed_bytes], self._PIECE_AAD)
            )
            at += sealed_bytes
        if at != len(view):
            raise ValueError("split token layout")
        (value,) = self._TIMESTAMP.unpack(timestamp)
        return int(value), head, pieces

    def open(self, token: bytes | memoryview) -> tuple[int, bytes]:
        """(timestamp, plaintext) of a token; raises cryptography's InvalidTag on a forged
        or damaged one, ValueError on one too short to be a token."""
        if len(token) < self._HEAD + self._TAG_BYTES:
            raise ValueError("token too short")
        timestamp = bytes(token[: self._TIMESTAMP.size])
        nonce = bytes(token[self._TIMESTAMP.size : self._HEAD])
        plaintext = self._aead.decrypt(nonce, memoryview(token)[self._HEAD :], timestamp)
        (value,) = self._TIMESTAMP.unpack(timestamp)
        return int(value), plaintext

    def encrypt_at_time(self, data: bytes, current_time: int) -> bytes:
        return b"".join(self.seal(data, current_time))

    def extract_timestamp(self, token: bytes) -> int:
        timestamp, plaintext = self.open(token)
        self._opened = (token, plaintext)
        return timestamp

    def decrypt(self, token: bytes) -> bytes:
        # pysyncobj asks for the timestamp first: decrypt once, hand the plaintext over.
        if self._opened is None or self._opened[0] is not token:
            self.extract_timestamp(token)
        assert self._opened is not None
        plaintext = self._opened[1]
        self._opened = None
        return plaintext


class _NoCompression:
    """Replaces the `zlib` module inside pysyncobj's tcp_connection."""

    error = zlib.error

    @staticmethod
    def compress(data: bytes, level: int = -1) -> bytes:
        return data

    @staticmethod
    def decompress(data: bytes) -> bytes:
        return data


class PysyncobjJournal:
    """pysyncobj's journal interface (its journal.py: add, clear, deleteEntriesFrom,
    deleteEntriesTo, entries by position, term/vote/commit metadata, flush, _destroy) over
    our DurableJournal, which speaks our names."""

    def __init__(self, durable: DurableJournal) -> None:
        self.durable = durable

    def add(self, command: bytes, idx: int, term: int) -> None:
        self.durable.append(command, idx, term)

    def clear(self) -> None:
        self.durable.truncate_from(0)

    def deleteEntriesFrom(self, entry_from: int) -> None:
        self.durable.truncate_from(entry_from)

    def deleteEntriesTo(self, entry_to: int) -> None:
        self.durable.drop_first(entry_to)

    def __getitem__(self, item: int | slice) -> Any:
        return self.durable[item]

    def __len__(self) -> int:
        return len(self.durable)

    def _destroy(self) -> None:
        self.durable.close()

    def setRaftCommitIndex(self, raft_commit_index: int) -> None:
        self.durable.set_commit_index(raft_commit_index)

    def getRaftCommitIndex(self) -> int:
        return self.durable.commit_index

    def setCurrentTerm(self, term: int, voted_for_node_id: Any) -> None:
        self.durable.set_term(term, voted_for_node_id)

    def getCurrentTerm(self) -> int:
        return self.durable.term

    def getVotedForNodeId(self) -> Any:
        return self.durable.voted_for

    def onOneSecondTimer(self) -> None:
        self.durable.store_meta_if_changed()

    def flush(self) -> None:
        self.durable.sync()


def _create_journal(journal_file: str | None) -> PysyncobjJournal:
    assert journal_file is not None, "every group has a journal directory"
    # The limit is read here, not as DurableJournal's default, so a test may lower it.
    return PysyncobjJournal(
        DurableJournal(Path(journal_file), resident_bytes_max=limits.RAFT_LOG_RESIDENT_BYTES)
    )


def install() -> None:
    """Install the process-wide patches (identical on every node; idempotent). Refuses a
    pysyncobj these patches were not written for."""
    global _installed
    if _installed:
        return
    check_pysyncobj()
    _installed = True
    setattr(pysyncobj_pickle, "__protocol", _PICKLE_PROTOCOL)
    pysyncobj_tcp_connection.zlib = _NoCompression
    pysyncobj_syncobj.createJournal = _create_journal
    pysyncobj_syncobj.getEncryptor = AesGcmEncryptor
    pysyncobj_syncobj.HAS_CRYPTO = True
    connection = pysyncobj_tcp_connection.TcpConnection
    connection.send = _connection_send
    connection.getSendBufferSize = _connection_unsent
    connection._TcpConnection__processSend = _connection_process_send
    connection._TcpConnection__processParseMessage = _connection_parse
    connection._TcpConnection__processConnectionTimeout = _connection_timeout
    connection._TcpConnection__processRead = _connection_read
    transport = pysyncobj_transport.TCPTransport
    transport._onNewIncomingConnection = _incoming_connection
    transport._onTick = _transport_tick
    # The tick thread's own overhead, paid several times per entry on every node: a C clock
    # call instead of a lambda around the same one, and a node's hash and equality without
    # the `id` property in between (dicts keyed by nodes are read ~50 times per entry).
    if hasattr(time, "CLOCK_MONOTONIC_RAW"):  # what pysyncobj's monotonic.py reads then
        for module in (pysyncobj_syncobj, pysyncobj_tcp_connection, pysyncobj_transport):
            module.monotonicTime = _MONOTONIC_RAW
    pysyncobj_node.Node.__hash__ = _node_hash
    pysyncobj_node.Node.__eq__ = _node_eq
    notifier = pysyncobj_pipe_notifier.PipeNotifier
    notifier._PipeNotifier__onNewNotification = _take_notifications


_MONOTONIC_RAW: Final = functools.partial(
    time.clock_gettime, getattr(time, "CLOCK_MONOTONIC_RAW", time.CLOCK_MONOTONIC)
)


def _node_hash(self: Any) -> int:
    return hash(self._id)


def _node_eq(self: Any, other: object) -> bool:
    return isinstance(other, pysyncobj_node.Node) and self._id == other._id


_NOTIFICATIONS_READ_BYTES: Final = 4096


def _take_notifications(self: Any, _descr: int, _event: int) -> None:
    # Replaces PipeNotifier.__onNewNotification (the tick's wake-up pipe: a proposal, or the
    # journal's helper): one read of what the pipe holds, not a second one for its EAGAIN.
    # Wake-ups are one byte each; more than fit in one read leave the pipe readable, and
    # the next poll returns at once. The read lets go of the GIL, and a proposing thread
    # waits for it: one system call less per wake-up.
    with contextlib.suppress(BlockingIOError):
        os.read(self._PipeNotifier__pipeR, _NOTIFICATIONS_READ_BYTES)
    callback = self._PipeNotifier__callback
    if callback is not None:
        callback()


def _outbox(connection: Any) -> Outbox:
    box = connection._TcpConnection__writeBuffer
    if type(box) is not Outbox:  # pysyncobj resets it to b"" on connect and disconnect
        box = connection._TcpConnection__writeBuffer = Outbox()
    return box


def _inbox(connection: Any) -> Inbox:
    box = connection._TcpConnection__readBuffer
    if type(box) is not Inbox:  # as _outbox
        box = connection._TcpConnection__readBuffer = Inbox()
    return box


def _connection_send(self: Any, message: Any) -> None:
    # Replaces TcpConnection.send: the same frame (pickled message, encrypted, length first),
    # queued as its pieces (peer_frames.Outbox) instead of joined and appended to a bytes
    # buffer. A link whose unsent bytes pass RAFT_SEND_BUFFER_BYTES_MAX is dropped: the
    # buffer is otherwise unbounded while a peer does not read.
    if self.sendRandKey:
        message = (self.sendRandKey, message)
    encryptor = self.encryptor
    if encryptor is None:
        pieces: Sequence[bytes] = (pickle.dumps(message, protocol=_PICKLE_PROTOCOL),)
    else:
        pieces = _sealed(encryptor, message, int(pysyncobj_tcp_connection.monotonicTime()))
    _outbox(self).add_frame(pieces)
    self._TcpConnection__trySendBuffer()  # its timeout check sees the previous send
    self._hastream_last_send = pysyncobj_tcp_connection.monotonicTime()
    tracer = trace.current()
    if tracer.on:
        _trace_sent(tracer, message)
    unsent = self.getSendBufferSize()
    if unsent > limits.RAFT_SEND_BUFFER_BYTES_MAX:
        log.warning("dropping raft link: %d unsent bytes, the peer is not reading", unsent)
        self.disconnect()
    elif unsent:
        _poll_for_write(self)


def _trace_sent(tracer: trace.Trace, message: Any) -> None:
    """An append_entries with entries, (link key, body) or body, on the node's timeline."""
    body = message[1] if type(message) is tuple else message
    if type(body) is dict and body.get("type") == "append_entries" and body.get("entries"):
        tracer.entries_sent(int(body["entries"][-1][1]), trace.clock())


def _sealed(encryptor: AesGcmEncryptor, message: Any, now: int) -> Sequence[bytes]:
    """One message's frame body. An append_entries whose commands include big ones is a
    split token: those commands are pickled out of band (protocol 5's PickleBuffer) and
    sealed once for every link of this tick (`AesGcmEncryptor.seal_piece`); anything else
    is one token of the whole pickled message, as pysyncobj's."""
    pieces: list[Any] = []
    outer = _with_pieces_out_of_band(message, pieces)
    if not pieces:
        return encryptor.seal(pickle.dumps(message, protocol=_PICKLE_PROTOCOL), now)
    head = pickle.dumps(outer, protocol=_PICKLE_PROTOCOL, buffer_callback=_out_of_band)
    return encryptor.seal_split(head, pieces, now)


def _with_pieces_out_of_band(message: Any, pieces: list[Any]) -> Any:
    """`message` ((link key, body) or body) with each big command of an append_entries body
    wrapped in a PickleBuffer and listed in `pieces`, in pickling order; `message` itself
    (not copied) when it has none."""
    keyed = type(message) is tuple
    body = message[1] if keyed else message
    if type(body) is not dict or body.get("type") != "append_entries":
        return message
    wrapped = []
    for command, index, term in body.get("entries") or ():
        if len(command) >= limits.RAFT_SHARED_PIECE_BYTES_MIN:
            pieces.append(command)
            command = pickle.PickleBuffer(command)
        wrapped.append((command, index, term))
    if not pieces:
        return message
    body = {**body, "entries": wrapped}
    return (message[0], body) if keyed else body


def _out_of_band(_buffer: pickle.PickleBuffer) -> bool:
    return False  # every PickleBuffer travels as a piece of its own


def _poll_for_write(connection: Any) -> None:
    # pysyncobj polls a link for writability only until its buffer first runs empty, and
    # its send() never asks again: the rest of a frame the socket's buffers did not take
    # went out only with the next message on the link (a heartbeat, up to
    # appendEntriesPeriod later), once per socket-buffer-full of each multi-MiB entry. Poll
    # for writability until the buffer is empty; pysyncobj's write-event handler sends
    # and stops asking once it is.
    fileno = connection._TcpConnection__fileno
    if fileno is None or connection.state != pysyncobj_tcp_connection.CONNECTION_STATE.CONNECTED:
        return  # connecting: polled for writes already; disconnected: nothing to send
    connection._TcpConnection__poller.subscribe(
        fileno,
        connection._TcpConnection__processConnection,
        _POLL_READ_WRITE_ERROR,
    )


def _connection_unsent(self: Any) -> int:
    # Replaces TcpConnection.getSendBufferSize.
    return len(self._TcpConnection__writeBuffer)


def _connection_process_send(self: Any) -> bool:
    # Replaces TcpConnection.__processSend (one send of the buffer; True: call again).
    box = self._TcpConnection__writeBuffer
    if not box:
        return False
    try:
        sent = _outbox(self).send(self._TcpConnection__socket)
    except OSError as error:
        if error.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
            self.disconnect()
        return False
    return sent > 0


def _connection_read(self: Any) -> bool:
    # Replaces TcpConnection.__processRead, which pysyncobj calls until it returns False (the
    # socket is drained) and then parses what was read: into the link's Inbox. As before,
    # an end of stream drops what was read and not parsed (a SIGCONTed follower discards
    # the messages its leader sent before it gave up on the link, and times out): hence a
    # read to EAGAIN or the end even after a short one. pysyncobj checks SO_ERROR once per
    # poll event; its second check after every read is left out: a pending error fails the
    # next recv. pysyncobj trusts the 4-byte frame length: a declared length past
    # RAFT_FRAME_BYTES_MAX, or more than two frames' worth unparsed, drops the link before
    # those bytes are buffered.
    inbox = _inbox(self)
    try:
        count = inbox.receive(self._TcpConnection__socket)
    except FrameTooLong as error:
        _log_refused_frame(error.detail)
        self.disconnect()
        return False
    except OSError as error:
        if error.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
            self.disconnect()
        return False
    if count == 0:
        self.disconnect()
        return False
    return True


def _connection_parse(self: Any) -> Any:
    # Replaces TcpConnection.__processParseMessage: the next whole frame's message, or None.
    # As pysyncobj's: authenticated and decrypted (timestamps may not go back), unpickled,
    # checked for the link's random key; anything wrong drops the link.
    box = self._TcpConnection__readBuffer
    if type(box) is not Inbox:
        return None
    frame = box.take()
    if frame is None:
        return None
    try:
        encryptor = self.encryptor
        pieces: list[bytes] = []
        if encryptor is None:
            data: bytes | memoryview = frame
        else:
            if encryptor.is_split(frame):
                timestamp, data, pieces = encryptor.open_split(frame)
            else:
                timestamp, data = encryptor.open(frame)
            if timestamp < self.recvLastTimestamp:
                raise ValueError("timestamp went back")
            self.recvLastTimestamp = timestamp
        message = pickle.loads(data, buffers=pieces)
        if self.recvRandKey:
            key, message = message
            if key != self.recvRandKey:
                raise ValueError("wrong link key")
    except Exception:
        self.disconnect()
        return None
    finally:
        frame.release()
    return message


_original_incoming = pysyncobj_transport.TCPTransport._onNewIncomingConnection
_original_transport_tick = pysyncobj_transport.TCPTransport._onTick
_handshake_refusals = OncePerInterval()


def _incoming_connection(self: Any, connection: Any) -> None:
    # Wraps TCPTransport._onNewIncomingConnection. An accepted link stays in pysyncobj's
    # `_unknownConnections` until the peer proves the key (its first frames); pysyncobj
    # keeps such links for ever and without number. At most RAFT_UNAUTHENTICATED_MAX wait at
    # once (more are closed at accept), each for at most RAFT_HANDSHAKE_S (_transport_tick).
    _drop_stale_handshakes(self)
    if len(self._unknownConnections) >= limits.RAFT_UNAUTHENTICATED_MAX:
        _log_handshake_refusal(f"{len(self._unknownConnections)} links still unauthenticated")
        connection.disconnect()
        return
    connection._hastream_accepted_at = pysyncobj_tcp_connection.monotonicTime()
    _original_incoming(self, connection)


def _transport_tick(self: Any) -> None:
    # Connection upkeep (bind, reconnect, stale handshakes) on at most one tick per
    # RAFT_TRANSPORT_TICK_S: the tick thread runs several ticks per entry, and pysyncobj's
    # walk over every node found nothing to do on all but a few (a reconnect waits
    # connectionRetryTime anyway).
    now = _MONOTONIC_RAW()
    if self._ready and now < getattr(self, "_hastream_upkeep_at", 0.0):
        return
    self._hastream_upkeep_at = now + limits.RAFT_TRANSPORT_TICK_S
    _rebind_if_closed(self)
    _original_transport_tick(self)
    if self._unknownConnections:
        _drop_stale_handshakes(self)


_listener_refusals = OncePerInterval()


def _rebind_if_closed(transport: Any) -> None:
    """pysyncobj closes its listening socket for good when an accept fails with anything
    but EAGAIN (EMFILE: the node is out of file descriptors) and never binds it again: the
    node could then never take a peer's connection. Bind it again, every RAFT_REBIND_S,
    until it works (the transport stays `ready`: pysyncobj stops Raft altogether while its
    transport is not)."""
    server = transport._server
    if not transport._ready or server is None:
        return
    if server._TcpServer__state != pysyncobj_tcp_server.SERVER_STATE.UNBINDED:
        return
    now = pysyncobj_tcp_connection.monotonicTime()
    if now < getattr(transport, "_hastream_rebind_at", 0.0):
        return
    transport._hastream_rebind_at = now + limits.RAFT_REBIND_S
    try:
        server.bind()
    except OSError as error:
        events = _listener_refusals.due()
        if events is not None:
            log.warning("raft listener is closed; binding it again failed: %s", error)
        return
    log.warning("raft listener was closed (an accept failed); bound it again")


def _drop_stale_handshakes(transport: Any) -> None:
    now = pysyncobj_tcp_connection.monotonicTime()
    for connection in list(transport._unknownConnections):
        accepted_at = getattr(connection, "_hastream_accepted_at", now)
        if now - accepted_at > limits.RAFT_HANDSHAKE_S:
            _log_handshake_refusal(f"no handshake within {limits.RAFT_HANDSHAKE_S:.0f}s")
            transport._unknownConnections.discard(connection)
            connection.disconnect()


def _log_handshake_refusal(what: str) -> None:
    events = _handshake_refusals.due()
    if events is not None:
        log.warning("closing raft link: %s (%d closed since the last line)", what, events)


_frame_refusals = OncePerInterval()


def _log_refused_frame(what: str) -> None:
    events = _frame_refusals.due()
    if events is not None:
        log.warning(
            "dropping raft link: %s (limit %d; %d links dropped since the last line)",
            what,
            limits.RAFT_FRAME_BYTES_MAX,
            events,
        )


def _connection_timeout(self: Any) -> None:
    # Replaces TcpConnection.__processConnectionTimeout, which drops a link after
    # connectionTimeout without reads, checked on every send and every poll event. Silence
    # only means a dead or frozen peer when this node has been talking to it; so a link is
    # kept when bytes wait to be read (the peer is alive; the read that follows resets the
    # clock) or when this node had not sent on it within the timeout either (an idle link:
    # the message now being sent, e.g. a vote request, must go out, not be dropped).
    now = pysyncobj_tcp_connection.monotonicTime()
    timeout = self._TcpConnection__timeout
    if now - self._TcpConnection__lastReadTime <= timeout:
        return
    state = self._TcpConnection__state
    if state == pysyncobj_tcp_connection.CONNECTION_STATE.CONNECTING:
        self.disconnect()
        return
    if _bytes_waiting(self._TcpConnection__socket):
        return
    if now - getattr(self, "_hastream_last_send", float("-inf")) <= timeout:
        self.disconnect()


def _bytes_waiting(sock: socket.socket | None) -> bool:
    """True when a read on `sock` would not block: data, end of stream or an error."""
    if sock is None:
        return False
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True
