"""The exception hierarchy: operating errors as classes with fields.

Programmer errors are `assert`s and crash the process; everything here is an expected
failure that callers handle. The same classes are rebuilt on the client side from the
gRPC trailing metadata (see `to_wire` / `from_wire`), so a client catches `NotLeader`
and reads `.leader` exactly as the server raised it.

This module is import-light on purpose (stdlib only): `api_clients/` imports it.
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


class TableNotFound(RaftStoreError):
    grpc_code = "NOT_FOUND"

    def __init__(self, table: str) -> None:
        self.table = table
        super().__init__(f"table not found: {table!r}")

    def fields(self) -> dict[str, Any]:
        return {"table": self.table}


class TableExists(RaftStoreError):
    grpc_code = "ALREADY_EXISTS"

    def __init__(self, table: str) -> None:
        self.table = table
        super().__init__(f"table already exists: {table!r}")

    def fields(self) -> dict[str, Any]:
        return {"table": self.table}


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


_BY_NAME: Final[dict[str, type[RaftStoreError]]] = {
    cls.__name__: cls
    for cls in (
        NotLeader,
        ProposalTimeout,
        LeadershipLost,
        Overloaded,
        NodeUnavailable,
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
    )
}


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
