"""The admin calls' requests and answers: conversion from/to the wire messages.

No I/O here: `connection.Session` makes the calls and uses these to build requests and
read responses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Final

import pyarrow as pa

from api_clients.types import TableInfo
from hastream import wire
from hastream.errors import InvalidArgument
from proto import hastream_pb2

RETENTION_MINUTES_DEFAULT: Final = 1440
_TABLE_NAME: Final = re.compile(wire.TABLE_NAME_PATTERN)


def schema_to_ipc(schema: pa.Schema) -> bytes:
    return bytes(schema.serialize().to_pybytes())


def schema_from_ipc(schema_ipc: bytes) -> pa.Schema:
    try:
        return pa.ipc.read_schema(pa.py_buffer(schema_ipc))
    except (pa.ArrowInvalid, OSError) as error:
        raise InvalidArgument("schema_ipc", f"not an Arrow IPC schema: {error}") from error


def schema_of(template: object) -> pa.Schema:
    """The schema a table is created with: a pyarrow Schema, or the columns of a template
    as DolphinDB users pass one (a pyarrow Table or RecordBatch, a pandas DataFrame; its
    index is not a column). Raises InvalidArgument for anything else."""
    if isinstance(template, pa.Schema):
        return template
    if isinstance(template, pa.Table | pa.RecordBatch):
        return template.schema
    if type(template).__name__ == "DataFrame" and hasattr(template, "columns"):
        try:
            return pa.Schema.from_pandas(template, preserve_index=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as error:
            raise InvalidArgument(
                "schema", f"cannot type the DataFrame's columns: {error}"
            ) from None
    raise InvalidArgument(
        "schema", f"need a pyarrow Schema, Table or pandas DataFrame, got {type(template).__name__}"
    )


def create_table_request(
    *,
    raft_group: int,
    schema: object,
    table: str,
    cache_limit: int,
    key_column: str | None,
    retention_minutes: int,
) -> hastream_pb2.CreateTableRequest:
    """Checks the arguments a server would refuse anyway, so the mistake is named locally."""
    if not _TABLE_NAME.fullmatch(table) or len(table.encode()) > wire.TABLE_NAME_BYTES_MAX:
        raise InvalidArgument(
            "tableName",
            f"{table!r}: want 1..{wire.TABLE_NAME_BYTES_MAX} characters of [A-Za-z0-9_] "
            "starting with a letter",
        )
    columns = schema_of(schema)
    if not 0 < len(columns) <= wire.COLUMNS_MAX:
        raise InvalidArgument("schema", f"{len(columns)} columns: want 1..{wire.COLUMNS_MAX}")
    if key_column is not None and key_column not in columns.names:
        raise InvalidArgument("keyColumn", f"{key_column!r} is not a column of {columns.names}")
    if cache_limit <= 0:
        raise InvalidArgument("cacheLimit", f"must be > 0, got {cache_limit}")
    if retention_minutes <= 0:
        raise InvalidArgument("retentionMinutes", f"must be > 0, got {retention_minutes}")
    return hastream_pb2.CreateTableRequest(
        raft_group=raft_group,
        table=table,
        schema_ipc=schema_to_ipc(columns),
        cache_limit=cache_limit,
        key_column=key_column or "",
        retention_minutes=retention_minutes,
    )


def table_info_from_proto(message: hastream_pb2.TableInfo) -> TableInfo:
    return TableInfo(
        table=message.table,
        raft_group=message.raft_group,
        schema=schema_from_ipc(message.schema_ipc),
        cache_limit=message.cache_limit,
        key_column=message.key_column or None,
        retention_minutes=message.retention_minutes or RETENTION_MINUTES_DEFAULT,
        row_count=message.row_count,
        earliest_offset=message.earliest_offset,
    )


def raft_groups_from_proto(message: hastream_pb2.RaftGroups) -> list[dict[str, Any]]:
    """One dict per group: `id` and `sites` as DolphinDB names them, plus the current
    `leader` (host:port:alias, None while unknown) and the group's `tables`."""
    return [
        {
            "id": group.raft_group,
            "sites": list(group.sites),
            "leader": group.leader or None,
            "tables": list(group.tables),
        }
        for group in message.groups
    ]


def json_document(message: hastream_pb2.JsonDocument) -> dict[str, Any]:
    try:
        document = json.loads(message.json)
    except ValueError as error:
        raise InvalidArgument("json", f"the node answered malformed JSON: {error}") from error
    if not isinstance(document, dict):
        raise InvalidArgument("json", f"expected a JSON object, got {type(document).__name__}")
    return document


def topic_table(topic: str) -> str:
    """The table part of a topic `table/actionName`."""
    table, separator, action_name = topic.rpartition("/")  # As the server splits it.
    if not separator or not table or not action_name:
        raise InvalidArgument("topic", f"{topic!r} is not 'table/actionName'")
    return table


# -- users and grants: one request builder for the threaded and the asyncio session ------

Operation = hastream_pb2.AccessRequest.Operation
_RULE_OPERATIONS: Final = {
    "grant": hastream_pb2.AccessRequest.GRANT,
    "deny": hastream_pb2.AccessRequest.DENY,
    "revoke": hastream_pb2.AccessRequest.REVOKE,
}


def create_user_request(user: str, password: str, is_admin: bool) -> hastream_pb2.AccessRequest:
    return hastream_pb2.AccessRequest(
        operation=hastream_pb2.AccessRequest.CREATE_USER,
        userid=user,
        password=password,
        admin=is_admin,
    )


def delete_user_request(user: str) -> hastream_pb2.AccessRequest:
    return hastream_pb2.AccessRequest(operation=hastream_pb2.AccessRequest.DELETE_USER, userid=user)


def reset_password_request(user: str, password: str) -> hastream_pb2.AccessRequest:
    return hastream_pb2.AccessRequest(
        operation=hastream_pb2.AccessRequest.RESET_PASSWORD, userid=user, password=password
    )


def rule_requests(
    verb: str, user: str, access_type: str, objs: str | Sequence[str]
) -> list[hastream_pb2.AccessRequest]:
    """`grant`, `deny` or `revoke` of `access_type` on each table of `objs` (one name,
    names, or "*"): one request per table."""
    operation = _RULE_OPERATIONS[verb]
    tables = [objs] if isinstance(objs, str) else list(objs)
    return [
        hastream_pb2.AccessRequest(
            operation=operation, userid=user, privilege=access_type, table=table
        )
        for table in tables
    ]


def users_from_access(message: hastream_pb2.JsonDocument) -> list[dict[str, Any]]:
    """Every user with its admin flag and rules, from GetAccess's answer."""
    users: list[dict[str, Any]] = json.loads(message.json)["users"]
    return users
