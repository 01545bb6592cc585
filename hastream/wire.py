"""The bounds of the wire contract between the client and the nodes, each defined once.

Both sides import these: the nodes refuse what exceeds them (`raftstore/limits.py`
re-exports them beside the server-only bounds), and the client checks them before it sends
anything, raising the same typed errors (`BatchTooLarge`, `InvalidArgument`), so a mistake
is named locally instead of by a round trip.
"""

from __future__ import annotations

from typing import Final

MIB: Final = 1024 * 1024

# One publish request: the Arrow IPC payload of one batch.
BATCH_BYTES_MAX: Final = 16 * MIB
BATCH_ROWS_MAX: Final = 1_000_000

# The idempotency token of a publish: a producer id of exactly this many bytes (or none)
# and a sequence that grows by one per request.
PRODUCER_ID_BYTES: Final = 16

# gRPC messages must carry the largest batch plus framing (both sides set their channels'
# send and receive limits to this).
GRPC_MESSAGE_BYTES_MAX: Final = BATCH_BYTES_MAX + 4 * MIB

# How long a node waits for a write to commit before it answers ProposalTimeout; a client
# attempt must wait longer than this.
PROPOSAL_TIMEOUT_S: Final = 10.0

# TransferLeadership: how long the leader tries to hand a group over when the request does
# not say (the target must catch up, then win its election), and the most a request may ask.
TRANSFER_TIMEOUT_S_DEFAULT: Final = 5.0
TRANSFER_TIMEOUT_S_MAX: Final = 60.0

# PublishStream: requests read from one stream and not yet answered. When it is full the
# server stops reading the stream (HTTP/2 flow control then holds the client back).
PIPELINE_IN_FLIGHT_MAX: Final = 256
# PublishStream: requests in one PublishBatch message (so at most PIPELINE_IN_FLIGHT_MAX +
# PIPELINE_BATCH_REQUESTS_MAX - 1 are read and unanswered per stream).
PIPELINE_BATCH_REQUESTS_MAX: Final = 256
# PublishStream: payload bytes read from one stream and not yet answered; reading also stops
# at this bound (so a stream holds at most this plus one message, GRPC_MESSAGE_BYTES_MAX).
PIPELINE_IN_FLIGHT_BYTES_MAX: Final = 64 * MIB

# The calls a node's gRPC server runs at once (its maximum_concurrent_rpcs): every stream
# slot (STREAMS_MAX in raftstore's limits) and the unary workers, less a few workers kept
# free. gRPC itself refuses a call past it, before any handler runs, with RESOURCE_EXHAUSTED
# and these details; the client turns that into a retryable Overloaded.
NODE_CALLS_MAX: Final = 312
NODE_CALLS_REFUSED_DETAILS: Final = "Concurrent RPC limit exceeded!"

# Names.
TABLE_NAME_BYTES_MAX: Final = 128
# A table name: a letter, then letters, digits and underscores (at most TABLE_NAME_BYTES_MAX).
TABLE_NAME_PATTERN: Final = r"[A-Za-z][A-Za-z0-9_]*"
ACTION_NAME_BYTES_MAX: Final = 128
COLUMNS_MAX: Final = 4096

# Subscriptions and reads: rows and bytes of one RowBatch message.
SUBSCRIBE_BATCH_ROWS_MAX: Final = 65_536
SUBSCRIBE_BATCH_BYTES_MAX: Final = 8 * MIB
# An idle subscription stream gets an empty RowBatch this often, so its subscriber can tell a
# quiet table from a frozen or cut-off leader in seconds (api_clients STREAM_IDLE_TIMEOUT_S).
SUBSCRIBE_HEARTBEAT_S: Final = 1.0

assert GRPC_MESSAGE_BYTES_MAX > BATCH_BYTES_MAX
assert SUBSCRIBE_BATCH_BYTES_MAX < GRPC_MESSAGE_BYTES_MAX
assert PIPELINE_IN_FLIGHT_BYTES_MAX >= 2 * BATCH_BYTES_MAX, "a stream of big batches pipelines"

# The status details a node ends a slow consumer's subscription with begin with this
# (RESOURCE_EXHAUSTED); the client turns it into a retryable SlowConsumer.
SLOW_CONSUMER_DETAILS_PREFIX: Final = "slow consumer:"
