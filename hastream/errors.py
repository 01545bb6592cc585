"""The exception hierarchy: operating errors as classes with fields.

Programmer errors are `assert`s and crash the process; everything here is an expected
failure that callers handle. The same classes are rebuilt on the client side from the
gRPC trailing metadata (see `to_wire` / `from_wire`), so a client catches `NotLeader`
and reads `.leader` exactly as the server raised it.

Part of the `hastream` package the nodes and the client share, so it stays stdlib only.
The client adds its own transport errors (`api_clients/transport.py`) on the same base.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Final

WIRE_TYPE_KEY: Final = "hastream-error"
WIRE_FIELDS_KEY: Final = "hastream-error-fields"


class RaftStoreError(Exception):
    """Base of every operating error. `fields` is what travels on the wire."""

    # Name of the grpc.StatusCode member the service answers with.
    grpc_code: ClassVar[str] = "INTERNAL"
    # Whether a client may retry the same request on another site.
    retryable: ClassVar[bool] = False

    def fields(self) -> dict[str, Any]:
        return {}


class NotLeader(RaftStoreError):
    """This node does not lead the table's Raft group. `leader` is `host:port:alias`, or
    None while an election runs. The address is a hint: it can be stale."""

    grpc_code = "FAILED_PRECONDITION"
    retryable = True

    def __init__(self, leader: str | None, group_id: int = 0) -> None:
        self.leader = leader or None
        self.group_id = group_id
        super().__init__(f"not the leader of raft group {group_id}; leader={leader or 'unknown'}")

    def fields(self) -> dict[str, Any]:
        return {"leader": self.leader, "group_id": self.group_id}


class ProposalTimeout(RaftStoreError):
    """A write was proposed but not committed in time. Its outcome is unknown: retry with
    the same producer id and sequence (or key column) so the retry is deduplicated."""

    grpc_code = "DEADLINE_EXCEEDED"
    retryable = True

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        super().__init__(f"proposal not committed within {timeout_s:.1f}s; outcome unknown")

    def fields(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s}


class LeadershipLost(RaftStoreError):
    """The proposal was dropped because leadership changed before it committed. Its
    outcome is unknown; retrying (deduplicated) is safe."""

    grpc_code = "UNAVAILABLE"
    retryable = True

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"leadership changed before commit ({reason}); outcome unknown")

    def fields(self) -> dict[str, Any]:
        return {"reason": self.reason}


class Overloaded(RaftStoreError):
    """A bounded queue is full. The request was not accepted; retry later."""

    grpc_code = "RESOURCE_EXHAUSTED"
    retryable = True

    def __init__(self, queue: str, limit: int) -> None:
        self.queue = queue
        self.limit = limit
        super().__init__(f"queue {queue} is full (limit {limit}); retry later")

    def fields(self) -> dict[str, Any]:
        return {"queue": self.queue, "limit": self.limit}


class NodeUnavailable(RaftStoreError):
    """The node cannot serve the request right now (starting, catching up, shutting down)."""

    grpc_code = "UNAVAILABLE"
    retryable = True

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"node unavailable: {reason}")

    def fields(self) -> dict[str, Any]:
        return {"reason": self.reason}


class TransferFailed(RaftStoreError):
    """A leadership transfer did not complete: the target (`host:port:alias`, or None for
    any follower) did not catch up or take over in time, or cannot lead. The old leader
    takes writes again; nothing was lost."""

    grpc_code = "ABORTED"

    def __init__(self, group_id: int, target: str | None, reason: str) -> None:
        self.group_id = group_id
        self.target = target or None
        self.reason = reason
        to = f" to {target}" if target else ""
        super().__init__(f"leadership transfer of raft group {group_id}{to} failed: {reason}")

    def fields(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "target": self.target, "reason": self.reason}


class IncarnationDropped(RaftStoreError):
    """A peer has applied the drop of the table incarnation created at `created_lsn` (a
    drop is applied only once committed): a replica repairing that incarnation's rows needs
    them no more than its own coming replay of the drop does."""

    grpc_code = "NOT_FOUND"

    def __init__(self, table: str, created_lsn: int) -> None:
        self.table = table
        self.created_lsn = created_lsn
        super().__init__(f"table {table!r} created at entry {created_lsn} was dropped")

    def fields(self) -> dict[str, Any]:
        return {"table": self.table, "created_lsn": self.created_lsn}


class TableNotFound(RaftStoreError):
    grpc_code = "NOT_FOUND"

    def __init__(self, table: str) -> None:
        self.table = table
        super().__init__(f"table not found: {table!r}")

    def fields(self) -> dict[str, Any]:
        return {"table": self.table}


class TableExists(RaftStoreError):
    """The name is taken: by a table of this group, or (`group_id`) claimed by another."""

    grpc_code = "ALREADY_EXISTS"

    def __init__(self, table: str, group_id: int | None = None) -> None:
        self.table = table
        self.group_id = group_id
        where = "" if group_id is None else f" in raft group {group_id}"
        super().__init__(f"table already exists{where}: {table!r}")

    def fields(self) -> dict[str, Any]:
        return {"table": self.table, "group_id": self.group_id}


class TableSubscribed(RaftStoreError):
    """dropStreamTable refused: the table still has subscribers (pass force=True)."""

    grpc_code = "FAILED_PRECONDITION"

    def __init__(self, table: str, topics: list[str]) -> None:
        self.table = table
        self.topics = topics
        super().__init__(f"table {table!r} has subscriptions {topics}; drop with force=True")

    def fields(self) -> dict[str, Any]:
        return {"table": self.table, "topics": self.topics}


class UnknownGroup(RaftStoreError):
    grpc_code = "NOT_FOUND"

    def __init__(self, group_id: int) -> None:
        self.group_id = group_id
        super().__init__(f"raft group {group_id} is not configured on this node")

    def fields(self) -> dict[str, Any]:
        return {"group_id": self.group_id}


class SchemaMismatch(RaftStoreError):
    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, table: str, detail: str) -> None:
        self.table = table
        self.detail = detail
        super().__init__(f"schema mismatch for table {table!r}: {detail}")

    def fields(self) -> dict[str, Any]:
        return {"table": self.table, "detail": self.detail}


class BatchTooLarge(RaftStoreError):
    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, size: int, size_max: int, unit: str = "bytes") -> None:
        self.size = size
        self.size_max = size_max
        self.unit = unit
        super().__init__(f"batch too large: {size} {unit} > {size_max} {unit}")

    def fields(self) -> dict[str, Any]:
        return {"size": self.size, "size_max": self.size_max, "unit": self.unit}


class EmptyBatch(RaftStoreError):
    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, table: str) -> None:
        self.table = table
        super().__init__(f"empty batch for table {table!r}")

    def fields(self) -> dict[str, Any]:
        return {"table": self.table}


class SequenceGap(RaftStoreError):
    """A pipelined (contiguous) publish skipped sequences: the producer's last applied
    sequence is `expected - 1`, this request carries `got` > `expected`. Nothing was applied:
    an earlier request of the producer failed, so the ones after it must not land before
    it is resent. `producer` is the producer id in hex."""

    grpc_code = "FAILED_PRECONDITION"

    def __init__(self, producer: str, expected: int, got: int) -> None:
        self.producer = producer
        self.expected = expected
        self.got = got
        super().__init__(
            f"sequence gap for producer {producer}: expected sequence {expected}, got {got}; "
            "nothing applied"
        )

    def fields(self) -> dict[str, Any]:
        return {"producer": self.producer, "expected": self.expected, "got": self.got}


class InvalidArgument(RaftStoreError):
    """A request field is malformed (bad name, bad offset, garbage payload bytes)."""

    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, argument: str, detail: str) -> None:
        self.argument = argument
        self.detail = detail
        super().__init__(f"invalid {argument}: {detail}")

    def fields(self) -> dict[str, Any]:
        return {"argument": self.argument, "detail": self.detail}


class OffsetOutOfRange(RaftStoreError):
    grpc_code = "OUT_OF_RANGE"

    def __init__(self, table: str, offset: int, earliest: int, latest: int) -> None:
        self.table = table
        self.offset = offset
        self.earliest = earliest
        self.latest = latest
        super().__init__(
            f"offset {offset} of table {table!r} is outside the retained range "
            f"[{earliest}, {latest}]"
        )

    def fields(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "offset": self.offset,
            "earliest": self.earliest,
            "latest": self.latest,
        }


class TopicNotFound(RaftStoreError):
    grpc_code = "NOT_FOUND"

    def __init__(self, topic: str) -> None:
        self.topic = topic
        super().__init__(f"no persisted offset for topic {topic!r}")

    def fields(self) -> dict[str, Any]:
        return {"topic": self.topic}


class ConfigError(RaftStoreError):
    """cluster.cfg is refused. Names the file, the key and the value."""

    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, path: str, key: str, value: str, reason: str) -> None:
        self.path = path
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(f"{path}: {key}={value!r}: {reason}")

    def fields(self) -> dict[str, Any]:
        return {"path": self.path, "key": self.key, "value": self.value, "reason": self.reason}


class CorruptionError(RaftStoreError):
    """A checksum failed somewhere other than a torn tail. Never skipped silently."""

    grpc_code = "DATA_LOSS"

    def __init__(self, path: str, position: int, detail: str) -> None:
        self.path = path
        self.position = position
        self.detail = detail
        super().__init__(f"corruption in {path} at byte {position}: {detail}")

    def fields(self) -> dict[str, Any]:
        return {"path": self.path, "position": self.position, "detail": self.detail}


class ReplicaInDoubt(RaftStoreError):
    """This replica of the group cannot be trusted right now (an environment error stalls
    it, it is repairing data from a peer, or its repair failed): it serves no reads,
    subscriptions or writes. Retry on another site; the leader is healthy by construction
    (a replica in doubt hands leadership away)."""

    grpc_code = "UNAVAILABLE"
    retryable = True

    def __init__(self, group_id: int, state: str, reason: str) -> None:
        self.group_id = group_id
        self.state = state
        self.reason = reason
        super().__init__(f"raft group {group_id} replica is {state}: {reason}")

    def fields(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "state": self.state, "reason": self.reason}


class TooManyTables(RaftStoreError):
    """Creating the table would pass the per-node table limit. Nothing was proposed."""

    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, table: str, tables: int, tables_max: int) -> None:
        self.table = table
        self.tables = tables
        self.tables_max = tables_max
        super().__init__(
            f"cannot create table {table!r}: this node holds {tables} tables, the limit is "
            f"{tables_max}"
        )

    def fields(self) -> dict[str, Any]:
        return {"table": self.table, "tables": self.tables, "tables_max": self.tables_max}


class TooManyTopics(RaftStoreError):
    """A first offset commit of `topic` would pass the group's limit of persisted topics
    (remove unused ones with removeTopicOffset). Nothing was proposed."""

    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, topic: str, topics_max: int) -> None:
        self.topic = topic
        self.topics_max = topics_max
        super().__init__(
            f"cannot persist the offset of topic {topic!r}: the group holds {topics_max} "
            "topics, the limit; remove unused ones (removeTopicOffset)"
        )

    def fields(self) -> dict[str, Any]:
        return {"topic": self.topic, "topics_max": self.topics_max}


class CheckpointDeferred(RaftStoreError):
    """A checkpoint was asked for while the applied state is not whole (a repair runs or an
    entry waits on an environment error); the Raft log is kept until a later one."""

    grpc_code = "UNAVAILABLE"
    retryable = True

    def __init__(self, group_id: int, reason: str) -> None:
        self.group_id = group_id
        self.reason = reason
        super().__init__(f"checkpoint of raft group {group_id} deferred: {reason}")

    def fields(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "reason": self.reason}


class Unauthenticated(RaftStoreError):
    """The call carries no valid credentials for what it asks (a peer-only RPC called
    without the cluster's signature, a forged or replayed one). Nothing was done."""

    grpc_code = "UNAUTHENTICATED"

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"unauthenticated: {reason}")

    def fields(self) -> dict[str, Any]:
        return {"reason": self.reason}


class SlowConsumer(RaftStoreError):
    """The node ended a subscription whose subscriber took no message for too long (its
    streamingSlowConsumerTimeout). Retryable: resubscribing resumes from the offset the
    subscriber has processed. (Sent as the status details, not trailing metadata: the
    stream is cancelled under a blocked send; the client's transport rebuilds it.)"""

    grpc_code = "RESOURCE_EXHAUSTED"
    retryable = True

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)

    def fields(self) -> dict[str, Any]:
        return {"reason": self.reason}


class PermissionDenied(RaftStoreError):
    """The logged-in user may not do what the call asks: `action` is the privilege it
    needs (TABLE_READ, TABLE_WRITE or ADMIN), `table` the table it names ("" for none).
    Nothing was done."""

    grpc_code = "PERMISSION_DENIED"

    def __init__(self, user: str, action: str, table: str = "") -> None:
        self.user = user
        self.action = action
        self.table = table
        on = f" on table {table!r}" if table else ""
        super().__init__(f"user {user!r} lacks {action}{on}")

    def fields(self) -> dict[str, Any]:
        return {"user": self.user, "action": self.action, "table": self.table}


class UserExists(RaftStoreError):
    grpc_code = "ALREADY_EXISTS"

    def __init__(self, user: str) -> None:
        self.user = user
        super().__init__(f"user {user!r} already exists")

    def fields(self) -> dict[str, Any]:
        return {"user": self.user}


class UserNotFound(RaftStoreError):
    grpc_code = "NOT_FOUND"

    def __init__(self, user: str) -> None:
        self.user = user
        super().__init__(f"user {user!r} does not exist")

    def fields(self) -> dict[str, Any]:
        return {"user": self.user}


class TooManyAccessRules(RaftStoreError):
    """A new user, or a new grant or denial, would pass the cluster's limit (`what`:
    "users", or "rules of <user>"). Nothing was proposed or changed."""

    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, what: str, limit: int) -> None:
        self.what = what
        self.limit = limit
        super().__init__(f"too many {what}: the limit is {limit}")

    def fields(self) -> dict[str, Any]:
        return {"what": self.what, "limit": self.limit}


class PeerProtocolError(RaftStoreError):
    """A peer answered a catch-up fetch with something else than what was asked (a wrong
    offset, a record from after the restored state). The next peer is tried."""

    grpc_code = "INTERNAL"
    retryable = True

    def __init__(self, peer: str, detail: str) -> None:
        self.peer = peer
        self.detail = detail
        super().__init__(f"peer {peer}: {detail}")

    def fields(self) -> dict[str, Any]:
        return {"peer": self.peer, "detail": self.detail}


_BY_NAME: Final[dict[str, type[RaftStoreError]]] = {
    cls.__name__: cls
    for cls in (
        NotLeader,
        ProposalTimeout,
        LeadershipLost,
        Overloaded,
        NodeUnavailable,
        TransferFailed,
        TableNotFound,
        TableExists,
        TableSubscribed,
        UnknownGroup,
        SchemaMismatch,
        BatchTooLarge,
        EmptyBatch,
        SequenceGap,
        InvalidArgument,
        OffsetOutOfRange,
        TopicNotFound,
        ConfigError,
        CorruptionError,
        ReplicaInDoubt,
        TooManyTables,
        TooManyTopics,
        CheckpointDeferred,
        PeerProtocolError,
        IncarnationDropped,
        Unauthenticated,
        PermissionDenied,
        SlowConsumer,
        UserExists,
        UserNotFound,
        TooManyAccessRules,
    )
}


SHOWN_CHARS_MAX: Final = 40


def shown(text: str) -> str:
    """`text` as an error may echo it: at most SHOWN_CHARS_MAX characters, repr-escaped (a
    request's string is never echoed whole, and a newline in it forges no log line)."""
    cut = text[:SHOWN_CHARS_MAX] + ("..." if len(text) > SHOWN_CHARS_MAX else "")
    return repr(cut)


def to_wire(error: RaftStoreError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that lets the client rebuild `error` with its fields."""
    return ((WIRE_TYPE_KEY, type(error).__name__), (WIRE_FIELDS_KEY, json.dumps(error.fields())))


def from_wire(metadata: dict[str, str]) -> RaftStoreError | None:
    """Rebuild the server's exception from trailing metadata; None if there is none."""
    name = metadata.get(WIRE_TYPE_KEY)
    cls = _BY_NAME.get(name or "")
    if cls is None:
        return None
    try:
        fields = json.loads(metadata.get(WIRE_FIELDS_KEY, "{}"))
        return cls(**fields)
    except (TypeError, ValueError):
        return None
