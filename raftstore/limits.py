"""Every bound in one place, with asserts on how they relate.

A full queue rejects new work; it never grows. Exceeding a bound raises an error with
fields (`BatchTooLarge(size, size_max)`), never a silent truncation.
"""

from typing import Final

MIB: Final = 1024 * 1024

# One publish request: the Arrow IPC payload of one batch.
BATCH_BYTES_MAX: Final = 16 * MIB
BATCH_ROWS_MAX: Final = 1_000_000

# One Raft entry: group commit packs several publishes into one entry up to this size.
ENTRY_BYTES_MAX: Final = 24 * MIB
ENTRY_ITEMS_MAX: Final = 4096

# pysyncobj settings that must exceed the largest entry (its chunked send is broken for
# entries >= appendEntriesBatchSizeBytes; see PYSYNCOBJ-FACTS 3).
RAFT_APPEND_BATCH_BYTES: Final = 4 * ENTRY_BYTES_MAX
RAFT_SOCKET_BUFFER_BYTES: Final = 4 * MIB
# Snapshot (checkpoint manifest) transfer chunk to a lagging follower.
RAFT_SNAPSHOT_CHUNK_BYTES: Final = 1 * MIB

# Publishes waiting for group commit per Raft group; beyond it: Overloaded.
PUBLISH_QUEUE_MAX: Final = 10_000
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

# PublishStream: requests read from one stream and not yet answered. When it is full the
# server stops reading the stream (HTTP/2 flow control then holds the client back).
PIPELINE_IN_FLIGHT_MAX: Final = 256
# PublishStream: requests in one PublishBatch message (so at most PIPELINE_IN_FLIGHT_MAX +
# PIPELINE_BATCH_REQUESTS_MAX - 1 are read and unanswered per stream).
PIPELINE_BATCH_REQUESTS_MAX: Final = 256
# PublishStream: payload bytes read from one stream and not yet answered; reading also stops
# at this bound (so a stream holds at most this plus one message, GRPC_MESSAGE_BYTES_MAX).
PIPELINE_IN_FLIGHT_BYTES_MAX: Final = 64 * MIB

# How long a write waits for commit before it answers ProposalTimeout.
PROPOSAL_TIMEOUT_S: Final = 10.0

# Names.
TABLE_NAME_BYTES_MAX: Final = 128
ACTION_NAME_BYTES_MAX: Final = 128
COLUMNS_MAX: Final = 4096

# Data files.
SEGMENT_BYTES_MAX: Final = 64 * MIB
RECORD_BYTES_MAX: Final = ENTRY_BYTES_MAX

# Dedup: a keyed table drops a row whose key is among the keys of its last
# DEDUP_WINDOW_ROWS rows. Producer (idempotency token) windows: the newest
# PRODUCERS_MAX producers per group are remembered.
DEDUP_WINDOW_ROWS: Final = 1_000_000
PRODUCERS_MAX: Final = 10_000

# Subscriptions.
SUBSCRIBE_BATCH_ROWS_MAX: Final = 65_536
SUBSCRIBE_BATCH_BYTES_MAX: Final = 8 * MIB
# An idle subscription stream gets an empty RowBatch this often, so its subscriber can tell a
# quiet table from a frozen or cut-off leader in seconds (api_clients STREAM_IDLE_TIMEOUT_S).
SUBSCRIBE_HEARTBEAT_S: Final = 1.0
SUBSCRIPTIONS_MAX: Final = 1_000

# gRPC messages must carry the largest batch plus framing.
GRPC_MESSAGE_BYTES_MAX: Final = BATCH_BYTES_MAX + 4 * MIB

# Raft log bytes held between checkpoints before a checkpoint is forced early (pysyncobj
# keeps the whole log in RAM until compaction).
RAFT_LOG_BYTES_MAX: Final = 256 * MIB

assert ENTRY_BYTES_MAX >= BATCH_BYTES_MAX + MIB, "one batch plus framing must fit an entry"
assert RAFT_APPEND_BATCH_BYTES >= 2 * ENTRY_BYTES_MAX, "avoid pysyncobj's chunked-send bug"
assert GRPC_MESSAGE_BYTES_MAX > BATCH_BYTES_MAX
assert SUBSCRIBE_BATCH_BYTES_MAX < GRPC_MESSAGE_BYTES_MAX
assert RAFT_LOG_BYTES_MAX > 4 * ENTRY_BYTES_MAX
assert PIPELINE_IN_FLIGHT_MAX <= PUBLISH_QUEUE_MAX, "one stream alone cannot overload a group"
assert PIPELINE_IN_FLIGHT_BYTES_MAX >= 2 * BATCH_BYTES_MAX, "a stream of big batches pipelines"
