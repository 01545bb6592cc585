"""Value types both sides use: node addresses, topics, subscription start offsets, groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, NewType

GroupId = NewType("GroupId", int)  # >= 2 for Raft groups; 0 is the node-local (non-HA) group.

LOCAL_GROUP: Final[GroupId] = GroupId(0)

# Subscription start offsets (DolphinDB's conventions).
OFFSET_LATEST: Final = -1  # only rows appended after subscribing
OFFSET_PERSISTED: Final = -2  # resume after the topic's persisted offset
OFFSET_EARLIEST: Final = -3  # earliest row still retained


@dataclass(frozen=True, slots=True)
class NodeAddress:
    """A node's client endpoint, printed DolphinDB style as `host:port:alias`."""

    host: str
    port: int
    alias: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port}:{self.alias}"

    @classmethod
    def parse(cls, text: str) -> NodeAddress:
        host, port, alias = text.rsplit(":", 2)
        return cls(host=host, port=int(port), alias=alias)


def topic_name(table: str, action_name: str) -> str:
    """A subscription's topic: the table and the subscriber's action name."""
    return f"{table}/{action_name}"


@dataclass(frozen=True, slots=True)
class TableDigest:
    """A replica's digest of the records covering rows [offset_from, offset_to) of a table,
    and its retained range [earliest_offset, row_count) (digest.py)."""

    offset_from: int
    offset_to: int
    records: int
    digest: int
    earliest_offset: int
    row_count: int
