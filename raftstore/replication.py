"""The only importer of pysyncobj: one Raft member of one group, made durable and fast.

pysyncobj 0.3.17 as shipped (PYSYNCOBJ-FACTS) never fsyncs its journal, loses the log tail
when its dump-file compaction races a crash, corrupts entries >= appendEntriesBatchSizeBytes,
pickles with protocol 2 and zlib-compresses every message. This module closes each gap:

1. Durability. `DurableJournal` (storage/journal.py) replaces pysyncobj's journal through
   `pysyncobj.syncobj.createJournal`. Entries are written on `add` and made durable by one
   fdatasync (`sync`) that runs
   - on a follower, before it answers append_entries with success (wrapping
     `__sendNextNodeIdx`), and
   - on the leader, at the start of every tick (wrapping `_onTick`), before the commit index
     is computed. The leader appends proposals later in the tick, so every entry it counts
     for itself is already on disk.
   So an entry is committed only once it is fsynced on a majority. Term and vote are written
   with fsync before they are used.
2. Checkpoints. Log compaction runs with our serializer (no fork): the group's hooks fsync
   the data files and write a checksummed checkpoint; only then does pysyncobj truncate the
   log. At restart our deserializer first trims the journal to start at the checkpoint's two
   entries, so pysyncobj's `__loadDumpFile` keeps the entries after them instead of clearing
   the journal (the tail-loss bug).
3. Large entries. `appendEntriesBatchSizeBytes` is set far above the largest entry so the
   broken chunked send is never used; socket buffers are 4 MiB.
4. Encoding cost. Messages are pickled with protocol 5 and not zlib-compressed (Arrow batches
   are already compact; zlib cost ~70 ms per MiB of random data).
5. Peer links. pysyncobj drops a link after `connectionTimeout` without reads, checked on
   every send and every read event. Two followers never talk between elections, so their
   idle link tripped on the first vote request after a leader failure (which it dropped):
   every failover took two elections. Here the read timeout applies only to a link this
   node has sent on within the timeout and that has nothing waiting to be read (a peer
   that stopped answering, e.g. SIGSTOPped), and a link whose unsent bytes pass
   `RAFT_SEND_BUFFER_BYTES_MAX` is dropped at once:
   pysyncobj's send buffer is otherwise unbounded while a peer does not read.
6. Peer authentication. pysyncobj unpickles whatever arrives on its port, so the port is
   bound to the configured address and every message must carry an AES-GMAC tag keyed with
   the cluster secret (`_GmacAuthenticator`, replacing Fernet: authentication is what stops
   remote code execution, and GMAC costs a fraction of AES-CBC+base64 on multi-MiB batches).

Our commands travel as `REGULAR` entries whose bytes are ours (`commands.py`), never pickle:
`__doApplyCommand` is wrapped to hand them to the group's `apply` directly.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import socket
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import pysyncobj.pickle as pysyncobj_pickle
import pysyncobj.syncobj as pysyncobj_syncobj
import pysyncobj.tcp_connection as pysyncobj_tcp_connection
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf
from pysyncobj.node import TCPNode

from raftstore import limits
from raftstore.errors import LeadershipLost, NotLeader, Overloaded, RaftStoreError
from raftstore.storage.journal import DurableJournal, Entry

log = logging.getLogger(__name__)

_REGULAR: Final = 0  # pysyncobj's _COMMAND_TYPE.REGULAR
_TAG_REGULAR: Final = bytes([_REGULAR])
_STATE_LEADER: Final = 2  # pysyncobj's _RAFT_STATE.LEADER
_AUTH_SALT: Final = b"hastream-raft-peer-auth-v1"

ProposalCallback = Callable[[Any, RaftStoreError | None], None]


class ReplicaHooks(Protocol):
    """What a Raft group provides to its replica. Every method runs on the tick thread."""

    def apply(self, lsn: int, command: memoryview) -> Any: ...

    def write_checkpoint(self, path: Path, last: Entry, previous: Entry) -> None: ...

    def read_checkpoint(self, path: Path) -> tuple[Entry, Entry]: ...

    def on_role_change(self, is_leader: bool) -> None: ...

    def on_tick(self) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RaftSettings:
    group_id: int
    self_address: str  # "host:port" of this member's Raft port
    peer_addresses: tuple[str, ...]
    directory: Path  # streamingHADir/group-<id>
    secret: str
    election_timeout_s: float
    checkpoint_interval_s: float


# --- process-wide pysyncobj patches (identical on every node) ------------------------------


class _GmacAuthenticator:
    """Stands in for pysyncobj's Fernet encryptor: authenticates, does not encrypt.

    Token: timestamp i64 | nonce (12) | tag (16) | data, where tag = AES-GCM over an empty
    plaintext with `timestamp | data` as associated data (GMAC), keyed from the cluster
    secret by PBKDF2. pysyncobj calls `extract_timestamp` then `decrypt` on every message; a
    bad tag raises and pysyncobj drops the connection before anything is unpickled. GMAC runs
    at several GB/s with AES-NI, 15x HMAC-SHA256 here, which matters for multi-MiB batches
    sent to every follower. Nonces are a random per-process prefix and a counter, so they
    never repeat within a process and collide across processes with odds of 2^-32 per pair.
    """

    _TIMESTAMP: Final = struct.Struct("<q")
    _NONCE_BYTES: Final = 12
    _TAG_BYTES: Final = 16

    def __init__(self, secret: str) -> None:
        key = hashlib.pbkdf2_hmac("sha256", secret.encode(), _AUTH_SALT, 100_000, dklen=16)
        self._aead = AESGCM(key)
        self._nonce_prefix = os.urandom(4)
        self._counter = itertools.count()
        self._verified: bytes | None = None

    def encrypt_at_time(self, data: bytes, current_time: int) -> bytes:
        timestamp = self._TIMESTAMP.pack(current_time)
        nonce = self._nonce_prefix + next(self._counter).to_bytes(8, "little")
        tag = self._aead.encrypt(nonce, b"", b"".join((timestamp, data)))
        return b"".join((timestamp, nonce, tag, data))

    def extract_timestamp(self, token: bytes) -> int:
        head = self._TIMESTAMP.size + self._NONCE_BYTES + self._TAG_BYTES
        if len(token) < head:
            raise ValueError("token too short")
        timestamp = token[: self._TIMESTAMP.size]
        nonce = token[self._TIMESTAMP.size : self._TIMESTAMP.size + self._NONCE_BYTES]
        tag = token[self._TIMESTAMP.size + self._NONCE_BYTES : head]
        # Raises cryptography's InvalidTag on a forged or damaged message.
        self._aead.decrypt(nonce, tag, b"".join((timestamp, memoryview(token)[head:])))
        self._verified = token
        (value,) = self._TIMESTAMP.unpack(timestamp)
        return int(value)

    def decrypt(self, token: bytes) -> bytes:
        if token is not self._verified:
            self.extract_timestamp(token)
        self._verified = None
        return token[self._TIMESTAMP.size + self._NONCE_BYTES + self._TAG_BYTES :]


class _NoCompression:
    """Replaces the `zlib` module inside pysyncobj's tcp_connection."""

    error = zlib.error

    @staticmethod
    def compress(data: bytes, level: int = -1) -> bytes:
        return data

    @staticmethod
    def decompress(data: bytes) -> bytes:
        return data


_patched = False


def _create_journal(journal_file: str | None) -> DurableJournal:
    assert journal_file is not None, "every group has a journal directory"
    return DurableJournal(Path(journal_file))


def _patch_pysyncobj() -> None:
    global _patched
    if _patched:
        return
    _patched = True
    setattr(pysyncobj_pickle, "__protocol", 5)
    pysyncobj_tcp_connection.zlib = _NoCompression
    pysyncobj_syncobj.createJournal = _create_journal
    pysyncobj_syncobj.getEncryptor = _GmacAuthenticator
    pysyncobj_syncobj.HAS_CRYPTO = True
    connection = pysyncobj_tcp_connection.TcpConnection
    connection.send = _connection_send
    connection._TcpConnection__processConnectionTimeout = _connection_timeout


_original_connection_send = pysyncobj_tcp_connection.TcpConnection.send


def _connection_send(self: Any, message: Any) -> None:
    _original_connection_send(self, message)  # its timeout check sees the previous send
    self._hastream_last_send = pysyncobj_tcp_connection.monotonicTime()
    unsent = self.getSendBufferSize()
    if unsent > limits.RAFT_SEND_BUFFER_BYTES_MAX:
        log.warning("dropping raft link: %d unsent bytes, the peer is not reading", unsent)
        self.disconnect()


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


# --- the replica ---------------------------------------------------------------------------


class _SyncObj(SyncObj):  # type: ignore[misc]
    """pysyncobj's SyncObj with the durability hooks; no state, no business logic."""

    def __init__(self, hooks: ReplicaHooks, *args: Any, **kwargs: Any) -> None:
        # Set before SyncObj.__init__: its tick thread may run before the constructor returns.
        self._hooks = hooks
        # Follower acknowledgements waiting for the fdatasync that makes them true.
        self._deferred_acks: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        super().__init__(*args, **kwargs)

    def _sync_and_acknowledge(self) -> None:
        """fdatasync the journal once, then send every acknowledgement it made true."""
        self._journal.sync()
        acks, self._deferred_acks = self._deferred_acks, []
        for args, kwargs in acks:
            _original_send_next_node_idx(self, *args, **kwargs)

    @property
    def _journal(self) -> DurableJournal:
        journal: DurableJournal = self._SyncObj__raftLog
        return journal

    def _checkCommandsToApply(self) -> None:
        super()._checkCommandsToApply()
        # New entries were appended and already sent to the followers: fsync them here, in
        # parallel with the followers' own fsync, rather than at the next tick (the commit
        # computation there then finds nothing left to sync).
        self._sync_and_acknowledge()

    def _onTick(self, timeToWait: float = 0.0) -> None:
        # Before the leader's commit computation counts this node: entries on disk. On a
        # follower, this one fdatasync covers every append_entries of the last poll.
        journal = self._journal
        self._sync_and_acknowledge()
        super()._onTick(timeToWait)
        if journal.bytes_total > limits.RAFT_LOG_BYTES_MAX:
            self.forceLogCompaction()
        self._hooks.on_tick()


def _send_next_node_idx(self: _SyncObj, *args: Any, **kwargs: Any) -> None:
    # A follower's "success" must mean "durable here". While entries are unsynced, the ack
    # waits (in order) for the single fdatasync at the start of the next tick, which covers
    # every message received in the same poll: one fsync per poll, not per message.
    if self._journal.dirty or self._deferred_acks:
        self._deferred_acks.append((args, kwargs))
        return
    _original_send_next_node_idx(self, *args, **kwargs)


def _on_message_received(self: _SyncObj, node: Any, message: Any) -> Any:
    # pysyncobj sets nextIndex[follower] to the acknowledged index on every success, even
    # when it already sent entries past it (a late ack of an earlier message): its next send
    # would resend every in-flight entry, which the follower truncates, rewrites and fsyncs
    # again (59% of entries under load). A success never moves nextIndex backwards here; a
    # follower that really lacks entries answers success=False/reset=True, which still does.
    if (
        isinstance(message, dict)
        and message.get("type") == "next_node_idx"
        and message.get("success")
        and not message.get("reset")
    ):
        next_index = self._SyncObj__raftNextIndex
        before = next_index.get(node)
        result = _original_on_message_received(self, node, message)
        if before is not None and next_index.get(node, 0) < before:
            next_index[node] = before
        return result
    return _original_on_message_received(self, node, message)


def _do_apply_command(self: _SyncObj, command: bytes) -> Any:
    if command[:1] != _TAG_REGULAR:
        return _original_do_apply_command(self, command)
    lsn = self.raftLastApplied + 1  # entries are applied in order, one at a time
    try:
        return self._hooks.apply(lsn, memoryview(command)[1:])
    except BaseException:
        # A failed apply would be retried forever by pysyncobj's tick loop, or skipped:
        # either diverges the replica. Stop the process; a restart recovers from disk.
        log.critical("apply failed; stopping the node lsn=%d", lsn, exc_info=True)
        logging.shutdown()
        os._exit(70)


_original_send_next_node_idx = SyncObj._SyncObj__sendNextNodeIdx
_original_on_message_received = SyncObj._SyncObj__onMessageReceived
_original_do_apply_command = SyncObj._SyncObj__doApplyCommand
_SyncObj._SyncObj__sendNextNodeIdx = _send_next_node_idx
_SyncObj._SyncObj__doApplyCommand = _do_apply_command
_SyncObj._SyncObj__onMessageReceived = _on_message_received

_FAILURES: Final[dict[int, Callable[[], RaftStoreError]]] = {
    FAIL_REASON.QUEUE_FULL: lambda: Overloaded("raft commands", limits.RAFT_COMMAND_QUEUE_MAX),
    FAIL_REASON.MISSING_LEADER: lambda: NotLeader(None),
    FAIL_REASON.NOT_LEADER: lambda: NotLeader(None),
    FAIL_REASON.DISCARDED: lambda: LeadershipLost("entry discarded by a new leader"),
    FAIL_REASON.LEADER_CHANGED: lambda: LeadershipLost("leader changed"),
    FAIL_REASON.REQUEST_DENIED: lambda: LeadershipLost("request denied"),
}


def _failure(reason: int) -> RaftStoreError:
    make = _FAILURES.get(reason)
    if make is None:  # UNKNOWN_OUTCOME and anything newer: the outcome is unknown.
        return LeadershipLost(f"pysyncobj failure reason {reason}")
    return make()


class RaftReplica:
    """One Raft member. Construct it on the process's main thread: pysyncobj's tick thread
    stops when the thread that built the SyncObj exits."""

    def __init__(self, settings: RaftSettings, hooks: ReplicaHooks) -> None:
        _patch_pysyncobj()
        self._settings = settings
        self._hooks = hooks
        directory = settings.directory
        directory.mkdir(parents=True, exist_ok=True)
        checkpoint_path = directory / "checkpoint"
        host = settings.self_address.rsplit(":", 1)[0]
        timeout = settings.election_timeout_s
        conf = SyncObjConf(
            password=settings.secret,
            bindAddress=settings.self_address,
            journalFile=str(directory),
            fullDumpFile=str(checkpoint_path),
            serializer=self._serialize,
            deserializer=self._deserialize,
            useFork=False,
            autoTick=True,
            autoTickPeriod=0.01,
            # Send entries as soon as they are proposed (low latency); group commit above
            # this layer packs concurrent publishes into few large entries.
            appendEntriesUseBatch=False,
            appendEntriesPeriod=0.05,
            appendEntriesBatchSizeBytes=limits.RAFT_APPEND_BATCH_BYTES,
            sendBufferSize=limits.RAFT_SOCKET_BUFFER_BYTES,
            recvBufferSize=limits.RAFT_SOCKET_BUFFER_BYTES,
            raftMinTimeout=timeout,
            # A narrow spread: the first follower to time out wins in one round (a vote
            # takes milliseconds), and the worst-case detection stays at 1.5x the timeout.
            raftMaxTimeout=1.5 * timeout,
            # A leader cut off from the majority stops accepting writes after this.
            leaderFallbackTimeout=max(2 * timeout, 1.0),
            # A link this node sends on and hears nothing from for this long is dropped
            # (a frozen peer); idle links are exempt (see _connection_timeout).
            connectionTimeout=2 * timeout,
            connectionRetryTime=0.5,
            commandsQueueSize=limits.RAFT_COMMAND_QUEUE_MAX,
            commandsWaitLeader=False,
            logCompactionMinEntries=10**12,  # time- and size-driven only (see maybe_checkpoint)
            logCompactionMinTime=settings.checkpoint_interval_s,
            logCompactionSplit=False,
            logCompactionBatchSize=limits.RAFT_SNAPSHOT_CHUNK_BYTES,
            dynamicMembershipChange=False,
            onStateChanged=self._on_state_changed,
            maxBindRetries=30,
            bindRetryTime=0.5,
        )
        self._checkpoint_pending_load = checkpoint_path.exists()
        log.info(
            "starting raft member group=%d self=%s peers=%s host=%s",
            settings.group_id,
            settings.self_address,
            ",".join(settings.peer_addresses),
            host,
        )
        self._sync_obj = _SyncObj(
            self, settings.self_address, list(settings.peer_addresses), conf=conf
        )

    # --- hooks seen by pysyncobj (tick thread) ---

    def apply(self, lsn: int, command: memoryview) -> Any:
        if self._checkpoint_pending_load:
            # Entries before the checkpoint load are replayed history the checkpoint
            # already contains; applying them to an empty state would redo old drops.
            return None
        return self._hooks.apply(lsn, command)

    def on_tick(self) -> None:
        self._hooks.on_tick()

    def on_role_change(self, is_leader: bool) -> None:
        self._hooks.on_role_change(is_leader)

    def write_checkpoint(self, path: Path, last: Entry, previous: Entry) -> None:
        self._hooks.write_checkpoint(path, last, previous)

    def read_checkpoint(self, path: Path) -> tuple[Entry, Entry]:
        return self._hooks.read_checkpoint(path)

    def _on_state_changed(self, old: int, new: int) -> None:
        if (old == _STATE_LEADER) != (new == _STATE_LEADER):
            log.info(
                "role change group=%d leader=%s", self._settings.group_id, new == _STATE_LEADER
            )
            self._hooks.on_role_change(new == _STATE_LEADER)

    def _serialize(self, file_name: str, data: tuple[Entry, Entry, Any]) -> None:
        last, previous, _cluster = data
        self._hooks.write_checkpoint(Path(file_name), _entry(last), _entry(previous))

    def _deserialize(self, file_name: str) -> tuple[Entry, Entry, list[Any]]:
        try:
            last, previous = self._hooks.read_checkpoint(Path(file_name))
            last, previous = self._trim_journal_to(last, previous)
        except BaseException:
            # pysyncobj would log this and boot with an empty state. Refuse to start.
            log.critical("cannot load checkpoint %s; stopping", file_name, exc_info=True)
            logging.shutdown()
            os._exit(71)
        self._checkpoint_pending_load = False
        return last, previous, []

    def _trim_journal_to(self, last: Entry, previous: Entry) -> tuple[Entry, Entry]:
        """Make the journal start with the checkpoint's two entries when it holds them, so
        pysyncobj keeps every entry after them (it clears the journal on any mismatch)."""
        journal = self._sync_obj._journal
        if len(journal) == 0:
            return last, previous
        first_idx = journal[0][1]
        position = previous[1] - first_idx
        if position < 0 or position + 1 >= len(journal):
            return last, previous
        held_previous, held_last = journal[position], journal[position + 1]
        if (held_previous[1:], held_last[1:]) != (previous[1:], last[1:]):
            return last, previous
        if position > 0:
            journal.deleteEntriesTo(position)
        return journal[1], journal[0]

    # --- API for the group (any thread) ---

    def propose(self, command: bytes, callback: ProposalCallback) -> None:
        """Queue `command` for replication. `callback(result, error)` runs on the tick thread
        once the entry is applied here (result) or failed (error); it must not block."""

        def done(result: Any, reason: int) -> None:
            if reason == FAIL_REASON.SUCCESS:
                callback(result, None)
            else:
                callback(None, _failure(reason))

        self._sync_obj._applyCommand(_TAG_REGULAR + command, done)

    def is_leader(self) -> bool:
        return bool(self._sync_obj._isLeader())

    def is_leader_ready(self) -> bool:
        """Leader, and its first entry of this term (the no-op) is applied: its state
        machine has everything committed before it took over."""
        noop_idx = self._sync_obj._SyncObj__noopIDx
        return self.is_leader() and noop_idx is not None and self.last_applied >= noop_idx

    def leader_address(self) -> str | None:
        leader = self._sync_obj._getLeader()
        return None if leader is None else str(leader.address)

    def status(self) -> dict[str, Any]:
        raw = self._sync_obj.getStatus()
        leader = raw.get("leader")
        state = {0: "follower", 1: "candidate", 2: "leader"}.get(int(raw["state"]), "unknown")
        return {
            "role": state,
            "leader_raft_address": None if leader is None else str(leader.address),
            "term": int(raw["raft_term"]),
            "commit_index": int(raw["commit_idx"]),
            "last_applied": int(raw["last_applied"]),
            "log_len": int(raw["log_len"]),
            "has_quorum": bool(raw["has_quorum"]),
            "journal_bytes": self._sync_obj._journal.bytes_total,
            "journal_syncs": self._sync_obj._journal.syncs,
            "match_index": {
                key.removeprefix("match_idx_server_"): int(value)
                for key, value in raw.items()
                if key.startswith("match_idx_server_")
            },
        }

    @property
    def last_applied(self) -> int:
        return int(self._sync_obj.raftLastApplied)

    @property
    def commit_index(self) -> int:
        return int(self._sync_obj.raftCommitIndex)

    def request_checkpoint(self) -> None:
        self._sync_obj.forceLogCompaction()

    def add_tick_callback(self, callback: Callable[[], None]) -> None:
        self._sync_obj.addOnTickCallback(callback)

    def close(self) -> None:
        self._sync_obj.destroy_synchronous()


def _entry(raw: Any) -> Entry:
    command, idx, term = raw
    return bytes(command), int(idx), int(term)


def make_node_address(address: str) -> TCPNode:
    return TCPNode(address)
