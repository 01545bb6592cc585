"""Test helpers over a real local cluster (see deploy/local_cluster.py)."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pyarrow as pa

from deploy.local_cluster import (  # noqa: F401 (re-exported for the tests)
    LocalCluster,
    free_ports,
    ipc_stream,
    read_stream,
    wait_until,
)
from proto import hastream_pb2 as pb
from raftstore.storage.format import HEADER_SIZE


class ManualClock:
    """A clock the test moves by hand (`clock.now += s`), for code that takes a clock."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class AckedPublisher:
    """A test publisher that follows the leader and records what the cluster acknowledged.

    Each batch carries unique keys and is retried (same keys) until acknowledged, so on a
    keyed table a retry after a lost ack is deduplicated by the cluster, not by this class.
    """

    def __init__(
        self, cluster: LocalCluster, table: str, schema: pa.Schema, group: int = 2
    ) -> None:
        self.cluster = cluster
        self.table = table
        self.schema = schema
        self.group = group
        self.acked: list[int] = []
        self.errors_retried = 0
        # The latest failed attempts (node, status, seconds taken): a give-up shows them.
        self.recent_errors: deque[tuple[str, str, float]] = deque(maxlen=12)
        self._leader: str | None = None

    def batch(self, first_key: int, rows: int) -> pa.Table:
        ids = pa.array(range(first_key, first_key + rows), pa.int64())
        columns = {"id": ids}
        for field_ in self.schema:
            if field_.name == "id":
                continue
            if pa.types.is_floating(field_.type):
                columns[field_.name] = pa.array([first_key * 0.5] * rows, field_.type)
            elif pa.types.is_integer(field_.type) or pa.types.is_timestamp(field_.type):
                columns[field_.name] = pa.array([first_key] * rows, field_.type)
            else:
                columns[field_.name] = pa.array([f"s{first_key}"] * rows, field_.type)
        return pa.table(columns, schema=self.schema)

    def publish(self, first_key: int, rows: int, *, deadline_s: float = 60) -> None:
        payload = ipc_stream(self.batch(first_key, rows))
        request = pb.PublishRequest(table=self.table, payload=payload)
        try:
            wait_until(
                lambda: self._attempt(request),
                timeout_s=deadline_s,
                message=f"batch {first_key} acknowledged",
            )
        except AssertionError as error:
            attempts = list(self.recent_errors)
            raise AssertionError(f"{error}; latest failed attempts: {attempts}") from error
        self.acked.extend(range(first_key, first_key + rows))

    def _attempt(self, request: pb.PublishRequest) -> bool:
        """One publish to the believed leader; on failure, follow the hint or move on."""
        alive = self.cluster.alive()
        if not alive:
            raise AssertionError(f"{self.table}: no node is alive")
        alias = self._leader if self._leader in alive else alive[0]
        started = time.monotonic()
        try:
            self.cluster.stub(alias).Publish(request, timeout=15)
            return True
        except grpc.RpcError as error:
            self.errors_retried += 1
            taken = round(time.monotonic() - started, 2)
            self.recent_errors.append((alias, f"{error.code().name}: {error.details()}", taken))
            metadata = dict(error.trailing_metadata() or ())
            leader = json.loads(metadata.get("hastream-error-fields", "{}")).get("leader")
            if leader and self.cluster.alias_of(leader) in alive:
                self._leader = self.cluster.alias_of(leader)
            else:
                self._leader = alive[(alive.index(alias) + 1) % len(alive)]
            return False


def wait_replicas_settled(
    cluster: LocalCluster, table: str, group: int = 2, timeout_s: float = 60
) -> None:
    """Wait until every live replica has applied all the leader committed, including a
    barrier entry of the leader's own term (an offset commit), which commits any entry left
    over from before a crash. After that, without new publishes, no row count can change, so
    replicas can be compared (equal row counts alone can be a passing moment)."""
    request = pb.CommitOffsetRequest(table=table, action_name="__settled", offset=0)

    def barrier() -> int | None:
        leader = cluster.leader(group)
        try:
            cluster.stub(leader).CommitOffset(request, timeout=10)
        except grpc.RpcError:
            return None  # an election under way: try again
        return int(cluster.group_status(leader, group)["commit_index"])

    committed = wait_until(barrier, timeout_s=timeout_s, message="barrier entry committed")
    assert committed is not None  # wait_until returns only a truthy value

    def applied(alias: str) -> bool:
        status = cluster.group_status(alias, group)
        # A replica catching up from a peer counts entries as applied before its rows land.
        return int(status["last_applied"]) >= committed and not status["catching_up"]

    wait_until(
        lambda: all(applied(alias) for alias in cluster.alive()),
        timeout_s=timeout_s,
        message=f"every replica applied up to {committed}",
    )


def assert_replicas_hold_exactly(
    cluster: LocalCluster,
    table: str,
    acked: list[int],
    key: str = "id",
    *,
    ordered: bool = True,
    group: int = 2,
) -> None:
    """Every acknowledged row is present exactly once, in the same order, on every replica.
    Settles first: a row count seen equal is the replicated count, which a replica restoring
    a checkpoint or repairing from a peer reports before its files hold the rows."""
    wait_replicas_settled(cluster, table, group)
    tables = {alias: cluster.read_table(alias, table) for alias in cluster.alive()}
    reference: list[int] | None = None
    for alias, data in tables.items():
        keys = data.column(key).to_pylist() if data.num_rows else []
        assert len(keys) == len(set(keys)), f"{alias}: duplicated rows"
        missing = set(acked) - set(keys)
        assert not missing, (
            f"{alias}: {len(missing)} acknowledged rows lost, e.g. {sorted(missing)[:5]}"
        )
        if reference is None:
            reference = keys
        else:
            assert keys == reference, f"{alias}: rows differ from another replica"
    if ordered:
        # One sequential publisher retries a batch until acknowledged: rows land in key order.
        assert reference == sorted(reference or []), "rows out of publish order"


def iter_rows(messages: Iterator[pb.RowBatch]) -> Iterator[pa.Table]:
    for message in messages:
        yield read_stream(message.payload)


def checkpoint_counts(cluster: LocalCluster, alias: str, group: int = 2) -> tuple[int, int]:
    """(taken, durable) checkpoints of `group` on `alias` since it started."""
    status = cluster.group_status(alias, group)
    return int(status["checkpoints_written"]), int(status["checkpoints_durable"])


def wait_durable_checkpoint_of_what_is_applied(
    cluster: LocalCluster, alias: str, group: int = 2
) -> None:
    """Until a checkpoint of everything applied now is durable on `alias`: one taken of
    that state or a later one (`checkpoint_lsn`; pysyncobj takes none while nothing new
    was applied, so "a checkpoint taken after now" may never come), and every checkpoint
    taken durable. (`checkpoints_written` counts a checkpoint when its state is taken,
    before the Raft checkpoint file is in place: a kill right then restarts from the one
    before, and replays the log instead. At most one is in flight, and each becomes
    durable unless a write fails.)"""

    applied = int(cluster.group_status(alias, group)["lsn_applied"])

    def done() -> bool:
        status = cluster.group_status(alias, group)
        durable = int(status["checkpoints_durable"]) >= int(status["checkpoints_written"])
        return durable and int(status["checkpoint_lsn"]) >= applied

    wait_until(done, timeout_s=60, message=f"a durable checkpoint on {alias}")


def restart_with_a_damaged_record(
    cluster: LocalCluster, alias: str, table: str, group: int = 2
) -> Path:
    """Kill `alias`, flip a byte in the payload of the first record of `table`'s first data
    segment, start it again; returns the table's directory. Records follow the damaged one,
    so it cannot pass for a torn tail (a damaged last record is cut as one, and fetched back
    the same way)."""
    cluster.kill(alias)
    (table_dir,) = (cluster.root / alias / "persistence" / f"group-{group}").glob(f"{table}.*")
    segment = sorted(table_dir.glob("seg-*.dat"))[0]
    data = bytearray(segment.read_bytes())
    data[HEADER_SIZE + 8] ^= 0xFF
    segment.write_bytes(bytes(data))
    cluster.start_node(alias)
    return table_dir


def wait_damage_repaired(cluster: LocalCluster, alias: str, group: int = 2) -> None:
    """Until `alias` found damage and is healthy again. (GetTableInfo's row_count is the
    replicated count, restored from a checkpoint before the files are opened: no help.)"""

    def repaired() -> bool:
        status = cluster.group_status(alias, group)
        return bool(status["corruptions_repaired"] >= 1 and status["health"]["state"] == "healthy")

    wait_until(repaired, timeout_s=60, message=f"damaged {alias} repaired")


@contextmanager
def cluster_with_logins(root: Path, admin_password: str) -> Iterator[LocalCluster]:
    """A started three-node cluster under `root` with logins on (`admin` has
    `admin_password`) and a leader of group 2; stopped on leaving."""
    cluster = LocalCluster(root)
    cluster.enable_authentication(admin_password)
    cluster.start()
    try:
        cluster.leader(2)
        yield cluster
    finally:
        cluster.stop()


class PublisherFailed(Exception):
    """The publisher under a fault schedule gave up: the schedule ends with its error."""


def cluster_report(cluster: LocalCluster, group: int = 2) -> str:
    """Each node's view of `group` and its log's tail: what a timed-out wait shows."""
    lines = []
    for alias in cluster.nodes:
        if alias not in cluster.alive():
            lines.append(f"--- {alias}: not running")
            continue
        try:
            status = cluster.group_status(alias, group)
            view = {key: status.get(key) for key in ("role", "leader", "term", "health")}
        except grpc.RpcError as error:
            view = {"status": f"unavailable ({error.code().name})"}
        lines.append(f"--- {alias}: {view}\n{cluster.log_tail(alias, lines=15)}")
    return "\n".join(lines)


def kill_then_freeze_the_leader(
    cluster: LocalCluster,
    acked: list[int],
    step: int,
    group: int = 2,
    failures: list[BaseException] | None = None,
) -> None:
    """A fault schedule for publishers that note each acknowledged key in `acked`, each
    fault once `step` more were acknowledged: kill -9 the leader; restart it (a majority
    must be left when the next one freezes); SIGSTOP the new leader; SIGCONT it. A failure
    the publisher noted in `failures` ends the schedule at once; a timed-out wait reports
    every node's view and log."""
    noted = failures if failures is not None else []

    def more_acked(message: str) -> None:
        mark = len(acked)

        def grown() -> bool:
            if noted:
                raise PublisherFailed(f"the publisher failed: {noted[0]!r}")
            return len(acked) >= mark + step

        try:
            wait_until(grown, timeout_s=60, message=message, fatal=(PublisherFailed,))
        except (AssertionError, PublisherFailed) as error:
            raise AssertionError(f"{error}\n{cluster_report(cluster, group)}") from error

    more_acked("appends flowing")
    killed = cluster.leader(group)
    cluster.kill(killed)
    more_acked("appends resumed")
    cluster.start_node(killed)
    frozen = cluster.leader(group)
    cluster.signal(frozen, signal.SIGSTOP)
    more_acked("appends around the freeze")
    cluster.signal(frozen, signal.SIGCONT)
    more_acked("appends go on")


# A publisher run by `publish_through_faults`: appends until the event is set, noting each
# acknowledged key in the first list and each failure in the second.
FaultedPublisher = Callable[[threading.Event, list[int], list[BaseException]], None]


def publish_through_faults(
    cluster: LocalCluster, publish: FaultedPublisher, *, step: int
) -> list[int]:
    """Runs `publish` on a thread of its own while `kill_then_freeze_the_leader` runs;
    returns the keys acknowledged once it returned and no node stays frozen. Fails on any
    failure it noted."""
    acked: list[int] = []
    stop = threading.Event()
    failures: list[BaseException] = []
    thread = threading.Thread(target=publish, args=(stop, acked, failures), daemon=True)
    thread.start()
    try:
        kill_then_freeze_the_leader(cluster, acked, step=step, failures=failures)
    finally:
        stop.set()
        thread.join(timeout=180)
        for alias in cluster.alive():
            cluster.signal(alias, signal.SIGCONT)
    assert not thread.is_alive()
    assert not failures, failures[:3]
    return acked
