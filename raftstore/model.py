"""Value types shared by the core and the shell."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

Lsn = NewType("Lsn", int)  # Raft log index of the entry that carried a change.
GroupId = NewType("GroupId", int)  # >= 2 for Raft groups; 0 is the node-local (non-HA) group.
TableName = NewType("TableName", str)

LOCAL_GROUP: GroupId = GroupId(0)

# Subscription start offsets (DolphinDB's conventions).
OFFSET_LATEST = -1  # only rows appended after subscribing
OFFSET_PERSISTED = -2  # resume after the topic's persisted offset
OFFSET_EARLIEST = -3  # earliest row still retained


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
