"""What the commands print: aligned tables for people, JSON for scripts. Pure functions."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from api_clients import TableInfo


def to_json(document: Any) -> str:
    return json.dumps(document, indent=2, sort_keys=True, default=str)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart; `-` for None."""
    cells = [[_text(value) for value in row] for row in rows]
    widths = [len(header) for header in headers]
    for row in cells:
        for index, value in enumerate(row):
            widths[index] = max(widths[index], len(value))
    lines = [_line(headers, widths)] + [_line(row, widths) for row in cells]
    return "\n".join(lines)


def _text(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, list | tuple):
        return ",".join(_text(item) for item in value) or "-"
    return str(value)


def _line(cells: Sequence[str], widths: list[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()


def alias_of(address: str | None) -> str | None:
    """`host:port:alias` -> alias."""
    return None if not address else address.rpartition(":")[2]


def groups_table(groups: list[dict[str, Any]]) -> str:
    rows = [
        (
            group["id"],
            group["leader"] or "none",
            [alias_of(s) for s in group["sites"]],
            group["tables"],
        )
        for group in groups
    ]
    return table(("GROUP", "LEADER", "MEMBERS", "TABLES"), rows)


def schema_text(schema: pa.Schema) -> str:
    return ",".join(f"{field.name}:{field.type}" for field in schema)


def table_info_json(info: TableInfo) -> dict[str, Any]:
    return {
        "table": info.table,
        "group": info.raft_group,
        "rows": info.row_count,
        "earliest_offset": info.earliest_offset,
        "key_column": info.key_column,
        "cache_limit": info.cache_limit,
        "retention_minutes": info.retention_minutes,
        "schema": schema_text(info.schema),
    }


def tables_table(infos: list[dict[str, Any]]) -> str:
    headers = ("TABLE", "GROUP", "ROWS", "EARLIEST", "KEY", "CACHE", "RETENTION_MIN", "SCHEMA")
    keys = ("table", "group", "rows", "earliest_offset", "key_column", "cache_limit")
    rows = [
        (*(info[key] for key in keys), info["retention_minutes"], info["schema"]) for info in infos
    ]
    return table(headers, rows)


def stat_text(stat: dict[str, Any]) -> str:
    parts = [f"node {stat.get('alias', '?')}"]
    tables = [
        (t["table"], t["raft_group"], t["row_count"], t["earliest_offset"])
        for t in stat.get("tables", [])
    ]
    parts += ["", table(("TABLE", "GROUP", "ROWS", "EARLIEST"), tables)]
    subscriptions = [
        (s["topic"], s["connections"], s["persisted_offset"], s["lag"])
        for s in stat.get("subscriptions", [])
    ]
    parts += ["", table(("TOPIC", "SUBSCRIPTIONS", "PERSISTED_OFFSET", "LAG"), subscriptions)]
    groups = [
        (
            g["raft_group"],
            g["role"],
            alias_of(g.get("leader")) or "none",
            g["term"],
            g["commit_index"],
            g["last_applied"],
            g.get("health", {}).get("state", "-"),
        )
        for g in stat.get("groups", [])
    ]
    headers = ("GROUP", "ROLE", "LEADER", "TERM", "COMMIT", "APPLIED", "HEALTH")
    parts += ["", table(headers, groups)]
    return "\n".join(parts)


def offsets_table(offsets: list[dict[str, Any]]) -> str:
    rows = [(o["topic"], o["offset"], o["rows"], o["lag"]) for o in offsets]
    return table(("TOPIC", "OFFSET", "ROWS", "LAG"), rows)


def status_text(nodes: list[dict[str, Any]]) -> str:
    """One row per node, then one row per node and group."""
    node_rows = []
    group_rows = []
    for node in nodes:
        status = node.get("status") or {}
        node_rows.append(
            (status.get("alias") or "?", node["site"], node["health"], status.get("ready"))
        )
        for group in status.get("groups", []):
            if group["raft_group"] == 0:
                continue
            group_rows.append(
                (
                    group["raft_group"],
                    status.get("alias"),
                    group["role"],
                    alias_of(group.get("leader")) or "none",
                    group["term"],
                    group["commit_index"],
                    group["last_applied"],
                    group.get("health", {}).get("state", "-"),
                )
            )
    group_rows.sort(key=lambda row: (row[0], str(row[1])))
    headers = ("GROUP", "NODE", "ROLE", "LEADER", "TERM", "COMMIT", "APPLIED", "HEALTH")
    return "\n\n".join(
        [table(("NODE", "SITE", "HEALTH", "READY"), node_rows), table(headers, group_rows)]
    )


def rows_text(data: pa.Table, first_offset: int, *, header: bool) -> list[str]:
    """Lines for `tail`: the offset, then each column's value."""
    names = data.column_names
    rows = [
        (first_offset + index, *(row[name] for name in names))
        for index, row in enumerate(data.to_pylist())
    ]
    rendered = table(("OFFSET", *names), rows).splitlines()
    return rendered if header else rendered[1:]


def rows_json(data: pa.Table, first_offset: int) -> list[str]:
    return [
        json.dumps({"_offset": first_offset + index, **row}, default=str, sort_keys=True)
        for index, row in enumerate(data.to_pylist())
    ]
