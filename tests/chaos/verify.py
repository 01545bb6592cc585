"""Reading a real cluster's state for the checks: node liveness with the log lines that
explain a death, per-group health, settling (every replica applied everything committed),
and each replica's rows read from that node directly.

`health`: the per-group field of GetNodeStatus, `{"state": ..., "reason": ...}`; its state
must be "healthy" and the group must not be catching up.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Final, TypeVar

import grpc

from deploy.local_cluster import LocalCluster, read_stream, wait_until
from proto import hastream_pb2 as pb
from tests.harness import wait_replicas_settled

HEALTHY: Final = "healthy"
SETTLE_TIMEOUT_S: Final = 60.0
READ_TIMEOUT_S: Final = 60.0
_NOTABLE: Final = re.compile(r" (WARNING|ERROR|CRITICAL) |Traceback|Error: |READY")
_TIMESTAMP: Final = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
T = TypeVar("T")


class NodeDied(AssertionError):
    """A node process exited that the test did not stop."""


def notable_log_lines(cluster: LocalCluster, alias: str, lines: int = 12) -> list[str]:
    """The last `lines` distinct WARNING/ERROR/CRITICAL lines, traceback lines and readiness
    lines of the node's current process (a repeated line once, with its count), then its
    last line."""
    text = cluster.log_since_start(alias) if cluster.nodes[alias].log_path.exists() else ""
    all_lines = text.splitlines()
    counts: dict[str, int] = {}
    last_seen: dict[str, str] = {}
    for line in all_lines:
        if _NOTABLE.search(line):
            key = _TIMESTAMP.sub("", line)[:300]
            counts[key] = counts.get(key, 0) + 1
            last_seen.pop(key, None)
            last_seen[key] = line[:300]  # re-inserted: ordered by last occurrence
    picked = [
        line if counts[key] == 1 else f"{line}  [x{counts[key]}]"
        for key, line in list(last_seen.items())[-lines:]
    ]
    if all_lines and all_lines[-1][:300] not in last_seen.values():
        picked.append(all_lines[-1][:300])
    return picked


def diagnostics(cluster: LocalCluster, aliases: Iterable[str] | None = None) -> str:
    parts: list[str] = []
    for alias in aliases if aliases is not None else cluster.nodes:
        code = cluster.exit_code(alias)
        state = "running" if code is None else f"exited code={code}"
        lines = "\n    ".join(notable_log_lines(cluster, alias)) or "(nothing notable)"
        parts.append(f"  {alias} ({state}):\n    {lines}")
    return "\n".join(parts)


def check_alive(cluster: LocalCluster, expected_up: Iterable[str]) -> None:
    """Raise NodeDied naming every node in `expected_up` that is not running."""
    dead = [alias for alias in expected_up if cluster.exit_code(alias) is not None]
    if dead:
        codes = ", ".join(f"{alias} code={cluster.exit_code(alias)}" for alias in dead)
        raise NodeDied(f"node exited on its own: {codes}\n{diagnostics(cluster, dead)}")


def health_problems(cluster: LocalCluster, alias: str) -> list[str]:
    document = cluster.status(alias)
    problems: list[str] = []
    for group in document["groups"]:
        health = group.get("health", {})
        if health.get("state") != HEALTHY:
            problems.append(f"{alias} group {group['raft_group']} health={health!r}")
        if group.get("catching_up"):
            problems.append(f"{alias} group {group['raft_group']} catching_up")
    return problems


def retrying(action: Callable[[], T], *, timeout_s: float, what: str) -> T:
    """`action()` until it returns without a gRPC error, up to `timeout_s` (a replica in
    doubt refuses reads with a retryable error until it repaired itself)."""
    refused: list[grpc.RpcError] = []

    def attempt() -> tuple[T] | None:
        try:
            return (action(),)
        except grpc.RpcError as error:
            refused[:] = [error]
            return None

    try:
        answer = wait_until(attempt, timeout_s=timeout_s, interval_s=0.2, fatal=(Exception,))
    except AssertionError as timed_out:
        if not refused or "timed out after" not in str(timed_out):
            raise  # the action's own failure, not the deadline
        raise AssertionError(f"{what}: {_describe(refused[-1])}") from None
    assert answer is not None  # wait_until returns only a truthy value
    return answer[0]


def _describe(error: grpc.RpcError) -> str:
    call: object = error
    code = getattr(call, "code", lambda: None)()
    details = getattr(call, "details", lambda: "")()
    metadata = dict(getattr(call, "trailing_metadata", lambda: None)() or ())
    return f"{code} {details} {metadata.get('hastream-error', '')}"


def wait_healthy(
    cluster: LocalCluster,
    barrier_tables: dict[int, str],
    *,
    expected_up: Iterable[str] | None = None,
    timeout_s: float = SETTLE_TIMEOUT_S,
) -> None:
    """Every expected node runs, every group has a leader and every replica applied all the
    leader committed (a barrier entry through `barrier_tables[group]`), every group healthy.
    Raises NodeDied or AssertionError with diagnostics."""
    expected = list(cluster.nodes) if expected_up is None else list(expected_up)
    check_alive(cluster, expected)
    try:
        for group, table in sorted(barrier_tables.items()):
            wait_replicas_settled(cluster, table, group, timeout_s=timeout_s)
            check_alive(cluster, expected)
        problems: list[str] = []

        def healthy() -> bool:
            check_alive(cluster, expected)
            problems[:] = [p for alias in cluster.alive() for p in health_problems(cluster, alias)]
            return not problems

        try:
            wait_until(healthy, timeout_s=timeout_s, interval_s=0.2, fatal=(NodeDied,))
        except NodeDied:
            raise
        except AssertionError:
            raise AssertionError(f"unhealthy after {timeout_s:.0f}s: {problems}") from None
    except NodeDied:
        raise
    except AssertionError as error:
        check_alive(cluster, expected)
        raise AssertionError(f"{error}\n{diagnostics(cluster)}") from None


def read_keys(
    cluster: LocalCluster,
    alias: str,
    table: str,
    key: str = "id",
    *,
    timeout_s: float = READ_TIMEOUT_S,
) -> list[int] | None:
    """The keys of `table` on replica `alias`, read from that node in offset order; None if
    the node does not have the table. Retryable refusals are retried up to `timeout_s`."""

    def read() -> list[int] | None:
        keys: list[int] = []
        request = pb.ReadRequest(table=table, offset_from=0, offset_to=-1)
        try:
            for message in cluster.stub(alias).Read(request, timeout=READ_TIMEOUT_S):
                if message.row_count:
                    keys += read_stream(message.payload).column(key).to_pylist()
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return keys

    return retrying(read, timeout_s=timeout_s, what=f"read {table} on {alias}")


def table_groups(cluster: LocalCluster, alias: str) -> dict[str, list[int]]:
    """table -> the groups listing it, as node `alias` reports (GetStreamingRaftGroups)."""
    reply = cluster.stub(alias).GetStreamingRaftGroups(pb.Empty(), timeout=10)
    found: dict[str, list[int]] = {}
    for group in reply.groups:
        for table in group.tables:
            found.setdefault(table, []).append(group.raft_group)
    return found


def topic_offset(cluster: LocalCluster, alias: str, topic: str) -> int | None:
    try:
        reply = cluster.stub(alias).GetTopicProcessedOffset(
            pb.TopicRequest(topic=topic), timeout=10
        )
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise
    return int(reply.offset)


def status_json(cluster: LocalCluster, alias: str) -> str:
    return json.dumps(cluster.status(alias), sort_keys=True)
