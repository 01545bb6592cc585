"""Every bound of the node, with asserts on how they relate.

A full queue rejects new work; it never grows. Exceeding a bound raises an error with
fields (`BatchTooLarge(size, size_max)`), never a silent truncation.
"""

from typing import Final

# The bounds of the wire contract, which the client checks too, are defined once in
# hastream/wire.py; re-exported here beside the server-only bounds.
from hastream.wire import ACTION_NAME_BYTES_MAX as ACTION_NAME_BYTES_MAX
from hastream.wire import BATCH_BYTES_MAX as BATCH_BYTES_MAX
from hastream.wire import BATCH_ROWS_MAX as BATCH_ROWS_MAX
from hastream.wire import COLUMNS_MAX as COLUMNS_MAX
from hastream.wire import GRPC_MESSAGE_BYTES_MAX as GRPC_MESSAGE_BYTES_MAX
from hastream.wire import MIB as MIB
from hastream.wire import NODE_CALLS_MAX as NODE_CALLS_MAX
from hastream.wire import PIPELINE_BATCH_REQUESTS_MAX as PIPELINE_BATCH_REQUESTS_MAX
from hastream.wire import PIPELINE_IN_FLIGHT_BYTES_MAX as PIPELINE_IN_FLIGHT_BYTES_MAX
from hastream.wire import PIPELINE_IN_FLIGHT_MAX as PIPELINE_IN_FLIGHT_MAX
from hastream.wire import PRODUCER_ID_BYTES as PRODUCER_ID_BYTES
from hastream.wire import PROPOSAL_TIMEOUT_S as PROPOSAL_TIMEOUT_S
from hastream.wire import SUBSCRIBE_BATCH_BYTES_MAX as SUBSCRIBE_BATCH_BYTES_MAX
from hastream.wire import SUBSCRIBE_BATCH_ROWS_MAX as SUBSCRIBE_BATCH_ROWS_MAX
from hastream.wire import SUBSCRIBE_HEARTBEAT_S as SUBSCRIBE_HEARTBEAT_S
from hastream.wire import TABLE_NAME_BYTES_MAX as TABLE_NAME_BYTES_MAX
from hastream.wire import TABLE_NAME_PATTERN as TABLE_NAME_PATTERN
from hastream.wire import TRANSFER_TIMEOUT_S_DEFAULT as TRANSFER_TIMEOUT_S_DEFAULT
from hastream.wire import TRANSFER_TIMEOUT_S_MAX as TRANSFER_TIMEOUT_S_MAX

# One Raft entry: group commit packs several publishes into one entry up to this size.
ENTRY_BYTES_MAX: Final = 24 * MIB
ENTRY_ITEMS_MAX: Final = 4096

# pysyncobj settings that must exceed the largest entry (its chunked send is broken for
# entries >= appendEntriesBatchSizeBytes, as measured on 0.3.17).
RAFT_APPEND_BATCH_BYTES: Final = 4 * ENTRY_BYTES_MAX
RAFT_SOCKET_BUFFER_BYTES: Final = 4 * MIB
# The longest Raft frame a node reads (pysyncobj's append batch may pass its size by one
# entry; plus pickling and encryption): a longer declared length drops the link before
# its bytes are buffered, and a link holding more than two such frames unparsed is dropped.
RAFT_FRAME_BYTES_MAX: Final = RAFT_APPEND_BATCH_BYTES + ENTRY_BYTES_MAX + MIB
# Commands of at least this many bytes travel outside their pickled append_entries message,
# each sealed (encrypted) once and the same ciphertext sent on every link within one tick
# (pysyncobj_patches.AesGcmEncryptor.seal_piece): pickling and sealing a message per follower
# copied every entry twice per link.
RAFT_SHARED_PIECE_BYTES_MIN: Final = 64 * 1024
# Sealed pieces held for the other links until the tick ends: at most one append batch's.
RAFT_SHARED_PIECES_BYTES_MAX: Final = RAFT_APPEND_BATCH_BYTES + ENTRY_BYTES_MAX
# A Raft link keeps its receive buffer between frames (peer_frames.Inbox: no fresh buffer
# per message); one grown past this for a long frame is let go once the frame is parsed.
RAFT_INBOX_KEEP_BYTES: Final = ENTRY_BYTES_MAX + 8 * MIB
# Accepted Raft links that have not proven the cluster key yet: at most this many at once,
# each closed after this long (a peer's handshake takes milliseconds).
RAFT_UNAUTHENTICATED_MAX: Final = 64
RAFT_HANDSHAKE_S: Final = 5.0
# Snapshot (checkpoint manifest) transfer chunk to a lagging follower.
RAFT_SNAPSHOT_CHUNK_BYTES: Final = 1 * MIB

# Publishes waiting for group commit per Raft group; beyond it: Overloaded.
PUBLISH_QUEUE_MAX: Final = 10_000
# ... and at most this many payload bytes (a queue of 10,000 16 MiB batches would not fit).
PUBLISH_QUEUE_BYTES_MAX: Final = 512 * MIB
# Bytes the row caches of all tables on a node hold together (cache_budget.py): past it the
# batches cached longest ago are dropped, whatever their table (reads come from the files).
# A cached batch views its Raft entry's bytes, so this also bounds how many whole entries the
# caches keep alive: at 256 MiB the 211-column 4 x 10,000-row grid cell peaked at 478-612 MiB
# of node RSS, at 64 MiB at 393-455 with rows/s alike (docs/benchmark.md, 38th session). A
# tailing subscriber reads the newest batches, the last to go.
CACHE_BYTES_MAX: Final = 64 * MIB
# Raft entries proposed but not yet applied, per group (the proposer waits beyond it).
PROPOSALS_IN_FLIGHT_MAX: Final = 8
# Unsent bytes queued for one Raft peer beyond which its link is dropped (and later
# reconnected; the leader then resends from the follower's log end): pysyncobj's send buffer
# is otherwise unbounded while a peer does not read. A healthy follower lags by at most the
# entries in flight.
RAFT_SEND_BUFFER_BYTES_MAX: Final = (
    PROPOSALS_IN_FLIGHT_MAX * ENTRY_BYTES_MAX + RAFT_SOCKET_BUFFER_BYTES
)
# pysyncobj's own command queue, per group.
RAFT_COMMAND_QUEUE_MAX: Final = 1_000

# malloc arenas of a node process (allocator.py): each keeps its own peak of freed memory.
MALLOC_ARENAS_MAX: Final = 2
# How often a node hands the free pages of its malloc arenas back to the system
# (allocator.trim_until): freed multi-MiB buffers otherwise stay resident. Every second
# cost 15% more node CPU per row at 211 columns (pages faulted in again), every 5 s none.
MALLOC_TRIM_INTERVAL_S: Final = 5.0

# Data files.
SEGMENT_BYTES_MAX: Final = 64 * MIB
RECORD_BYTES_MAX: Final = ENTRY_BYTES_MAX
# A table's appends start the disk's writeback of its data file every this many bytes
# (sync_file_range; RocksDB's bytes_per_sync), so a checkpoint's fsync does not find up to
# RAFT_LOG_BYTES_MAX of dirty pages per node all at once.
DATA_WRITEBACK_BYTES: Final = 4 * MIB
# A journal lets the page cache forget what its fdatasyncs made durable once this much has
# gathered (storage/files.py Files.drop_cached: the next writes reuse those pages).
JOURNAL_DROP_BEHIND_BYTES: Final = 1 * MIB
# The online scrub's share of one core (scrub.py): it waits between records to stay under
# it, whatever its byte rate (streamingScrubRate) would allow.
SCRUB_CPU_SHARE_MAX: Final = 0.02
# Data files waiting for the writeback thread to start their writeback; beyond it a request
# is dropped (the checkpoint's fsync does that file's work).
WRITEBACK_QUEUE_MAX: Final = 256
# Data files held open at once by one process, across every table (storage/files.py
# OpenFiles): beyond it the least recently used is closed, and reopened when next needed. It
# is also at most 1/DATA_FILES_FD_LIMIT_DIVISOR of the soft fd limit, so that sockets,
# journals and gRPC keep the rest: ~1,000 tables would otherwise exhaust the usual 1,024.
DATA_FILES_OPEN_MAX: Final = 4096
DATA_FILES_FD_LIMIT_DIVISOR: Final = 4
DATA_FILES_OPEN_MIN: Final = 16
# The soft fd limit the node asks for at start when the hard limit is unlimited.
FD_SOFT_LIMIT_IF_UNLIMITED: Final = 1_048_576

# Dedup: a keyed table drops a row whose key is among the keys of its last
# DEDUP_WINDOW_ROWS rows. Producer (idempotency token) windows: the newest
# PRODUCERS_MAX producers per group are remembered.
DEDUP_WINDOW_ROWS: Final = 1_000_000
PRODUCERS_MAX: Final = 10_000

# The leader's payload checks kept for apply (check_memo.py): payloads up to this size,
# this many, these many bytes per group at most. A kept 1,000-row publish of 11 columns
# (64 KiB) counts ~130 KB (its copy and the batch viewing it, counted apart): 8 MiB keeps
# the checks of 60 of them until their apply. (A pipelining client joins such publishes
# into requests of MiBs, which are not kept: the memo is for waited publishes.)
CHECK_MEMO_PAYLOAD_BYTES_MAX: Final = 128 * 1024
CHECK_MEMO_ENTRIES_MAX: Final = 1024
CHECK_MEMO_BYTES_MAX: Final = 8 * MIB

# Tables per node (all groups): creating one more answers TooManyTables before proposing.
TABLES_PER_NODE_MAX: Final = 4096

# Repair: a repair that has not fetched every missing row by then is shown as failed (and
# keeps trying). While a replica is in doubt, its Raft log keeps the entries it cannot apply
# yet; past this many bytes it stops taking new ones (the leader resends them later).
REPAIR_DEADLINE_S: Final = 600.0
DOUBT_LOG_BYTES_MAX: Final = 512 * MIB
# A repair's fetch from one peer that has waited this long for the peer's next message (or
# its first, connecting included) is given up, and the next peer is asked. A replica acks
# nothing while it repairs, so a peer that stopped answering (SIGSTOP, a hung host) held the
# group's commits: a freshly dialled one for gRPC's 20 s connect timeout, one already
# connected for the fetch's whole deadline (600 s). A peer reads and sends a 1 MiB batch in
# milliseconds; 10 s leaves a loaded one room.
PEER_FETCH_IDLE_S: Final = 10.0
# FetchRecordBatches (repair and catch-up from a peer) packs consecutive data-file records
# into one gRPC message while their encoded bytes stay within this (a larger record goes
# alone): a gRPC message costs CPU on both sides whatever it holds, so FetchRecords' one
# message per record made fetching one-row records cost ~80 us of the peer's and ~60 us of
# the fetcher's CPU per record (bench/fetch_records.py). A 1 MiB message holds about 3,000
# one-row records of 3 columns, so its own cost is well under 1% of theirs (~9 us a record
# to read and send, ~2 us to take in): larger messages would save nothing measurable, and a
# fetch stream holds about one message on each side (beside HTTP/2's windows), a twentieth
# of GRPC_MESSAGE_BYTES_MAX.
FETCH_BATCH_BYTES_MAX: Final = 1 * MIB
# An apply stalled by an environment error is retried after a backoff growing to this.
APPLY_RETRY_MAX_S: Final = 5.0
# Tables moved aside as damaged, kept per group for an operator to look at (oldest deleted).
QUARANTINED_TABLES_MAX: Final = 8

# Replica digests compare at most this many of a table's newest rows, in at most this many
# of the leader's records (0.75 s of CPU per replica for one-row records on a 2-core VM).
DIGEST_ROWS_MAX: Final = 1_000_000
DIGEST_RECORDS_MAX: Final = 100_000

# Raft log bytes between checkpoints before a checkpoint is forced early (disk, and the
# replay after a restart).
RAFT_LOG_BYTES_MAX: Final = 256 * MIB
# ... of which at most this many command bytes are held in memory, the newest (older ones
# are read back from the journal file when a lagging follower or a replay asks for them).
# A follower applies behind what it receives: at 48 MiB, pipelined 10,000-row publishing
# had followers read back about half of their entries for the apply; at 96 MiB none.
RAFT_LOG_RESIDENT_BYTES: Final = 4 * ENTRY_BYTES_MAX
# The Raft log is kept in segment files of about this size (storage/journal.py): after a
# checkpoint the segments wholly before the log's new start are removed, nothing is copied.
RAFT_JOURNAL_SEGMENT_BYTES: Final = 64 * MIB
# The newest segment is grown by this much of allocated zeros ahead of its records, which are
# then written in place: an fdatasync that need not commit a new file size took 20-35% less
# time and CPU with three nodes syncing on one disk (docs/benchmark.md). At most this much
# disk per group journal beyond its records.
RAFT_JOURNAL_EXTEND_BYTES: Final = MIB
# Segments a checkpoint freed are kept, up to this many per group journal, and reused for
# the next ones (renamed; their blocks written already): a record then lands on written
# blocks, with neither the zeros' write nor fallocate's unwritten extents to convert at
# its fdatasync (storage/journal.py). So a busy group's journal keeps the disk its log
# held between two checkpoints at most (RAFT_LOG_BYTES_MAX), as PostgreSQL keeps its WAL
# segments up to max_wal_size.
RAFT_JOURNAL_SPARES_MAX: Final = RAFT_LOG_BYTES_MAX // RAFT_JOURNAL_SEGMENT_BYTES
# ... and only while the journal's file system has room for this many segments free besides
# the spare: on a disk that is filling up, the space goes back to the data files (and to the
# journal's own new segments) instead. A journal holding spares looks at the room left once
# a second and gives them all up below it, and at once when a write finds the disk full.
RAFT_JOURNAL_SPARES_FREE_SEGMENTS: Final = 16
RAFT_JOURNAL_SPARES_FREE_BYTES_MIN: Final = (
    RAFT_JOURNAL_SPARES_FREE_SEGMENTS * RAFT_JOURNAL_SEGMENT_BYTES
)

assert ENTRY_BYTES_MAX >= BATCH_BYTES_MAX + MIB, "one batch plus framing must fit an entry"
assert BATCH_BYTES_MAX < 2**32, "a seal (checked_payload.py) holds payload offsets as u32"
assert BATCH_ROWS_MAX < 2**32, "a seal holds the row count as u32"
assert RAFT_APPEND_BATCH_BYTES >= 2 * ENTRY_BYTES_MAX, "avoid pysyncobj's chunked-send bug"
assert RAFT_LOG_BYTES_MAX > 4 * ENTRY_BYTES_MAX
assert RAFT_LOG_RESIDENT_BYTES >= 2 * ENTRY_BYTES_MAX, "the last two entries stay in memory"
assert DOUBT_LOG_BYTES_MAX > RAFT_LOG_BYTES_MAX, "a replica in doubt keeps more than a healthy"
assert DATA_FILES_OPEN_MIN <= DATA_FILES_OPEN_MAX
assert DATA_FILES_OPEN_MAX * DATA_FILES_FD_LIMIT_DIVISOR <= FD_SOFT_LIMIT_IF_UNLIMITED
assert PIPELINE_IN_FLIGHT_MAX <= PUBLISH_QUEUE_MAX, "one stream alone cannot overload a group"
assert FETCH_BATCH_BYTES_MAX <= GRPC_MESSAGE_BYTES_MAX // 8, "well under a message's limit"

# A node asked to stop hands each group it leads to a follower first, for at most this long
# in all (the transfers run in parallel); then it stops anyway (an election follows).
SHUTDOWN_TRANSFER_TIMEOUT_S: Final = 3.0
# A group's preferred leader asks for leadership back once it has been healthy and caught
# up for this long (and then at most this often), so a restarting node is not handed a
# group while it still replays its log.
PREFERRED_LEADER_SETTLE_S: Final = 5.0
assert SHUTDOWN_TRANSFER_TIMEOUT_S <= TRANSFER_TIMEOUT_S_MAX
# A request that reaches a leader handing over, or a new leader that has not applied its
# first entry yet, waits at most this long before it is refused (NotLeader with the new
# leader, NodeUnavailable): a client's retry round costs more than the wait.
LEADER_WAIT_S: Final = 1.0
# One Raft tick applies committed entries for at most this long, and at most this many: the
# same thread sends the heartbeats (replication.py _SyncObj__applyLogEntries).
APPLY_SLICE_S: Final = 0.1
APPLY_ENTRIES_MAX: Final = 4096
# ... read from the journal this many command bytes at a time (entries older than it holds in
# memory are read back from its file): a slice applies what it reads, not a whole backlog.
APPLY_READ_BYTES_MAX: Final = 8 * MIB
assert PUBLISH_QUEUE_BYTES_MAX >= 4 * PIPELINE_IN_FLIGHT_BYTES_MAX, "a few streams fit"

# Peer-only RPCs carry a signature whose time must be within this of the receiver's clock;
# the receiver remembers each nonce for twice as long (replays are refused), at most
# PEER_NONCES_MAX at once (more live nonces: Overloaded, retried).
PEER_CLOCK_SKEW_S: Final = 60.0
PEER_NONCES_MAX: Final = 65_536

# Long-lived streams (subscriptions, reads, publish streams, repair fetches) per node and
# per client connection (admission.py); the gRPC workers beyond STREAMS_MAX serve unary
# calls only, so held streams never starve publishes.
STREAMS_MAX: Final = 256
# Persisted consumer offsets (topics) per group: each lives in every checkpoint.
TOPICS_PER_GROUP_MAX: Final = 10_000
STREAMS_PER_CONNECTION_MAX: Final = 100
# Connections to a node's publish port (publish_port.py), one thread each, each holding at
# most one frame (hastream.publish_frames.FRAME_BYTES_MAX, ~4 MiB) in memory.
PUBLISH_PORT_CONNECTIONS_MAX: Final = 64
UNARY_WORKERS: Final = 60
assert STREAMS_PER_CONNECTION_MAX <= STREAMS_MAX
# gRPC refuses calls past NODE_CALLS_MAX (Overloaded at the client): all the stream slots
# and the unary workers but four, so a refusal comes before every worker is taken.
assert NODE_CALLS_MAX == STREAMS_MAX + UNARY_WORKERS - 4

# Access control (access.py, auth.py): users and their rules live in the catalog group's
# state and checkpoint, so both are bounded; a login costs one scrypt (~50 ms of a core),
# so only a few run at once (Overloaded beyond).
USER_NAME_CHARS_MAX: Final = 64
USERS_MAX: Final = 1_000
RULES_PER_USER_MAX: Final = 1_000
LOGINS_CONCURRENT_MAX: Final = 2
TOKEN_TTL_S: Final = 12 * 3600
TOKEN_CHARS_MAX: Final = 256

# A subscription whose current message has waited this long for the subscriber to take it
# is ended (RESOURCE_EXHAUSTED "slow consumer"); cluster.cfg streamingSlowConsumerTimeout.
SLOW_CONSUMER_S: Final = 30.0

# A Raft listener that pysyncobj closed (an accept failed: EMFILE) is bound again this often
# until it works (pysyncobj_patches._rebind_if_closed).
RAFT_REBIND_S: Final = 0.5

# pysyncobj's connection upkeep (bind, reconnect, stale handshakes) runs on at most one Raft
# tick per this interval, not on every tick (pysyncobj_patches._transport_tick).
RAFT_TRANSPORT_TICK_S: Final = 0.005
