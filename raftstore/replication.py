"""pysyncobj's adapter: one Raft member of one group, made durable and fast.

pysyncobj 0.3.17 as shipped never fsyncs its journal, loses the log tail
when its dump-file compaction races a crash, corrupts entries >= appendEntriesBatchSizeBytes,
pickles with protocol 2 and zlib-compresses every message. This module closes each gap:

1. Durability. `DurableJournal` (storage/journal.py) replaces pysyncobj's journal through
   `pysyncobj.syncobj.createJournal`. Entries are written on `add` and made durable by one
   fdatasync (`sync`) that runs
   - on a follower, before it answers append_entries with success (wrapping
     `__sendNextNodeIdx`): once for every message one poll read, right after that poll;
   - on the leader, by the kernel (Linux AIO; storage/kernel_sync.py) or else on the
     journal's helper thread (`DurableJournal.sync_ahead`), started as soon as it has
     added and sent new entries: its tick thread takes the followers' acknowledgements
     meanwhile, and the commit counts the leader only up to the index its
     fdatasyncs have covered (`commit_reach`; pysyncobj's own computation counts it always,
     and is cut back before anything is applied or sent, in `__applyLogEntries`). Two
     followers' acknowledgements commit an entry whose fdatasync on the leader is still
     running (Raft allows the leader's write in parallel: Ongaro's thesis, 10.2.1).
   So an entry is committed only once it is fsynced on a majority. Term and vote are written
   with fsync before they are used. The journal holds only its newest commands in memory
   (`__getEntries` is replaced so that a send reads back only what it sends).
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
6. Peer encryption. pysyncobj unpickles whatever arrives on its port, so the port is
   bound to the configured address and every message is AES-GCM encrypted and
   authenticated with a key from the cluster secret (`pysyncobj_patches.AesGcmEncryptor`,
   replacing Fernet: the tag is what stops remote code execution, and AES-GCM costs a
   fraction of Fernet's AES-CBC + HMAC + base64 on multi-MiB batches). A frame longer than
   `RAFT_FRAME_BYTES_MAX` drops the link before its bytes are buffered. An entry's big
   commands are sealed once and sent unchanged to every follower within a tick (split
   tokens); the encryptor lets them go at the end of each tick (`_onTick`).
7. Commit notices. With appendEntriesUseBatch=False pysyncobj sends every follower an
   append_entries after every apply, only to carry the new commit index; here the next
   entry carries it, or a heartbeat brought forward to `_COMMIT_NOTICE_S` after the apply
   of rows, and to the same tick after any other entry, so a follower learns of a new table
   one message and one apply after its creator, not 10 ms later (`__applyLogEntries`; the
   tick's poll waits no longer than that). Reads of a table's end go to the leader
   (`ReadRequest.end_at_leader`), where every acknowledged row is.

8. Proposals on the proposing thread. pysyncobj queues a proposal and wakes the tick thread
   (a pipe), which adds it to the journal and sends it. On a leader with nothing in flight
   the proposing thread does both itself when no tick is running: a tick holds
   `_tick_lock` for all its work and lets go of it only for its poll's wait
   (`_poll_until_next_send`), so pysyncobj's state is still touched by one thread at a
   time; a proposal that finds the lock taken, or entries in flight, goes pysyncobj's way.
   A waited publish saves the wake-up of the tick thread and its GIL hand-over.
9. Pacing. pysyncobj sends every follower every entry at once; a commit needs only a
   majority. The leader's send loop (`__sendAppendEntries`, pysyncobj's per follower) sends
   each new entry at once to the followers a majority needs, and to the others in batches
   (pacing.py: at most `HOLD_FOLLOWERS_S` after the first entry they lack).

The process-wide patches (journal, encryptor, pickle protocol, compression, link timeouts)
live in pysyncobj_patches.py with a guard on the pysyncobj version; the per-class ones are
`_SyncObj`'s below.

Our commands travel as `REGULAR` entries whose bytes are ours (`commands.py`), never pickle:
`__doApplyCommand` is wrapped to hand them to the group's `apply` directly.

The checkpoint file's layout is storage/raft_checkpoint.py's; leadership transfer is
transfer.py's, over the member's view `RaftReplica` gives it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pysyncobj.tcp_connection as pysyncobj_tcp_connection
from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf
from pysyncobj.fast_queue import Queue as pysyncobj_queue
from pysyncobj.poller import POLL_EVENT_TYPE, PollPoller
from pysyncobj.syncobj import SyncObjExceptionWrongVer

from hastream.errors import (
    CorruptionError,
    LeadershipLost,
    NotLeader,
    Overloaded,
    RaftStoreError,
)
from raftstore import commands, limits, pre_vote, pysyncobj_patches, trace
from raftstore.append_rule import AppendPlan, raft_append_rule
from raftstore.identity import REJOIN_MARKER
from raftstore.log_limits import OncePerInterval
from raftstore.pacing import Follower, Pacing
from raftstore.pre_vote import LogPosition, PreVoteRound
from raftstore.replica import (
    STALLED,
    ApplyHooks,
    CommandBytes,
    ConnectionHost,
    HostedConnection,
    ProposalCallback,
    RoleSignal,
    Snapshot,
    join_command,
)
from raftstore.stats import (
    CHECKPOINT_BUCKETS_S,
    FSYNC_BUCKETS_S,
    HistogramSnapshot,
    LatencyHistogram,
)
from raftstore.storage import checkpoint, raft_checkpoint
from raftstore.storage.files import REAL_FILES, ensure_dir
from raftstore.storage.journal import DurableJournal, Entry
from raftstore.storage.raft_checkpoint import RaftCheckpoint
from raftstore.transfer import LeadershipTransfer

log = logging.getLogger(__name__)

_REGULAR: Final = 0  # pysyncobj's _COMMAND_TYPE.REGULAR
_TAG_REGULAR: Final = bytes([_REGULAR])
_STATE_FOLLOWER: Final = 0  # pysyncobj's _RAFT_STATE.FOLLOWER
_STATE_LEADER: Final = 2  # pysyncobj's _RAFT_STATE.LEADER
# A leader in doubt asks a follower to take over this often, until one does.
_TRANSFER_RETRY_S: Final = 0.2
# A member whose journal failed a write stays in doubt this long after the last failure.
_JOURNAL_TROUBLE_S: Final = 2.0
# A commit index the leader applied reaches the followers at most this much later (with the
# next entry, or a heartbeat brought forward; pysyncobj sent one message per follower per
# apply for it). Under pipelined load the batcher's next proposal follows the answer within
# a fraction of this. A publisher that waits for each answer sends its next entry 1.5-8 ms
# later (fast and slow machines): at 2 ms a notice went out between every two of its
# entries; 10 ms saved ~20% of the node CPU of a waited one-row publish on a slow machine
# (docs/benchmark.md). Only rows wait that long: reads of a table's end go to the leader.
_COMMIT_NOTICE_S: Final = 0.010
# Any other entry (a table created or dropped, a user, a rule, a subscriber's offset) is
# told at once: a caller that asks a follower right after the answer (a Session's first
# site) must find the table there.

# How long an idle tick thread sleeps in its poll. Everything that needs the tick sooner
# wakes it: a message from a peer, a proposal (pysyncobj's pipe), the leader's own
# fdatasync returning (`wake`, `watch`), a heartbeat or commit notice coming due (the leader's
# poll ends at `_next_send_at`). What is only looked at on a tick (an election deadline of
# a second or more, a leadership transfer's next step, damage a reader reported, retention)
# can wait this long. pysyncobj's own 10 ms woke each member's tick thread 100 times a
# second for nothing, ~0.4 ms of CPU each on a 2-core VM: an idle node with two groups used
# 0.084-0.097 of a core, and 0.037-0.059 with this (`python -m bench.idle`).
_IDLE_TICK_S: Final = 0.05

# Under load a tick runs per message (several per entry); what it only looks after (a
# checkpoint or retention due, damage a reader reported, a rejoin, a leadership transfer's
# next step, the leader count, the hosted connections' timeouts) is looked at no more often
# than this: those checks cost ~40 us of the leader's CPU per one-row waited append on a
# 2-core VM (docs/benchmark.md), and none needs sub-millisecond promptness. The doubt and
# pre-vote gates, which decide whether this tick may start an election, run every tick.
_HOUSEKEEPING_S: Final = 0.001

# A follower a commit does not need (pacing.py) gets what it lacks once its first missing
# entry has waited this long, or once it lacks _HOLD_FOLLOWERS_BYTES.
HOLD_FOLLOWERS_S: Final = 0.010
_HOLD_FOLLOWERS_BYTES: Final = 1024 * 1024
# A checkpoint the applier wants is asked for at most this often.
_CHECKPOINT_FORCE_S: Final = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RaftSettings:
    group_id: int
    self_address: str  # "host:port" of this member's Raft port
    peer_addresses: tuple[str, ...]
    directory: Path  # streamingHADir/group-<id>
    secret: str
    election_timeout_s: float
    checkpoint_interval_s: float
    yield_after_ack: bool = True  # tuning.py: see _sync_and_acknowledge
    kernel_syncs: bool = True  # tuning.py: the journal's `sync_ahead`
    journal_segment_bytes: int | None = None  # tuning.py: smaller journal segments
    journal_resident_bytes: int | None = None  # tuning.py: fewer commands held in memory
    # pacing.py: a follower a commit does not need gets entries in batches, the first
    # entry held back at most this long (0: every follower gets every entry at once).
    hold_followers_s: float = HOLD_FOLLOWERS_S


# --- the replica ---------------------------------------------------------------------------


class _SyncObj(SyncObj):  # type: ignore[misc]
    """pysyncobj's SyncObj with the durability and doubt hooks; no business logic."""

    def __init__(self, replica: RaftReplica, *args: Any, **kwargs: Any) -> None:
        # Set before SyncObj.__init__: its tick thread may run before the constructor returns.
        self._replica = replica
        self._hooks = replica.hooks
        # Follower acknowledgements waiting for the fdatasync that makes them true.
        self._deferred_acks: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._doubt_since: float | None = None
        self._next_transfer_at = 0.0
        self._checkpoint_forced_until = 0.0
        self._pre_vote = PreVoteRound()
        self._leader_heard_at: float | None = None  # last append_entries of a current term
        self._slow_tick_log = OncePerInterval(10.0)
        self._commit_before_tick = 0  # the commit index before pysyncobj's computation
        # While a follower hands pysyncobj a message that must keep its log's tail
        # (_keeping_tail): the last index its __getEntries may show.
        self._log_view_end: int | None = None
        # Committed entries read for the apply and not yet applied (_entries_to_apply).
        self._read_ahead: list[Entry] = []
        # Held by whichever thread runs pysyncobj's code: the tick thread for a whole tick
        # but the wait in its poll, or a thread proposing on the leader (_applyCommand).
        self._tick_lock = threading.Lock()
        # Client connections this loop serves (port_loop.py), by descriptor; calls other
        # threads asked it to run (call_soon); when it last looked at their timeouts.
        self._hosted: dict[int, HostedConnection] = {}
        self._soon: collections.deque[Callable[[], None]] = collections.deque()
        self._hosted_checked_at = 0.0
        # The journal's eventfd the tick's poll watches (`watch`), and the thread that ticks.
        self._sync_watched: int | None = None
        self._tick_thread_id: int | None = None
        self._journal_failures = _JournalFailures(replica)
        self._housekeeping_at = 0.0  # when a tick next runs `_housekeep`
        self._compaction_check_at = 0.0  # when pysyncobj's compaction check next runs
        # Which followers the leader sends to when (pacing.py); for the term it was made
        # in (a new term makes every follower due), counting the bytes of entries up to
        # `_paced_through`.
        self._pacing = Pacing(
            hold_s=replica.settings.hold_followers_s,
            hold_bytes=_HOLD_FOLLOWERS_BYTES,
            heartbeat_s=kwargs["conf"].appendEntriesPeriod,
        )
        self._pacing_term: int | None = None
        self._paced_through = 0
        super().__init__(*args, **kwargs)
        poller = self._poller
        if not isinstance(poller, PollPoller):
            raise pysyncobj_patches.UnsupportedPysyncobj(f"poller {type(poller).__name__}")
        poll_object, callbacks = (getattr(poller, n) for n in pysyncobj_patches.POLLER_ATTRIBUTES)
        self._poll_object: select.poll = poll_object
        self._poll_callbacks: dict[int, Callable[[int, int], None]] = callbacks
        poller.poll = self._poll_until_next_send
        if not replica.settings.kernel_syncs:
            self._journal.use_helper_thread()
        if replica.settings.journal_segment_bytes is not None:
            self._journal.use_segment_bytes(replica.settings.journal_segment_bytes)
        if replica.settings.journal_resident_bytes is not None:
            self._journal.use_resident_bytes(replica.settings.journal_resident_bytes)

    def _poll_until_next_send(self, timeout: float) -> None:
        """PollPoller.poll, except that the wait lets go of the tick lock (so a proposing
        thread can add and send meanwhile), and a leader's ends when its next heartbeat is
        due: the tick's poll waits up to _IDLE_TICK_S, and a heartbeat brought forward (the
        commit notice below) must not wait behind it."""
        if self._SyncObj__raftState == _STATE_LEADER:
            now = pysyncobj_tcp_connection.monotonicTime()
            timeout = min(timeout, max(0.0, self._next_send_at() - now))
        lock = self._tick_lock
        lock.release()
        try:
            events = self._poll_object.poll(timeout * 1000)
        finally:
            lock.acquire()
        callbacks = self._poll_callbacks
        for descr, event in events:
            callbacks[descr](descr, _event_mask(event))
        while self._soon:
            self._run_soon(self._soon.popleft())
        if self._deferred_acks:
            # A follower's acknowledgements of what this poll read leave now, after one
            # fdatasync for all of them, not after the rest of the tick (its hooks, then the
            # next tick's start): a waited publish waits for them. x1.05 rows/s one-row
            # waited (bench.checkouts_ab, 16 rounds).
            self._sync_after_add()

    def _next_send_at(self) -> float:
        """When a leader's tick sends the followers an append_entries even with no new
        entry (a heartbeat, or a commit notice brought forward). A method, not a property:
        SyncObj.__init__ reads every attribute of the object before this one is set."""
        planned: float = getattr(self, "_SyncObj__newAppendEntriesTime")  # noqa: B009
        return planned

    def _sync_and_acknowledge(self) -> None:
        """A follower: fdatasync the journal once, then send every acknowledgement it made
        true. The leader: have its fdatasync run without waiting for it (`commit_reach`)."""
        if not self._deferred_acks and self._journal.settled:
            return  # most calls: a tick's start, a proposal with nothing added
        if self._SyncObj__raftState == _STATE_LEADER and not self._deferred_acks:
            took = self._journal.sync_ahead(self)
            if took is not None:
                self._replica.fsync_latency.observe(took)
            return
        if self._journal.dirty:
            started = time.monotonic()
            self._journal.sync()
            self._replica.fsync_latency.observe(time.monotonic() - started)
        else:
            self._journal.sync()
        acks, self._deferred_acks = self._deferred_acks, []
        for args, kwargs in acks:
            _send_next_node_idx(self, *args, **kwargs)
        if acks and self._replica.settings.yield_after_ack:
            # The acknowledgement wakes the leader's tick thread, and Linux may queue it on
            # this CPU, behind this thread, which goes on to apply what the leader's last
            # message committed (0.2 ms for one row) while the other CPU idles. Yielding
            # lets the leader take the acknowledgement first: its commit, not this apply,
            # is what the publisher waits for. Measured with bench.sched_wakeups and
            # bench.checkouts_ab (docs/benchmark.md).
            os.sched_yield()

    @property
    def _journal(self) -> DurableJournal:
        adapter: pysyncobj_patches.PysyncobjJournal = self._SyncObj__raftLog
        return adapter.durable

    # --- SyncWaker (journal.py): the leader's commit waits for its own fdatasync ---

    def wake(self) -> None:
        """The journal's helper thread: the leader's fdatasync returned, and the commit may
        count it now: wake the tick thread from its poll."""
        self._SyncObj__pipeNotifier.notify()

    def watch(self, fd: int) -> None:
        """The kernel's fdatasync (the journal's eventfd): the tick's poll watches it until
        it turns readable once, so the commit is computed again as soon as it returned.
        Watched only while the commit waits for it: polled always, it would wake the tick
        thread after most entries for nothing (the followers' acknowledgements come
        later)."""
        if self._sync_watched == fd:
            return
        self._sync_watched = fd
        self._poller.subscribe(fd, self._on_sync_returned, POLL_EVENT_TYPE.READ)
        if threading.get_ident() != self._tick_thread_id:
            # A proposing thread (the tick thread waits in its poll, which does not watch
            # the eventfd yet): wake it, its next poll does.
            self._SyncObj__pipeNotifier.notify()

    def _on_sync_returned(self, descr: int, event: int) -> None:
        # The next tick's commit computation takes the fdatasync's result (the journal
        # reads the eventfd then); only the watch ends here.
        self._unwatch_sync()

    def _unwatch_sync(self) -> None:
        fd, self._sync_watched = self._sync_watched, None
        if fd is not None:
            self._unsubscribe(fd)

    def _unsubscribe(self, fd: int) -> None:
        self._poller.unsubscribe(fd)
        self._poll_callbacks.pop(fd, None)  # pysyncobj's unsubscribe keeps the callback

    def _sync_after_add(self) -> None:
        # A failed fdatasync surfaces from the tick's own sync right after pysyncobj's loop
        # (the journal refuses every call from then on); raised here, it would cut that loop
        # between an entry's add and its proposer's callback (on the leader), or the poll's
        # handling of its other events (on a follower).
        with contextlib.suppress(OSError):
            self._sync_and_acknowledge()

    def _applyCommand(self, command: bytes, callback: Any, commandType: int | None = None) -> None:
        # pysyncobj queues the command and wakes the tick thread, which adds and sends it.
        # On the leader the proposing thread does that itself when no tick is running
        # (the tick thread waits in its poll): it saves a wake-up of the tick thread and
        # a GIL hand-over per proposal. Measured in docs/benchmark.md (seventeenth session).
        if commandType is not None or self._SyncObj__raftState != _STATE_LEADER:
            super()._applyCommand(command, callback, commandType)
            return
        try:
            self._SyncObj__commandsQueue.put_nowait((command, callback))
        except pysyncobj_queue.Full:
            self._SyncObj__callErrCallback(FAIL_REASON.QUEUE_FULL, callback)
            return
        # Never a blocking acquire: a proposer may hold the leadership transfer's lock
        # (transfer.admit), which the tick thread takes while it holds this one.
        if not self._tick_lock.acquire(blocking=False):
            # A tick is running: it takes the queue before its poll, or this wakes it. Not
            # when that tick is this thread (a publish-port request read by its poll): its
            # caller adds the entry at once (`propose_now`), or the next tick takes the
            # queue before it polls; the wake-up only cost a tick and two system calls
            # per publish (node CPU x0.96-0.97 per one-row waited append, docs/benchmark.md).
            if threading.get_ident() != self._tick_thread_id:
                self._SyncObj__pipeNotifier.notify()
            return
        try:
            if self._SyncObj__destroying:
                return  # closing: as pysyncobj, the proposal stays queued, never answered
            if self._SyncObj__raftCommitIndex < self._SyncObj__getCurrentLogIndex():
                # Entries in flight (a pipelined load): the tick thread, woken by their
                # acknowledgements, would wait here for the lock; it adds this one on its way.
                self._SyncObj__pipeNotifier.notify()
                return
            with self._journal_failures:
                self._checkCommandsToApply()
            self._forget_sealed_pieces()
            if self._links_unsent() or self._commands_queued():
                # The tick's poll waits on the links' old events; one whose bytes the socket
                # did not all take needs it to wait for writability too. And pysyncobj's
                # loop stops after appendEntriesPeriod: what it left is the tick's.
                self._SyncObj__pipeNotifier.notify()
        except Exception:
            # As the tick thread's loop does with its own (pysyncobj's _autoTickThread):
            # the entry, if added, is the tick's to commit and answer; the proposer waits.
            log.exception("failed _onTick: proposing on thread %s", threading.current_thread().name)
        finally:
            self._tick_lock.release()

    def _doDestroy(self) -> None:
        # The tick thread closes the links and the journal between two ticks: not while a
        # proposing thread sends on them.
        with self._tick_lock:
            for connection in list(self._hosted.values()):
                connection.close()
            self._unwatch_sync()  # the journal closes its eventfd
            super()._doDestroy()

    # --- ConnectionHost (port_loop.py): client connections served by this loop ---

    def host(self, connection: HostedConnection) -> bool:
        with self._tick_lock:
            if self._SyncObj__destroying:
                return False
            fd = connection.fileno()
            self._hosted[fd] = connection
            self._poller.subscribe(
                fd, connection.on_event, POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR
            )
        self._SyncObj__pipeNotifier.notify()  # a poll under way does not watch it yet
        return True

    def release(self, fd: int) -> None:
        self._hosted.pop(fd, None)
        self._unsubscribe(fd)

    def call_soon(self, call: Callable[[], None]) -> None:
        self._soon.append(call)
        self._SyncObj__pipeNotifier.notify()

    def propose_now(self) -> None:
        # A request read by this loop: its proposal is queued (`_applyCommand` found the
        # tick lock held, by this thread). Added and sent here rather than at the next
        # tick's start, after this tick's rest and the next one's commit and apply
        # checks. While entries are in flight the next tick adds it, as `_applyCommand`
        # leaves it under a pipelined load.
        if self._SyncObj__raftState != _STATE_LEADER or not self._commands_queued():
            return
        if self._SyncObj__raftCommitIndex < self._SyncObj__getCurrentLogIndex():
            return
        with self._journal_failures:
            self._checkCommandsToApply()

    def _run_soon(self, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception:
            group = self._replica.settings.group_id
            log.exception("a call on the raft loop failed group=%d", group)

    def _check_hosted(self) -> None:
        """Once a second: the hosted connections' timeouts."""
        if not self._hosted:
            return  # every follower's tick, and most leaders': no clock read
        now = time.monotonic()
        if now - self._hosted_checked_at < 1.0:
            return
        self._hosted_checked_at = now
        for connection in list(self._hosted.values()):
            connection.on_tick()

    def _commands_queued(self) -> bool:
        return bool(getattr(self._SyncObj__commandsQueue, pysyncobj_patches.QUEUE_ATTRIBUTE))

    def _links_unsent(self) -> bool:
        connections = self._SyncObj__transport._connections
        return any(connection.getSendBufferSize() for connection in connections.values())

    def _checkCommandsToApply(self) -> None:
        # The leader adds each new entry and sends it at once (appendEntriesUseBatch=False);
        # its own fdatasync starts after the sends. Started between the add and the sends,
        # the kernel's worker (or the journal's helper thread) took the CPU from the sends
        # on this 2-core machine: an entry reached its followers 0.09 ms after its add
        # instead of 0.15, and the add -> commit went from 0.96 to 0.90 ms (x1.02 rows/s one
        # row waited, x1.03 at 1,000; docs/benchmark.md, twenty-third session).
        super()._checkCommandsToApply()
        self._sync_and_acknowledge()

    def _onTick(self, timeToWait: float = 0.0) -> None:
        with self._tick_lock:
            self._tick_thread_id = threading.get_ident()
            self._tick(timeToWait)

    def _tick(self, timeToWait: float) -> None:
        # Before the leader's commit computation counts this node: entries on disk. On a
        # follower, what the last poll left unsynced (normally synced right after it).
        with self._journal_failures:
            self._sync_and_acknowledge()
            if self._replica.in_doubt():
                self._stay_out_of_leadership()
            else:
                self._doubt_since = None
            self._pre_vote_gate()
            started = time.monotonic()
            self._commit_before_tick = self._SyncObj__raftCommitIndex
            super()._onTick(timeToWait)
            self._note_slow_tick(time.monotonic() - started - timeToWait)
        finished = time.monotonic()
        if finished >= self._housekeeping_at:
            self._housekeeping_at = finished + _HOUSEKEEPING_S
            self._housekeep()
        self._forget_sealed_pieces()

    def _forget_sealed_pieces(self) -> None:
        """At a tick's end (its frames are queued on their links): the entries' pieces
        sealed for the links (pysyncobj_patches.AesGcmEncryptor.seal_piece) go, but for
        those a held-back follower is still to be sent (pacing.py), which it would
        otherwise seal again: up to twice the hold's worth."""
        encryptor = self.encryptor
        if encryptor is None:
            return
        if self._pacing.holding:
            now = pysyncobj_tcp_connection.monotonicTime()
            encryptor.forget_pieces(sealed_before=now - 2 * self._pacing.hold_s)
        else:
            encryptor.forget_pieces()

    def _housekeep(self) -> None:
        """What a tick looks at but rarely finds to do: at most every _HOUSEKEEPING_S."""
        now = pysyncobj_tcp_connection.monotonicTime()
        wanted = self._hooks.checkpoint_wanted() and now >= self._checkpoint_forced_until
        if self._journal.bytes_total > limits.RAFT_LOG_BYTES_MAX or wanted:
            self._checkpoint_forced_until = now + _CHECKPOINT_FORCE_S
            self.forceLogCompaction()
        self._hooks.on_tick()
        self._journal.check_spares_room(now)
        self._check_hosted()
        self._replica.check_rejoined()
        self._replica.observe_leader()
        self._replica.drive_transfer()

    def _note_slow_tick(self, held_s: float) -> None:
        """A tick that held the thread for half an election timeout is logged: heartbeats
        and acknowledgements wait behind it, and on a loaded machine (CPU starved, a slow
        disk) it is what costs a leader its leadership."""
        timeout = self._replica.settings.election_timeout_s
        if held_s < timeout / 2:
            return
        self._replica.slow_ticks += 1
        events = self._slow_tick_log.due()
        if events is not None:
            log.warning(
                "raft tick held its thread group=%d took_ms=%.0f election_timeout_ms=%.0f "
                "slow_ticks_since_last_line=%d",
                self._replica.settings.group_id,
                held_s * 1000,
                timeout * 1000,
                events,
            )

    def _pre_vote_gate(self) -> None:
        """pysyncobj starts an election in this tick when the election timer ran out: let it
        only after a pre-vote passed (pre_vote.py), else push the timer and ask."""
        if self._SyncObj__raftState == _STATE_LEADER or self._SyncObj__selfNode is None:
            return
        now = pysyncobj_tcp_connection.monotonicTime()
        deadline: float = getattr(self, "_SyncObj__raftElectionDeadline")  # noqa: B009 (mypy)
        if deadline >= now or self._SyncObj__transferInProgress:
            return  # Not due, or the leader's TimeoutNow asked for this election.
        term = self.raftCurrentTerm
        if self._pre_vote.take_pass(term) or not self._SyncObj__connectedToAnyone():
            return  # Stand now; or pysyncobj waits for a link anyway.
        retry = self._SyncObj__generateRaftTimeout() * pre_vote.RETRY_FRACTION
        self._SyncObj__raftElectionDeadline = now + retry
        if self._pre_vote.start(term, len(self._SyncObj__otherNodes) + 1):
            self._SyncObj__raftElectionDeadline = 0.0
            return
        message = {
            "type": pre_vote.PRE_VOTE,
            "term": term + 1,
            "last_log_index": self._SyncObj__getCurrentLogIndex(),
            "last_log_term": self._SyncObj__getCurrentLogTerm(),
        }
        for node in self._SyncObj__otherNodes:
            self._SyncObj__transport.send(node, message)

    def _on_pre_vote(self, node: Any, message: dict[str, Any]) -> None:
        """Another member asks whether this one would vote for it: a grant, or silence."""
        now = pysyncobj_tcp_connection.monotonicTime()
        heard = self._leader_heard_at
        grant = not self._replica.rejoining and pre_vote.should_grant(
            proposed_term=int(message["term"]),
            current_term=self.raftCurrentTerm,
            is_leader=self._SyncObj__raftState == _STATE_LEADER,
            heard_leader_s_ago=None if heard is None else now - heard,
            min_timeout_s=self._SyncObj__conf.raftMinTimeout,
            asker=LogPosition(int(message["last_log_term"]), int(message["last_log_index"])),
            own=LogPosition(
                self._SyncObj__getCurrentLogTerm(), self._SyncObj__getCurrentLogIndex()
            ),
        )
        if grant:
            self._SyncObj__transport.send(
                node, {"type": pre_vote.PRE_VOTE_GRANTED, "term": int(message["term"])}
            )

    def _on_pre_vote_granted(self, node: Any, message: dict[str, Any]) -> None:
        if self._SyncObj__raftState == _STATE_LEADER:
            return
        if self._pre_vote.granted(node, int(message["term"]), self.raftCurrentTerm):
            log.info(
                "pre-vote passed group=%d term=%d",
                self._replica.settings.group_id,
                int(message["term"]),
            )
            self._SyncObj__raftElectionDeadline = 0.0  # Stand at the next tick.

    def _stay_out_of_leadership(self) -> None:
        """A replica in doubt does not stand for election, and hands leadership away: to the
        most caught-up follower (Raft's TimeoutNow, pysyncobj's transferLeadership), or, if
        none is ready within an election timeout, by stepping down."""
        now = pysyncobj_tcp_connection.monotonicTime()
        if self._doubt_since is None:
            self._doubt_since = now
        state = self._SyncObj__raftState
        if state != _STATE_LEADER:
            self._SyncObj__raftElectionDeadline = now + self._SyncObj__generateRaftTimeout()
            return
        if now >= self._next_transfer_at:
            self._next_transfer_at = now + _TRANSFER_RETRY_S
            self.transferLeadership()
        if now - self._doubt_since > self._replica.settings.election_timeout_s:
            log.warning("leader in doubt steps down group=%d", self._replica.settings.group_id)
            self._SyncObj__setState(_STATE_FOLLOWER)
            self._SyncObj__raftLeader = None
            self._SyncObj__raftElectionDeadline = now + self._SyncObj__generateRaftTimeout()

    def _SyncObj__tryLogCompaction(self) -> None:
        # While in doubt the applied state is not whole: no checkpoint, keep the log (this
        # also keeps pysyncobj from retrying a deferred checkpoint on every tick). Looked
        # at once per `_HOUSEKEEPING_S` at most, not on every tick, unless one is asked for
        # or under way: its steps (write, then cut the log and let the applier drop what
        # only older replays needed) then take consecutive ticks, as before. Timed from its
        # own last look: pysyncobj looks early in a tick, and the housekeeping's time is set
        # at the end of the tick before, so a tick that reached this within a millisecond
        # of it (one with nothing to apply, or a quick apply) never looked, and a leader
        # under light load wrote no checkpoint for as long as that lasted (a chaos test's
        # leader went 30 s without one).
        now = time.monotonic()
        if now < self._compaction_check_at and not self._checkpoint_under_way():
            return
        self._compaction_check_at = now + _HOUSEKEEPING_S
        if self._replica.in_doubt():
            return
        serialized_before = self._SyncObj__lastSerializedEntry
        _original_try_log_compaction(self)
        if self._SyncObj__lastSerializedEntry != serialized_before:
            # The checkpoint is in place and the journal cut before it (the cut fsyncs the
            # directory both live in): the applier may drop what only older replays needed.
            self._replica.checkpoint_durable()

    def _checkpoint_under_way(self) -> bool:
        """A checkpoint was asked for, or pysyncobj writes one or has one to take."""
        serializer = self._SyncObj__serializer
        pending = getattr(serializer, pysyncobj_patches.SERIALIZER_PID_ATTRIBUTE)
        return bool(self._SyncObj__forceLogCompaction or pending)

    def _SyncObj__getEntries(
        self, fromIDx: int | None, count: int | None = None, maxSizeBytes: int | None = None
    ) -> list[Entry]:
        # pysyncobj's (syncobj.py __getEntries) slices the whole rest of the log before it
        # cuts the slice to maxSizeBytes; the journal holds only its newest commands in
        # memory, so that would read back a lagging follower's whole backlog on every send.
        # The journal cuts first, then reads what it does not hold.
        journal = self._journal
        if fromIDx is None or not len(journal) or fromIDx < journal.index_at(0):
            return []
        view_end = self._log_view_end
        if view_end is not None:
            shown = max(0, view_end - fromIDx + 1)
            count = shown if count is None else min(count, shown)
        return journal.entries(fromIDx - journal.index_at(0), count, maxSizeBytes)

    def _count_self_only_when_durable(self) -> None:
        """Cut the commit index pysyncobj's tick just computed (it counts the leader for
        every entry it holds) back to what is durable on a majority, the leader counted
        only up to its journal's `durable_index`. Runs before anything is applied or sent
        with it; the index never goes below where this tick found it."""
        proposed = int(self._SyncObj__raftCommitIndex)
        before = self._commit_before_tick
        if proposed <= before:
            return
        match_index = self._SyncObj__raftMatchIndex
        reach = commit_reach(
            self._journal.durable_index,
            [match_index.get(node, 0) for node in self._SyncObj__otherNodes],
        )
        allowed = min(proposed, reach)
        # Only an entry of the current term is committed by counting (Raft 5.4.2); the
        # leader's entries of its term are the end of its log, so if this one is older, so
        # is every entry before it.
        if allowed <= before or self._term_at(allowed) != self.raftCurrentTerm:
            allowed = before
        if allowed != proposed:
            # The commit waits for this node's own fdatasync: have it wake the tick thread.
            self._journal.want_wake()
            setattr(self, "_SyncObj__raftCommitIndex", allowed)  # noqa: B010 (mypy: pysyncobj's)
            setattr(self, "_SyncObj__leaderCommitIndex", allowed)  # noqa: B010
            self._SyncObj__raftLog.setRaftCommitIndex(allowed)

    def _term_at(self, index: int) -> int | None:
        terms = self._journal.terms(index, 1)  # no read of an evicted command
        return int(terms[0]) if terms else None

    def _SyncObj__getPrevLogIndexTerm(self, nextNodeIndex: int) -> tuple[int | None, int | None]:
        # pysyncobj's (syncobj.py __getPrevLogIndexTerm) reads the whole entry for its term:
        # for a lagging follower, a command out of memory read back from the journal file
        # on every send to it (12.7 MB for 10,000 rows of 211 columns).
        prev_index = nextNodeIndex - 1
        term = self._term_at(prev_index)
        return (None, None) if term is None else (prev_index, term)

    def _SyncObj__applyLogEntries(self) -> bool:
        # pysyncobj's loop (syncobj.py __applyLogEntries), except that
        # - an entry the applier answers STALLED is left unapplied: the loop stops,
        #   lastApplied stays, its proposer is not answered, and the same entry is offered
        #   again on a later tick;
        # - one tick applies for at most APPLY_SLICE_S: the tick thread also sends the
        #   heartbeats, and a new leader (or a restarted follower) with a long backlog that
        #   applied it in one go went silent for seconds on a loaded machine, and lost its
        #   leadership to an election before it could serve.
        if self._SyncObj__raftState == _STATE_LEADER:
            self._count_self_only_when_durable()
        last_applied = self._SyncObj__raftLastApplied
        if self._SyncObj__raftCommitIndex > last_applied:
            count = min(self._SyncObj__raftCommitIndex - last_applied, limits.APPLY_ENTRIES_MAX)
            waiting = self._SyncObj__commandsWaitingCommit
            deadline = time.monotonic() + limits.APPLY_SLICE_S
            applied = 0
            urgent = False
            for command, idx, term in self._entries_to_apply(last_applied + 1, count):
                try:
                    result = self._SyncObj__doApplyCommand(command)
                except SyncObjExceptionWrongVer as error:
                    log.error("entry %d needs pysyncobj code version %d", idx, error.ver)
                    break
                if result is STALLED:
                    break
                for subscribed_term, callback in waiting.pop(idx, []):
                    if subscribed_term == term:
                        callback(result, FAIL_REASON.SUCCESS)
                    else:
                        callback(None, FAIL_REASON.DISCARDED)
                self._SyncObj__raftLastApplied += 1
                applied += 1
                if command[:1] != _TAG_REGULAR or not commands.is_append(command, start=1):
                    urgent = True  # anything but rows: followers hear of it in this tick
                if time.monotonic() >= deadline:
                    break  # the next tick goes on, after this one's network work
            if applied and self._SyncObj__raftState == _STATE_LEADER:
                # pysyncobj (appendEntriesUseBatch=False) sends every follower an
                # append_entries right after each apply, only to carry the new commit index:
                # two messages per entry on the leader's tick, competing for the GIL with
                # the answer to the publisher, and a wake-up and a tick on each follower.
                # The next entry carries it when one follows within _COMMIT_NOTICE_S (any
                # pipelined load); else the heartbeat is brought forward to then, so a
                # follower applies (and serves reads of) what is committed at most that
                # much later, not a heartbeat period later.
                due = pysyncobj_tcp_connection.monotonicTime()
                if not urgent:
                    due += _COMMIT_NOTICE_S
                self._pacing.pull(due)
                if self._next_send_at() > due:
                    self._SyncObj__newAppendEntriesTime = due
        return False

    def _entries_to_apply(self, first: int, count: int) -> Iterator[Entry]:
        """Up to `count` committed entries from Raft index `first` on, read at most
        APPLY_READ_BYTES_MAX at a time as the apply loop asks for them. Entries older than
        the journal holds in memory are read back from its file: read all `count` at once,
        a tick that applied only what fit in APPLY_SLICE_S read a replay's whole backlog
        again on every tick (a node restarted with 250 MB of log past its checkpoint applied
        two entries a tick and was not ready a minute later). What a tick read and did not
        apply is kept for the next (`_read_ahead`): committed entries never change, so each
        is read once."""
        stop = first + count
        while first < stop:
            held = self._read_ahead
            if held and held[0][1] <= first <= held[-1][1]:
                offset = first - held[0][1]  # a chunk's indexes are consecutive
                entries = held[offset : offset + stop - first]
            else:
                entries = self._SyncObj__getEntries(
                    first, stop - first, limits.APPLY_READ_BYTES_MAX
                )
                if not entries:
                    self._read_ahead = []
                    return
                self._read_ahead = entries
            yield from entries
            first = entries[-1][1] + 1

    def _SyncObj__sendAppendEntries(self) -> None:
        # pysyncobj's (syncobj.py __sendAppendEntries), except which followers hear now:
        # the ones a commit needs get every entry at once, the others in batches
        # (pacing.py); each one sent to still gets everything it lacks, as pysyncobj's.
        # pysyncobj's chunked send of an entry of appendEntriesBatchSizeBytes or more is
        # left out: no entry comes near it (limits.RAFT_APPEND_BATCH_BYTES).
        now = pysyncobj_tcp_connection.monotonicTime()
        pacing = self._pacing
        current = self._SyncObj__getCurrentLogIndex()
        if self._pacing_term != self.raftCurrentTerm:
            pacing.reset()
            self._pacing_term = self.raftCurrentTerm
            self._paced_through = current
        added = self._bytes_added(current)
        voters = self._SyncObj__otherNodes
        connected = self._SyncObj__connectedNodes
        next_index = self._SyncObj__raftNextIndex
        match_index = self._SyncObj__raftMatchIndex
        followers = [
            Follower(node, match_index.get(node, 0), max(0, current + 1 - next_index[node]))
            for node in voters
            if node in connected
        ]
        send = pacing.plan(now, followers, (len(voters) + 1) // 2, added)
        for node in voters | self._SyncObj__readonlyNodes:
            if node not in connected:
                self._SyncObj__serializer.cancelTransmisstion(node)
                pacing.sent(node, now)  # as pysyncobj: tried again at the next heartbeat
                continue
            if node in voters and node not in send:
                continue
            self._send_entries(node, now)
            pacing.sent(node, now)
        due = min(pacing.next_due(), now + pacing.heartbeat_s)
        self._SyncObj__newAppendEntriesTime = due

    def _bytes_added(self, current: int) -> int:
        """The bytes of the entries added since the last send plan (pacing.py)."""
        start = self._paced_through + 1
        self._paced_through = current
        if current < start:
            return 0
        return self._journal.command_bytes(start, current + 1 - start)

    def _send_entries(self, node: Any, started: float) -> None:
        """pysyncobj's send loop for one follower: append_entries from its next index (a
        heartbeat if it lacks nothing), or its snapshot while its next index is older than
        the log."""
        conf = self._SyncObj__conf
        send = self._SyncObj__transport.send
        next_index = self._SyncObj__raftNextIndex
        connected = self._SyncObj__connectedNodes
        serializer = self._SyncObj__serializer
        node_index = next_index[node]
        single = True
        serializing = False
        while node_index <= self._SyncObj__getCurrentLogIndex() or single or serializing:
            if node_index > self._SyncObj__raftLog[0][1]:
                prev_index, prev_term = self._SyncObj__getPrevLogIndexTerm(node_index)
                entries: list[Entry] = []
                if node_index <= self._SyncObj__getCurrentLogIndex():
                    entries = self._SyncObj__getEntries(
                        node_index, None, conf.appendEntriesBatchSizeBytes
                    )
                    next_index[node] = entries[-1][1] + 1
                message = {
                    "type": "append_entries",
                    "term": self.raftCurrentTerm,
                    "commit_index": self._SyncObj__raftCommitIndex,
                    "entries": entries,
                    "prevLogIdx": prev_index,
                    "prevLogTerm": prev_term,
                }
                send(node, message)
                if node not in connected:
                    break
            else:
                transmission = serializer.getTransmissionData(node)
                message = {
                    "type": "append_entries",
                    "term": self.raftCurrentTerm,
                    "commit_index": self._SyncObj__raftCommitIndex,
                    "serialized": transmission,
                }
                send(node, message)
                if node not in connected:
                    break
                serializing = False
                if transmission is not None:
                    if transmission[2]:  # the last chunk
                        next_index[node] = self._SyncObj__raftLog[1][1] + 1
                    else:
                        serializing = True
            node_index = next_index[node]
            single = False
            if pysyncobj_tcp_connection.monotonicTime() - started > conf.appendEntriesPeriod:
                break


class _JournalFailures:
    """`with` it around the journal's writes and syncs on the tick thread (a class, not a
    generator context manager: it is entered a few times per entry)."""

    __slots__ = ("_replica",)

    def __init__(self, replica: RaftReplica) -> None:
        self._replica = replica

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace_back: Any
    ) -> bool:
        if isinstance(error, OSError):
            # The journal could not write (disk full, I/O error): it kept its state as it
            # was (storage/journal.py). This member is in doubt until a write works again;
            # what a peer sent meanwhile is resent (the leader's next message finds it
            # missing here).
            self._replica.journal_failed(error)
            return True
        if isinstance(error, CorruptionError):
            # An fdatasync failed: the kernel may have dropped the pages. Only a restart,
            # which reads the journal back from disk, knows what is durable.
            log.critical("raft journal failed; stopping the node", exc_info=error)
            logging.shutdown()
            os._exit(70)
        return False


def _event_mask(event: int) -> int:
    """pysyncobj's event flags of one poll() result (PollPoller.poll's translation)."""
    mask = 0
    if event & select.POLLIN:
        mask |= POLL_EVENT_TYPE.READ
    if event & select.POLLOUT:
        mask |= POLL_EVENT_TYPE.WRITE
    if event & (select.POLLERR | select.POLLHUP):
        mask |= POLL_EVENT_TYPE.ERROR
    return mask


def commit_reach(durable_index: int, match_indexes: Sequence[int]) -> int:
    """The highest index held durably by a majority of the members: the leader up to its
    `durable_index`, each follower up to its acknowledged (fdatasynced) match index."""
    held = sorted([durable_index, *match_indexes], reverse=True)
    return held[len(held) // 2]


def _send_next_node_idx(self: _SyncObj, *args: Any, **kwargs: Any) -> None:
    # A follower's "success" must mean "durable here". While entries are unsynced, the ack
    # waits (in order) for the single fdatasync right after the poll that read it (or at the
    # start of the next tick), which covers every message received in the same poll: one
    # fsync per poll, not per message.
    if self._journal.dirty or self._deferred_acks:
        self._deferred_acks.append((args, kwargs))
        return
    if kwargs.get("success") and self._replica.in_doubt():
        # A replica in doubt acknowledges nothing: the leader must not count it toward a
        # commit. Its log still takes the entries (applied once it is healthy); the leader's
        # next heartbeat after that gets a fresh, true acknowledgement. It still answers,
        # with neither success nor reset (pysyncobj's leader then only notes the answer):
        # silence made a leader whose other follower was slow step down after its
        # leaderFallbackTimeout, with no better leader to take over.
        node = args[0] if args else kwargs["node"]
        _original_send_next_node_idx(self, node, reset=False, success=False)
        return
    _original_send_next_node_idx(self, *args, **kwargs)


def _on_message_received(self: _SyncObj, node: Any, message: Any) -> Any:
    if not isinstance(message, dict):
        return _original_on_message_received(self, node, message)
    kind = message.get("type")
    if kind in (pre_vote.PRE_VOTE, pre_vote.PRE_VOTE_GRANTED):
        try:
            if kind == pre_vote.PRE_VOTE:
                self._on_pre_vote(node, message)
            else:
                self._on_pre_vote_granted(node, message)
        except (KeyError, TypeError, ValueError):
            # Only an authenticated member can send one: a malformed one is a bug there,
            # and ignoring it is what a refusal is anyway.
            log.warning("malformed %s from %s ignored", kind, node)
        return None
    if kind == "append_entries" and message.get("term", 0) >= self.raftCurrentTerm:
        self._leader_heard_at = pysyncobj_tcp_connection.monotonicTime()
    if kind == "append_entries" and "prevLogIdx" not in message:
        message = _snapshot_message_without_commit(self, message)
    if self._replica.rejoining:
        if kind == "request_vote":
            return None  # a rejoining replica may have lost its vote: it votes for nobody
        if kind == "append_entries" and message.get("term", 0) >= self.raftCurrentTerm:
            self._replica.heard_from_leader(int(message.get("commit_index", 0)))
    if (
        kind == "append_entries"
        and message.get("entries")
        and self._replica.in_doubt()
        and self._journal.bytes_total > limits.DOUBT_LOG_BYTES_MAX
    ):
        # Bounded: a replica in doubt keeps at most this much unapplied log. The leader
        # advanced its nextIndex already; once healthy, the next heartbeat finds the entries
        # missing here and the leader resends them.
        return None
    if (
        kind == "append_entries"
        and "prevLogIdx" in message
        and message.get("transmission") is None
        and message.get("term", 0) >= self.raftCurrentTerm
    ):
        plan = _append_plan(self, message)
        if plan.keep_tail:
            return _keeping_tail(self, node, plan)
        message = plan.message
    # pysyncobj sets nextIndex[follower] to the acknowledged index on every success, even
    # when it already sent entries past it (a late ack of an earlier message): its next send
    # would resend every in-flight entry, which the follower truncates, rewrites and fsyncs
    # again (59% of entries under load). A success never moves nextIndex backwards here; a
    # follower that really lacks entries answers success=False/reset=True, which still does.
    if kind == "next_node_idx" and message.get("success") and not message.get("reset"):
        tracer = trace.current()
        if tracer.on:
            tracer.follower_acked(int(message["next_node_idx"]) - 1, trace.clock())
        next_index = self._SyncObj__raftNextIndex
        before = next_index.get(node)
        result = _original_on_message_received(self, node, message)
        if before is not None and next_index.get(node, 0) < before:
            next_index[node] = before
        return result
    tracer = trace.current()
    entries = message.get("entries") if kind == "append_entries" and tracer.on else None
    if not entries:
        return _original_on_message_received(self, node, message)
    started = trace.clock()
    tracer.entries_received(int(entries[-1][1]), started)
    held = self._journal[-1][1] if len(self._journal) else 0
    result = _original_on_message_received(self, node, message)
    again = max(0, held - int(message.get("prevLogIdx", held)))
    tracer.follower_handled(len(entries), again, started, trace.clock())
    return result


def _append_plan(self: _SyncObj, message: dict[str, Any]) -> AppendPlan:
    """Raft's follower rule for this message (append_rule.py); the terms it compares are
    looked up only when the log goes past the message's prevLogIdx (a stable leader's next
    message starts at the log's end: no lookup)."""
    journal = self._journal
    held = len(journal)
    last_index = journal.index_at(held - 1) if held else 0
    prev = int(message["prevLogIdx"])
    entries = message.get("entries") or []
    if last_index <= prev:
        return AppendPlan(message, prev + len(entries), keep_tail=False)
    terms = journal.terms(prev, min(last_index - prev, len(entries)) + 1)
    return raft_append_rule(message, last_index, terms)


def _keeping_tail(self: _SyncObj, node: Any, plan: AppendPlan) -> Any:
    # The message adds nothing and the log goes on past it (a late heartbeat or resend):
    # pysyncobj would delete that tail. For this one message its __getEntries shows a log
    # that ends at the message's end, so it deletes nothing and acknowledges up to there;
    # the commit index it then sets (the leader's, up to this log's last index) is held to
    # the message's end, Raft's rule 5: the tail is not yet known to match the leader's.
    before = int(self._SyncObj__raftCommitIndex)
    self._log_view_end = plan.verified_end
    try:
        result = _original_on_message_received(self, node, plan.message)
    finally:
        self._log_view_end = None
    bound = max(before, plan.verified_end)
    if self._SyncObj__raftCommitIndex > bound:
        setattr(self, "_SyncObj__raftCommitIndex", bound)  # noqa: B010 (mypy: pysyncobj's)
        self._SyncObj__raftLog.setRaftCommitIndex(bound)
    return result


def _snapshot_message_without_commit(self: _SyncObj, message: dict[str, Any]) -> dict[str, Any]:
    # pysyncobj's follower takes `commit_index` from every append_entries, and for one that
    # carries a snapshot (or a chunk of one, or an empty "not ready yet" one: no prevLogIdx)
    # it sets its commit index to min(leader's commit, its own last index) without matching
    # its log against the leader's. A follower whose log still holds entries of an old
    # leader that never committed (a restarted node that led alone before it went down)
    # then applies them: its state diverges, and pysyncobj later truncates them ("truncating
    # already-applied log entries"). Found by `random --seed 11`: a replica served rows no
    # other replica had. A snapshot message may not advance the commit index; the snapshot
    # itself sets what it covers, and the next regular append_entries (with a log match)
    # advances the rest.
    commit_index = int(message.get("commit_index", 0))
    own = int(self._SyncObj__raftCommitIndex)
    if commit_index <= own:
        return message
    return {**message, "commit_index": own}


def _do_apply_command(self: _SyncObj, command: bytes) -> Any:
    if command[:1] != _TAG_REGULAR:
        return _original_do_apply_command(self, command)
    lsn = self.raftLastApplied + 1  # entries are applied in order, one at a time
    tracer = trace.current()
    started = trace.clock()
    try:
        result = self._replica.apply(lsn, memoryview(command)[1:])
        if tracer.on:
            tracer.applied(lsn, started, trace.clock(), leader=bool(self._isLeader()))
        return result
    except BaseException:
        # The applier never raises for anything an entry holds or the disk does (it records
        # a no-op, or stalls); an exception here is a bug. Stop rather than diverge.
        log.critical("apply failed; stopping the node lsn=%d", lsn, exc_info=True)
        logging.shutdown()
        os._exit(70)


_original_send_next_node_idx = SyncObj._SyncObj__sendNextNodeIdx
_original_on_message_received = SyncObj._SyncObj__onMessageReceived
_original_do_apply_command = SyncObj._SyncObj__doApplyCommand
_original_try_log_compaction = SyncObj._SyncObj__tryLogCompaction
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

    def __init__(self, settings: RaftSettings, hooks: ApplyHooks, role: RoleSignal) -> None:
        pysyncobj_patches.install()
        self.settings = settings
        self.hooks = hooks
        self._role = role
        directory = settings.directory
        ensure_dir(REAL_FILES, directory, root=directory)
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
            autoTickPeriod=_IDLE_TICK_S,
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
            logCompactionMinEntries=10**12,  # time- and size-driven only
            logCompactionMinTime=settings.checkpoint_interval_s,
            logCompactionSplit=False,
            logCompactionBatchSize=limits.RAFT_SNAPSHOT_CHUNK_BYTES,
            dynamicMembershipChange=False,
            onStateChanged=self._on_state_changed,
            maxBindRetries=30,
            bindRetryTime=0.5,
        )
        # Until the checkpoint is loaded, the journal's entries are history the checkpoint
        # already holds: pysyncobj offers them before it loads the file; they wait.
        self._checkpoint_pending_load = checkpoint_path.exists()
        # Rejoining (identity.py): the commit index of the first leader heard, once known.
        self._rejoin_marker = directory / REJOIN_MARKER
        self.rejoining = self._rejoin_marker.exists()
        self._rejoin_target: int | None = None
        self._journal_trouble_until = 0.0
        self._snapshot_lsn: int | None = None  # of the checkpoint being written
        if self.rejoining:
            log.warning("raft group %d rejoins: no vote until caught up", settings.group_id)
        self._applied_at_start: int | None = None
        # Observability (read by the metrics exporter; written under the tick lock).
        self.fsync_latency = LatencyHistogram(FSYNC_BUCKETS_S)
        self.checkpoint_latency = LatencyHistogram(CHECKPOINT_BUCKETS_S)
        self.checkpoint_bytes_last = 0
        self.leader_changes = 0
        self.slow_ticks = 0  # ticks that held the tick thread for half an election timeout
        self._last_leader: str | None = None
        self._last_leader_node: object | None = None
        # Built before the SyncObj, whose tick thread drives it at once: it reads
        # self._sync_obj only while a transfer is under way, and only a request starts one.
        self._transfer = LeadershipTransfer(
            self,
            group_id=settings.group_id,
            self_address=settings.self_address,
            peer_addresses=settings.peer_addresses,
        )
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

    def in_doubt(self) -> bool:
        """Not to lead, stand, or acknowledge: the applier's state is in doubt, this member
        is rejoining with a log it rebuilds from the leader, or its journal failed a write
        lately."""
        if self._journal_trouble_until > pysyncobj_tcp_connection.monotonicTime():
            return True
        return self.rejoining or self.hooks.in_doubt()

    def journal_failed(self, error: OSError) -> None:
        now = pysyncobj_tcp_connection.monotonicTime()
        if self._journal_trouble_until <= now:
            log.error("raft journal write failed group=%d: %s", self.settings.group_id, error)
        self._journal_trouble_until = now + _JOURNAL_TROUBLE_S

    def heard_from_leader(self, commit_index: int) -> None:
        if self._rejoin_target is None:
            self._rejoin_target = commit_index
            log.info(
                "rejoining group=%d: catching up to the leader's commit index %d",
                self.settings.group_id,
                commit_index,
            )

    def check_rejoined(self) -> None:
        """A rejoining member holds everything the leader had committed when it first heard
        from it (so every entry it may have acknowledged before it lost its log): it votes
        and acknowledges again. The marker goes durably."""
        target = self._rejoin_target
        if not self.rejoining or target is None or self.hooks.in_doubt():
            return
        if self.last_applied < target or self._checkpoint_pending_load:
            return
        self._rejoin_marker.unlink()
        checkpoint.fsync_dir(self._rejoin_marker.parent)
        self.rejoining = False
        log.warning(
            "rejoined group=%d at lsn=%d: a voting member again",
            self.settings.group_id,
            self.last_applied,
        )

    def apply(self, lsn: int, command: memoryview) -> Any:
        if self._checkpoint_pending_load:
            return STALLED
        return self.hooks.apply(lsn, command)

    def _on_state_changed(self, old: int, new: int) -> None:
        if (old == _STATE_LEADER) != (new == _STATE_LEADER):
            log.info("role change group=%d leader=%s", self.settings.group_id, new == _STATE_LEADER)
            self._role.set(new == _STATE_LEADER)

    def checkpoint_durable(self) -> None:
        if self._snapshot_lsn is not None:
            self.hooks.checkpoint_written(self._snapshot_lsn)
            self._snapshot_lsn = None

    def _serialize(self, file_name: str, data: tuple[Entry, Entry, Any]) -> None:
        started = time.monotonic()
        last, previous, _cluster = data
        snapshot = self.hooks.checkpoint()
        self._snapshot_lsn = snapshot.lsn
        image = RaftCheckpoint(
            lsn=snapshot.lsn, state=snapshot.state, last=_entry(last), previous=_entry(previous)
        )
        self.checkpoint_bytes_last = raft_checkpoint.write(Path(file_name), image)
        self.checkpoint_latency.observe(time.monotonic() - started)

    def _deserialize(self, file_name: str) -> tuple[Entry, Entry, list[Any]]:
        try:
            image = raft_checkpoint.read(Path(file_name))
            self.hooks.restore(Snapshot(image.lsn, image.state))
            last, previous = raft_checkpoint.trim_journal_to(
                self._sync_obj._journal, image.last, image.previous
            )
        except BaseException:
            # pysyncobj would log this and boot with an empty state. Refuse to start.
            log.critical("cannot load checkpoint %s; stopping", file_name, exc_info=True)
            logging.shutdown()
            os._exit(71)
        self._checkpoint_pending_load = False
        return last, previous, []

    # --- API for the group (any thread) ---

    def propose(self, command: CommandBytes, callback: ProposalCallback) -> None:
        """Queue `command` for replication. `callback(result, error)` runs on the tick thread
        once the entry is applied here (result) or failed (error); it must not block."""

        def done(result: Any, reason: int) -> None:
            if reason == FAIL_REASON.SUCCESS:
                callback(result, None)
            else:
                callback(None, _failure(reason))

        tagged = join_command(command, _TAG_REGULAR)
        tracer = trace.current()
        if tracer.on:
            tracer.proposed(tagged)
        if not self._transfer.admit(lambda: self._sync_obj._applyCommand(tagged, done)):
            callback(None, LeadershipLost("leadership is being transferred"))

    def is_leader(self) -> bool:
        return bool(self._sync_obj._isLeader())

    def is_leader_ready(self) -> bool:
        """Leader, and its first entry of this term (the no-op) is applied: its state
        machine has everything committed before it took over."""
        noop_idx = self._sync_obj._SyncObj__noopIDx
        return self.is_leader() and noop_idx is not None and self.last_applied >= noop_idx

    def replayed(self) -> bool:
        """Every entry this member knew as committed when it started is applied (and the
        checkpoint is loaded): what NODE READY waits for."""
        if self._checkpoint_pending_load:
            return False
        if self._applied_at_start is None:
            self._applied_at_start = self._sync_obj._journal.commit_index
        return self.last_applied >= min(self._applied_at_start, self.commit_index)

    def leader_address(self) -> str | None:
        leader = self._sync_obj._getLeader()
        return None if leader is None else str(leader.address)

    # --- leadership transfer (transfer.py) ---

    def transfer_leadership(self, target: str | None, timeout_s: float) -> str:
        return self._transfer.request(target, timeout_s)

    def transfer_target(self) -> str | None:
        return self._transfer.target()

    def await_transfer(self, timeout_s: float) -> None:
        self._transfer.wait(timeout_s)

    def drive_transfer(self) -> None:
        self._transfer.drive()

    def caught_up_follower(self, requested: str | None) -> tuple[str, object] | None:
        """A connected follower (`requested`, or any) whose log holds every entry, once
        everything this leader accepted is in its log and applied; else None."""
        sync_obj = self._sync_obj
        if sync_obj._SyncObj__commandsQueue._FastQueue__queue:
            return None  # proposals accepted before the transfer are not in the log yet
        last_index = sync_obj._SyncObj__getCurrentLogIndex()
        if sync_obj.raftLastApplied < last_index:
            return None  # answer them first: committed and applied here
        match_index = sync_obj._SyncObj__raftMatchIndex
        connected = sync_obj._SyncObj__connectedNodes
        ready = sorted(
            (str(node.address), node)
            for node in sync_obj._SyncObj__otherNodes
            if node in connected
            and match_index.get(node, 0) >= last_index
            and (requested is None or str(node.address) == requested)
        )
        return ready[0] if ready else None

    def send_timeout_now(self, follower: object) -> None:
        self._sync_obj.transferLeadership(follower)

    def observe_leader(self) -> None:
        """Tick thread: count changes of the leader this member knows (leader_changes)."""
        leader = self._sync_obj._SyncObj__raftLeader
        if leader is self._last_leader_node:
            return  # every tick: no string made while the leader stays
        self._last_leader_node = leader
        address = None if leader is None else str(leader.address)
        if address != self._last_leader:
            self._last_leader = address
            if address is not None:
                self.leader_changes += 1

    @property
    def group_id(self) -> int:
        return self.settings.group_id

    def last_log_index(self) -> int:
        """The index of the last entry in the log (any thread; 0 while it is empty)."""
        try:
            return int(self._sync_obj._SyncObj__getCurrentLogIndex())
        except IndexError:
            return 0

    def latencies(self) -> dict[str, HistogramSnapshot]:
        """fdatasync of the journal, and checkpoint writing (metrics.py)."""
        return {
            "fsync": self.fsync_latency.snapshot(),
            "checkpoint": self.checkpoint_latency.snapshot(),
        }

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
            "last_log_index": self.last_log_index(),
            "leader_changes": self.leader_changes,
            "slow_ticks": self.slow_ticks,
            "pre_votes": self._sync_obj._pre_vote.rounds_total,
            "transfer_target": self.transfer_target(),
            "checkpoint_bytes_last": self.checkpoint_bytes_last,
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

    def connection_host(self) -> ConnectionHost | None:
        return self._sync_obj

    def request_checkpoint(self) -> None:
        self._sync_obj.forceLogCompaction()

    def close(self) -> None:
        self._sync_obj.destroy_synchronous()


def _entry(raw: Any) -> Entry:
    command, idx, term = raw
    return bytes(command), int(idx), int(term)
