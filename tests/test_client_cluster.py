"""The Python client against real three-node clusters: publishers, writers and subscribers
that follow the leader by themselves across kill -9 of leaders, followers, the whole
cluster, and the client process itself."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pandas as pd
import pyarrow as pa
import pytest

from api_clients import (
    MultithreadedTableWriter,
    Publisher,
    SchemaMismatch,
    Session,
    WriterStopped,
)
from api_clients.buffer import DurableBuffer
from hastream.errors import RaftStoreError
from proto import hastream_pb2 as pb
from tests.harness import LocalCluster, assert_replicas_hold_exactly, wait_until

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("ts", pa.timestamp("ms")),
        ("sym", pa.string()),
        ("price", pa.float64()),
        ("qty", pa.int32()),
    ]
)
# Generous: other heavy tests share this machine, and an election under load takes a while.
DEADLINE_S = 90.0
WAIT_S = 120.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path / "cluster")
    yield cluster.start()
    cluster.stop()


def sites(cluster: LocalCluster, first: str | None = None) -> list[str]:
    """Every node's `host:port`, `first` (an alias) in front."""
    aliases = sorted(cluster.nodes, key=lambda alias: alias != first)
    return [f"127.0.0.1:{cluster.nodes[alias].port}" for alias in aliases]


def session_for(cluster: LocalCluster, first: str | None = None) -> Session:
    return Session(sites(cluster, first), deadline_s=DEADLINE_S)


def frame(first: int, count: int) -> pd.DataFrame:
    ids = range(first, first + count)
    return pd.DataFrame(
        {
            "id": pd.Series(ids, dtype="int64"),
            "ts": pd.to_datetime([1_750_000_000_000 + i for i in ids], unit="ms"),
            "sym": [f"S{i % 7}" for i in ids],
            "price": [i * 0.5 for i in ids],
            "qty": pd.Series([i % 1000 for i in ids], dtype="int32"),
        }
    )


def table_ids(cluster: LocalCluster, alias: str, table: str) -> list[int]:
    data = cluster.read_table(alias, table)
    return data.column("id").to_pylist() if data.num_rows else []


def converged(cluster: LocalCluster, table: str, rows: int) -> None:
    wait_until(
        lambda: all(cluster.row_count(alias, table) == rows for alias in cluster.alive()),
        timeout_s=WAIT_S,
        message=f"every replica holds {rows} rows of {table}",
    )


# -- leader redirect and validation ----------------------------------------------------


def test_session_whose_first_site_is_a_follower_publishes_to_the_leader(
    cluster: LocalCluster,
) -> None:
    cluster.create_table("ticks", SCHEMA)
    leader = cluster.leader()
    follower = next(alias for alias in cluster.alive() if alias != leader)
    leader_site = f"127.0.0.1:{cluster.nodes[leader].port}"
    with session_for(cluster, first=follower) as session:
        assert session.route(table="ticks") == f"127.0.0.1:{cluster.nodes[follower].port}"
        result = Publisher(session, "ticks").append(frame(0, 100))
        assert (result.first_offset, result.row_count) == (0, 100)
        assert session.route(table="ticks") == leader_site  # Learned from the redirect.
        with MultithreadedTableWriter(
            session, "ticks", batchSize=50, throttle=0.1, durableBufferDir=None
        ) as writer:
            writer.insertDataFrame(frame(100, 100))
        assert writer.getStatus().sentRows == 100
    assert cluster.row_count(leader, "ticks") == 200
    assert table_ids(cluster, leader, "ticks") == list(range(200))


def test_a_new_session_reads_every_acknowledged_row_up_to_the_end_from_the_leader(
    cluster: LocalCluster,
) -> None:
    # A follower applies what is committed a few ms after the leader answered (the commit
    # index travels with the next entry): the end of a table is read at the leader.
    cluster.create_table("ends", SCHEMA)
    leader = cluster.leader()
    follower = next(alias for alias in cluster.alive() if alias != leader)
    with session_for(cluster, first=leader) as session:
        publisher = Publisher(session, "ends")
        for first in range(0, 50, 10):
            publisher.append(frame(first, 10))
            with session_for(cluster, first=follower) as reader:
                assert reader.read("ends", 0).column("id").to_pylist() == list(range(first + 10))
                assert reader.route(table="ends") == sites(cluster, leader)[0]
    request = pb.ReadRequest(table="ends", offset_from=0, offset_to=-1, end_at_leader=True)
    with pytest.raises(grpc.RpcError) as refused:
        list(cluster.stub(follower).Read(request, timeout=10))
    metadata = dict(refused.value.trailing_metadata() or ())
    assert metadata["hastream-error"] == "NotLeader"
    assert json.loads(metadata["hastream-error-fields"])["leader"].endswith(f":{leader}")
    assert table_ids(cluster, follower, "ends") == list(range(50))  # a plain read: any node


def test_a_range_past_a_followers_rows_is_read_at_the_leader(cluster: LocalCluster) -> None:
    # An explicit range is served by any node, but a follower learns of rows a few ms after
    # their acknowledgement: an offset past the rows it holds is the leader's to answer
    # (NotLeader naming it), not an OffsetOutOfRange the rows may never deserve.
    cluster.create_table("past", SCHEMA)
    leader = cluster.leader()
    follower = next(alias for alias in cluster.alive() if alias != leader)
    with session_for(cluster, first=leader) as session:
        publisher = Publisher(session, "past")
        publisher.append(frame(0, 10))
        converged(cluster, "past", 10)
        request = pb.ReadRequest(table="past", offset_from=15, offset_to=20)
        with pytest.raises(grpc.RpcError) as redirected:
            list(cluster.stub(follower).Read(request, timeout=10))
        metadata = dict(redirected.value.trailing_metadata() or ())
        assert metadata["hastream-error"] == "NotLeader"
        assert json.loads(metadata["hastream-error-fields"])["leader"].endswith(f":{leader}")
        with pytest.raises(grpc.RpcError) as past_the_end:
            list(cluster.stub(leader).Read(request, timeout=10))
        metadata = dict(past_the_end.value.trailing_metadata() or ())
        assert metadata["hastream-error"] == "OffsetOutOfRange"
        # Rows read back right after their acknowledgement, first asked of the follower:
        # whether it has applied them yet or not, the reader gets them.
        with session_for(cluster, first=follower) as reader:
            for first in range(10, 60, 5):
                publisher.append(frame(first, 5))
                rows = reader.read("past", first, first + 5).column("id").to_pylist()
                assert rows == list(range(first, first + 5))


def connections_of_this_process(port: int) -> int:
    """This process's established TCP connections to `port` on loopback (/proc; gRPC dials
    127.0.0.1 from a dual-stack socket, listed in tcp6)."""
    ours = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            link = fd.readlink().as_posix()
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            ours.add(link[len("socket:[") : -1])
    count = 0
    tables = (Path("/proc/self/net/tcp"), Path("/proc/self/net/tcp6"))
    for line in (line for table in tables for line in table.read_text().splitlines()[1:]):
        fields = line.split()
        remote_port = int(fields[2].split(":")[1], 16)
        if remote_port == port and fields[3] == "01" and fields[9] in ours:
            count += 1
    return count


@pytest.mark.cluster
def test_sessions_dial_their_own_connections_and_reach_a_restarted_node(
    cluster: LocalCluster,
) -> None:
    alias = "node2"
    node = cluster.nodes[alias]
    site = f"127.0.0.1:{node.port}"
    with Session([site], deadline_s=3) as session, Session([site], deadline_s=3) as other:
        session.getStreamingRaftGroups()
        other.getStreamingRaftGroups()
        # Two sessions, two connections: gRPC would otherwise share one, and with it one
        # reconnect state, between every channel of the process with the same options.
        assert connections_of_this_process(node.port) == 2
        cluster.kill(alias)
        with pytest.raises(RaftStoreError):
            session.getStreamingRaftGroups()
        cluster.start_node(alias)
        # The old session's failed connect made it dial anew (api_clients/dials.py): a
        # channel made before a kill was seen failing to reach the restarted node for
        # seconds while a new one got through at once.
        assert session.getStreamingRaftGroups()
        with Session([site], deadline_s=3) as fresh:  # its own connection from the start
            assert fresh.getStreamingRaftGroups()


def test_a_stream_on_a_retired_channel_runs_on_and_closes_the_channel_when_it_ends(
    cluster: LocalCluster,
) -> None:
    """New calls leave a channel retired after a failed connect, but a subscription's
    stream already on it is not cut: it delivers until stopped, then the channel closes."""
    cluster.create_table("ticks", SCHEMA)
    leader = cluster.leader()
    site = f"127.0.0.1:{cluster.nodes[leader].port}"
    received: list[int] = []
    with Session([site], deadline_s=DEADLINE_S) as session:
        publisher = Publisher(session, "ticks")
        publisher.append(frame(0, 10))
        subscription = session.subscribe(
            "ticks",
            lambda rows: received.extend(rows.column("id").to_pylist()),
            offset=0,
            throttle=0.05,
        )
        wait_until(
            lambda: len(received) == 10, timeout_s=WAIT_S, message="the first rows delivered"
        )
        dials = session._dials
        old = dials.current(site)
        dials.retire(old)  # as after another call's failed connect
        assert dials.counts() == (0, 1)  # the stream still holds the old channel
        assert dials.current(site) is not old
        publisher.append(frame(10, 10))
        wait_until(
            lambda: len(received) == 20,
            timeout_s=WAIT_S,
            message="rows delivered on the old channel",
        )
        subscription.stop()
        wait_until(
            lambda: dials.counts() == (1, 0), timeout_s=WAIT_S, message="the old channel closed"
        )
    assert received == list(range(20))


def test_bad_rows_are_refused_before_any_network_call(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.create_table("ticks", SCHEMA)
    leader = cluster.leader()
    with session_for(cluster) as session:
        publisher = Publisher(session, "ticks")
        publisher.schema()  # Fetched once; from here on nothing bad may reach the cluster.
        writer = MultithreadedTableWriter(
            session, "ticks", batchSize=1, durableBufferDir=tmp_path / "buffer"
        )
        before = cluster.group_status(leader, 2)
        wrong_count = frame(0, 3).drop(columns=["qty"])
        wrong_type = frame(0, 3).assign(qty=["a", "b", "c"])
        wrong_arrow = pa.Table.from_pandas(frame(0, 3), preserve_index=False).set_column(
            0, "id", pa.array([1, 2, 3], pa.int32())
        )
        bad_calls = [
            (lambda: publisher.append(wrong_count), "4 columns"),
            (lambda: publisher.append(wrong_type), "qty"),
            (lambda: publisher.append(wrong_arrow), "'id' has type int32"),
            (lambda: publisher.append([(1, None, "S", 1.0)]), "row 0 has 4 values"),
            (lambda: writer.insert(1, pd.Timestamp(0), "S", 1.0), "row has 4 values"),
            (lambda: writer.insert(1, pd.Timestamp(0), "S", "1.0", 5), "'price'"),
            (lambda: writer.insert("1", pd.Timestamp(0), "S", 1.0, 5), "'id'"),
            (lambda: writer.insert(1, pd.Timestamp(0), "S", 1.0, 2**40), "'qty'"),
            (lambda: writer.insertDataFrame(wrong_type), "qty"),
        ]
        for call, message in bad_calls:
            started = time.monotonic()
            with pytest.raises(SchemaMismatch, match=message):
                call()
            assert time.monotonic() - started < 1.0  # Refused locally, not after retries.
        after = cluster.group_status(leader, 2)
        writer.waitForThreadCompletion(timeout_s=30)
        assert writer.getStatus().sentRows == 0
    assert after["entries_proposed"] == before["entries_proposed"]
    assert after["published_rows"] == before["published_rows"] == 0
    assert cluster.row_count(leader, "ticks") == 0


# -- publisher across leader kills -----------------------------------------------------


def test_publisher_rides_through_two_leader_kills_and_a_follower_restart(
    cluster: LocalCluster,
) -> None:
    """200,000 rows on an unkeyed table (so only the producer id + sequence can keep a
    retried batch from landing twice) while the leader is killed twice and a follower is
    restarted; the publisher sees no error."""
    cluster.create_table("ticks", SCHEMA)  # No key column on purpose.
    rows_total, batch_rows = 200_000, 1_000
    published = [0]
    chaos_log: list[tuple[str, int]] = []
    chaos_errors: list[BaseException] = []
    # The publisher may run ahead of the chaos by 5% at most: every fault lands mid-stream.
    gates = {fraction: threading.Event() for fraction in (0.15, 0.45, 0.75)}

    def at(fraction: float) -> None:
        wait_until(
            lambda: published[0] >= rows_total * fraction,
            timeout_s=DEADLINE_S * 3,
            message=f"publisher reached {fraction:.0%}",
        )

    def chaos() -> None:
        try:
            for fraction in (0.15, 0.45):
                victim = cluster.leader()
                at(fraction)
                cluster.kill(victim)  # While the publisher is sending.
                chaos_log.append((f"killed leader {victim}", published[0]))
                gates[fraction].set()
                at(fraction + 0.1)
                cluster.start_node(victim)
                chaos_log.append((f"restarted {victim}", published[0]))
            leader = cluster.leader()
            follower = next(alias for alias in cluster.alive() if alias != leader)
            at(0.75)
            cluster.kill(follower)
            cluster.start_node(follower)
            chaos_log.append((f"restarted follower {follower}", published[0]))
            gates[0.75].set()
        except BaseException as error:
            chaos_errors.append(error)
            for gate in gates.values():
                gate.set()

    def wait_for_chaos() -> None:
        for fraction, gate in gates.items():
            if published[0] >= rows_total * (fraction + 0.05) and not gate.is_set():
                assert gate.wait(DEADLINE_S * 3), f"chaos at {fraction:.0%} did not happen"

    chaos_thread = threading.Thread(target=chaos, name="chaos")
    chaos_thread.start()
    try:
        with session_for(cluster) as session:
            publisher = Publisher(session, "ticks", deadline_s=DEADLINE_S)
            data = pa.Table.from_pandas(frame(0, rows_total), schema=SCHEMA, preserve_index=False)
            for first in range(0, rows_total, batch_rows):
                wait_for_chaos()
                result = publisher.append(data.slice(first, batch_rows))
                assert result.row_count == batch_rows
                published[0] = first + batch_rows
    finally:
        for gate in gates.values():
            gate.set()
        chaos_thread.join(timeout=WAIT_S)
    assert not chaos_errors, chaos_errors
    assert len(chaos_log) == 5, chaos_log
    assert all(at_rows < rows_total for _, at_rows in chaos_log), chaos_log  # Mid-stream.
    leader = cluster.leader()
    assert cluster.row_count(leader, "ticks") == rows_total
    converged(cluster, "ticks", rows_total)
    acked = list(range(rows_total))
    assert_replicas_hold_exactly(cluster, "ticks", acked)
    for alias in cluster.alive():
        assert table_ids(cluster, alias, "ticks") == acked


# -- subscriber with persisted offsets ---------------------------------------------------

SUBSCRIBER = textwrap.dedent(
    """
    import json, os, signal, sys, threading
    sys.path.insert(0, sys.argv[1])
    from api_clients import Session

    sites, table, out_path = json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    offset = int(sys.argv[5])
    session = Session(sites, deadline_s=90)
    out = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(out, f"start {os.getpid()}\\n".encode())

    def handler(rows, first_offset):
        ids = rows.column("id").to_pylist()
        # One write per call: the rows are on record before the handler returns, and only
        # then may the subscription commit their offsets.
        os.write(out, "".join(f"{first_offset + i},{k}\\n" for i, k in enumerate(ids)).encode())

    subscription = session.subscribe(
        table, handler, offset=offset, actionName="audit", persistOffset=True, throttle=0.2
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.2):  # Until SIGTERM (or SIGKILL).
        if not subscription.is_alive():
            print(f"subscription ended: {subscription.error!r}", file=sys.stderr, flush=True)
            sys.exit(3)
    session.close()
    """
)


class SubscriberProcess:
    """The subscriber as its own process, so the test can kill -9 it."""

    def __init__(self, tmp_path: Path, cluster: LocalCluster, table: str) -> None:
        self.script = tmp_path / "subscriber.py"
        self.script.write_text(SUBSCRIBER)
        self.out = tmp_path / "handled.txt"
        self.cluster = cluster
        self.table = table
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, offset: int) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(self.script),
                str(REPO),
                json.dumps(sites(self.cluster)),
                self.table,
                str(self.out),
                str(offset),
            ],
            stderr=subprocess.PIPE,
        )

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def runs(self) -> list[list[tuple[int, int]]]:
        """The (offset, id) pairs handled, per run of the process (a torn last line of a
        killed run is ignored)."""
        runs: list[list[tuple[int, int]]] = []
        text = self.out.read_text() if self.out.exists() else ""
        for line in text.split("\n"):
            if line.startswith("start "):
                runs.append([])
            elif line.count(",") == 1 and all(part.isdigit() for part in line.split(",")):
                runs[-1].append((int(line.split(",")[0]), int(line.split(",")[1])))
        return runs

    def handled_through(self) -> int:
        """The highest offset handled so far, -1 before any. Fails if the process died."""
        assert self.process is not None
        if self.process.poll() is not None:
            stderr = self.process.stderr.read().decode() if self.process.stderr else ""
            raise AssertionError(f"subscriber exited {self.process.returncode}: {stderr}")
        return max((offset for run in self.runs() for offset, _ in run), default=-1)


def test_subscriber_resumes_from_persisted_offset_across_leader_kills_and_its_own_kill_9(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.create_table("ticks", SCHEMA, key_column="id")
    rows_total, batch_rows = 60_000, 500
    published = [0]
    stop_publishing = threading.Event()
    publish_errors: list[BaseException] = []

    def publish() -> None:
        try:
            with session_for(cluster) as session:
                publisher = Publisher(session, "ticks", deadline_s=DEADLINE_S)
                for first in range(0, rows_total, batch_rows):
                    publisher.append(frame(first, batch_rows))
                    published[0] = first + batch_rows
                    if stop_publishing.wait(0.02):  # Paced, so the chaos lands mid-stream.
                        return
        except BaseException as error:
            publish_errors.append(error)

    subscriber = SubscriberProcess(tmp_path, cluster, "ticks")
    subscriber.start(offset=-2)  # No persisted offset yet: from the earliest row.
    publisher_thread = threading.Thread(target=publish, name="publisher")
    publisher_thread.start()
    try:

        def handled(fraction: float) -> None:
            wait_until(
                lambda: subscriber.handled_through() >= rows_total * fraction,
                timeout_s=DEADLINE_S * 2,
                message=f"subscriber handled {fraction:.0%}",
            )

        handled(0.15)
        victim = cluster.leader()
        cluster.kill(victim)
        handled(0.3)
        cluster.start_node(victim)
        handled(0.4)
        subscriber.kill()  # kill -9 of the subscriber itself
        subscriber.start(offset=-2)  # Resumes after the offset persisted in the cluster.
        handled(0.6)
        victim = cluster.leader()
        cluster.kill(victim)
        handled(0.75)
        cluster.start_node(victim)
        publisher_thread.join(timeout=DEADLINE_S * 3)
        assert not publisher_thread.is_alive(), "publisher did not finish"
        assert not publish_errors, publish_errors
        assert published[0] == rows_total
        wait_until(
            lambda: subscriber.handled_through() == rows_total - 1,
            timeout_s=DEADLINE_S * 2,
            message="subscriber handled every row",
        )
        with session_for(cluster) as session:
            wait_until(
                lambda: session.getTopicProcessedOffset("ticks/audit") == rows_total - 1,
                timeout_s=WAIT_S,
                message="final offset persisted",
            )
    finally:
        stop_publishing.set()
        publisher_thread.join(timeout=WAIT_S)
        subscriber.stop()
    first_run, second_run = subscriber.runs()
    assert first_run
    assert second_run
    # The restart resumed from the persisted offset: not from 0, and with no gap.
    assert 0 < second_run[0][0] <= max(offset for offset, _ in first_run) + 1
    handled_pairs = first_run + second_run
    leader = cluster.leader()
    table = table_ids(cluster, leader, "ticks")
    assert len(table) == rows_total
    # At least once, none skipped: every offset handled, each with the row at that offset.
    assert {offset for offset, _ in handled_pairs} == set(range(rows_total))
    assert all(table[offset] == key for offset, key in handled_pairs)
    # Exactly once with the key column: an upsert keyed on id holds each row once.
    upserted = {key: offset for offset, key in handled_pairs}
    assert sorted(upserted) == list(range(rows_total))
    converged(cluster, "ticks", rows_total)
    assert_replicas_hold_exactly(cluster, "ticks", list(range(rows_total)))


def test_subscriber_leaves_a_frozen_leader(cluster: LocalCluster) -> None:
    """A SIGSTOPped leader keeps its TCP connections open but answers nothing: its heartbeats
    stop, as do answers to the client's keepalive pings, and the subscription moves on (to
    the leader the other nodes name, or after STREAM_IDLE_TIMEOUT_S)."""
    cluster.create_table("ticks", SCHEMA, key_column="id")
    handled: list[int] = []
    lock = threading.Lock()

    def handler(rows: pa.Table, first_offset: int) -> None:
        with lock:
            handled.extend(rows.column("id").to_pylist())

    frozen = cluster.leader()
    with session_for(cluster, first=frozen) as session:
        publisher = Publisher(session, "ticks", deadline_s=DEADLINE_S)
        publisher.append(frame(0, 1_000))
        subscription = session.subscribe(
            "ticks", handler, offset=0, actionName="frozen", persistOffset=True, throttle=0.2
        )
        wait_until(lambda: len(handled) == 1_000, timeout_s=WAIT_S, message="first rows")
        cluster.signal(frozen, signal.SIGSTOP)
        try:
            started = time.monotonic()
            publisher.append(frame(1_000, 1_000))  # Goes to the new leader once it is named.
            wait_until(
                lambda: len(handled) >= 2_000,
                timeout_s=WAIT_S,
                message="subscription moved to the new leader",
            )
            moved_s = time.monotonic() - started
        finally:
            cluster.signal(frozen, signal.SIGCONT)
        assert subscription.is_alive()
        assert subscription.connections >= 2
        subscription.stop()
    assert sorted(set(handled)) == list(range(2_000))
    assert moved_s < 45, f"took {moved_s:.1f}s to leave the frozen leader"
    converged(cluster, "ticks", 2_000)
    assert_replicas_hold_exactly(cluster, "ticks", list(range(2_000)))


# -- the writer's durable buffer -------------------------------------------------------


def test_writer_buffers_through_a_full_cluster_outage_and_delivers_in_order(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.create_table("ticks", SCHEMA)  # Unkeyed: a duplicate would show.
    outage_s = 20.0
    inserted = [0]
    stop_inserting = threading.Event()
    insert_errors: list[BaseException] = []
    session = session_for(cluster)
    writer = MultithreadedTableWriter(
        session, "ticks", batchSize=500, throttle=0.1, durableBufferDir=tmp_path / "buffer"
    )

    def insert() -> None:
        key = 0
        try:
            while not stop_inserting.wait(0.01):  # About 5,000 rows/s, row by row.
                for _ in range(50):
                    writer.insert(key, pd.Timestamp(key, unit="ms"), f"S{key % 7}", key / 2, 1)
                    key += 1
                inserted[0] = key
        except BaseException as error:
            insert_errors.append(error)

    inserter = threading.Thread(target=insert, name="inserter")
    inserter.start()
    try:
        wait_until(
            lambda: writer.getStatus().sentRows >= 5_000,
            timeout_s=WAIT_S,
            message="writer delivers",
        )
        for alias in list(cluster.nodes):
            cluster.kill(alias)
        outage_end = time.monotonic() + outage_s
        inserted_at_outage = inserted[0]
        sent_at_outage = writer.getStatus().sentRows
        wait_until(
            lambda: time.monotonic() >= outage_end,
            timeout_s=outage_s + WAIT_S,
            message="the outage lasted",
        )
        status = writer.getStatus()
        assert inserted[0] - inserted_at_outage > 10_000  # Rows kept coming during it...
        assert status.sentRows <= sent_at_outage + 1_000  # ...and stayed in the buffer.
        assert status.unsentRows >= inserted[0] - status.sentRows - 500
        buffered = status.unsentRows
        cluster.start()
        wait_until(
            lambda: writer.getStatus().sentRows >= inserted_at_outage + buffered // 2,
            timeout_s=WAIT_S,
            message="buffered rows resent",
        )
    finally:
        stop_inserting.set()
        inserter.join(timeout=WAIT_S)
    assert not insert_errors, insert_errors
    writer.waitForThreadCompletion(timeout_s=WAIT_S)
    session.close()
    status = writer.getStatus()
    total = inserted[0]
    assert (status.sentRows, status.unsentRows, status.droppedRows) == (total, 0, 0)
    assert status.errorCode == ""
    converged(cluster, "ticks", total)
    assert_replicas_hold_exactly(cluster, "ticks", list(range(total)))
    for alias in cluster.alive():
        assert table_ids(cluster, alias, "ticks") == list(range(total))  # In insert order.


WRITER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import pandas as pd
    from api_clients import MultithreadedTableWriter, Session

    sites, table, buffer_dir, mode = json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    session = Session(sites, deadline_s=90)
    writer = MultithreadedTableWriter(
        session, table, batchSize=1000, throttle=0.1, durableBufferDir=buffer_dir
    )
    if mode == "drain":
        start = writer.getStatus()
        writer.waitForThreadCompletion(timeout_s=180)
        end = writer.getStatus()
        print(json.dumps({"resentRows": start.resentRows, "sentRows": end.sentRows,
                          "duplicateBatches": end.duplicateBatches,
                          "unsentRows": end.unsentRows}), flush=True)
        sys.exit(0)
    key = 0
    while True:  # Until killed.
        ids = range(key, key + 1000)
        writer.insertDataFrame(pd.DataFrame({
            "id": pd.Series(ids, dtype="int64"),
            "ts": pd.to_datetime(list(ids), unit="ms"),
            "sym": [f"S{i % 7}" for i in ids],
            "price": [i / 2 for i in ids],
            "qty": pd.Series([1] * 1000, dtype="int32"),
        }))
        key += 1000
        print(key, flush=True)  # batchSize rows: durable in the buffer when insert returns
    """
)


def test_writer_killed_with_9_resends_unacknowledged_rows_without_duplicates(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.create_table("ticks", SCHEMA)  # Unkeyed: only the producer window can dedup.
    leader = cluster.leader()
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    buffer_dir = tmp_path / "buffer"

    def run(mode: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(REPO),
                json.dumps(sites(cluster)),
                "ticks",
                str(buffer_dir),
                mode,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )

    child = run("write")
    deadline = time.monotonic() + WAIT_S

    def durable_reaches(rows: int) -> int:
        """Reads the child's reports until `rows` rows are durable in its buffer."""
        assert child.stdout is not None
        durable = 0
        while durable < rows:
            assert time.monotonic() < deadline, "writer made no progress"
            line = child.stdout.readline()
            assert line, f"writer exited with {child.poll()}"
            durable = int(line)
        return durable

    frozen_at = durable_reaches(20_000)
    wait_until(
        lambda: cluster.row_count(leader, "ticks") > 0, timeout_s=WAIT_S, message="rows sent"
    )
    # Freeze the cluster so records pile up unacknowledged (and a send hangs in flight),
    # kill -9 the writer in the middle of inserting, then let the cluster go on.
    for alias in cluster.nodes:
        cluster.signal(alias, signal.SIGSTOP)
    try:
        durable = durable_reaches(frozen_at + 10_000)
        child.kill()
        child.wait(timeout=30)
    finally:
        for alias in cluster.nodes:
            cluster.signal(alias, signal.SIGCONT)
    with DurableBuffer(buffer_dir / "thread-0", table="ticks") as buffer:
        stats = buffer.stats()
    assert stats.pending_rows >= 10_000  # At least what was buffered while frozen.
    drain = run("drain")
    output, _ = drain.communicate(timeout=WAIT_S * 2)
    assert drain.returncode == 0, output
    report: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    assert report["resentRows"] == stats.pending_rows
    assert report["sentRows"] == stats.pending_rows  # Resent: new rows or deduplicated.
    assert report["unsentRows"] == 0
    total = cluster.row_count(cluster.leader(), "ticks")
    # Every record the buffer held arrived (1,000 rows each): all rows durable before the
    # kill, and the ones buffered after the last report...
    assert total == (stats.next_sequence - 1) * 1000
    assert total >= durable
    converged(cluster, "ticks", total)
    # ...exactly once and in order (the table is a prefix of what was inserted).
    assert_replicas_hold_exactly(cluster, "ticks", list(range(total)))
    for alias in cluster.alive():
        assert table_ids(cluster, alias, "ticks") == list(range(total))


def test_writer_refuses_rows_after_it_stopped(cluster: LocalCluster) -> None:
    cluster.create_table("ticks", SCHEMA)
    with session_for(cluster) as session:
        writer = MultithreadedTableWriter(session, "ticks", durableBufferDir=None)
        writer.insert(1, pd.Timestamp(0), "S", 1.0, 5)
        writer.waitForThreadCompletion(timeout_s=WAIT_S)
        with pytest.raises(WriterStopped):
            writer.insert(2, pd.Timestamp(0), "S", 1.0, 5)
    assert cluster.row_count(cluster.leader(), "ticks") == 1


def test_a_buffered_record_refused_for_good_blocks_until_the_caller_moves_it_aside(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.create_table("ticks", SCHEMA)
    buffer_dir = tmp_path / "buffer"
    other = pa.schema([("id", pa.int64()), ("note", pa.string())])
    with session_for(cluster) as session:
        publisher = Publisher(session, "ticks", durable_buffer_dir=buffer_dir)
        assert publisher.append(frame(0, 10)).acknowledged
        # The table is re-created with another schema under the publisher's feet: its next
        # record (checked against the schema it knew) is refused by the cluster for good.
        session.dropStreamTable("ticks", force=True)
        cluster.create_table("ticks", other)
        with pytest.raises(SchemaMismatch):
            publisher.append(frame(10, 5))
        # The refused record stays first in line: a good record behind it waits.
        good = pa.table({"id": pa.array([100, 101], pa.int64()), "note": ["a", "b"]})
        with pytest.raises(SchemaMismatch):
            publisher.append(good)
        assert publisher.buffer_stats().pending_records == 2
        assert cluster.row_count(cluster.leader(), "ticks") == 0

        path = publisher.reject_buffered_head()
        assert path is not None
        assert path.parent == buffer_dir / "rejected"
        kept = pa.ipc.open_stream(path.read_bytes()).read_all()
        assert kept.column("id").to_pylist() == list(range(10, 15))
        note = json.loads(path.with_suffix(".json").read_text())
        assert note["row_count"] == 5
        assert note["reason"].startswith("SchemaMismatch")

        assert publisher.flush() == 0
        stats = publisher.buffer_stats()
        assert (stats.rejected_records, stats.rejected_rows) == (1, 5)
        publisher.close()
    converged(cluster, "ticks", 2)
    assert table_ids(cluster, cluster.leader(), "ticks") == [100, 101]
    reopened = DurableBuffer(buffer_dir, table="ticks")
    try:
        assert reopened.stats().rejected_records == 1
        assert reopened.stats().pending_records == 0
    finally:
        reopened.close()


def test_publisher_follows_a_table_re_created_with_another_schema(cluster: LocalCluster) -> None:
    cluster.create_table("ticks", SCHEMA)
    other = pa.schema([("id", pa.int64()), ("note", pa.string())])
    with session_for(cluster) as session:
        publisher = Publisher(session, "ticks", deadline_s=DEADLINE_S)
        publisher.append(frame(0, 3))
        session.dropStreamTable("ticks", force=True)
        cluster.create_table("ticks", other)
        # Rows of the new schema: the schema the publisher fetched before is stale, so it
        # looks again before refusing them.
        result = publisher.append(pa.table({"id": [10, 11], "note": ["a", "b"]}, other))
        assert (result.first_offset, result.row_count) == (0, 2)
        # Rows of the old schema are refused locally, with nothing sent.
        with pytest.raises(SchemaMismatch):
            publisher.append(frame(20, 1))
    converged(cluster, "ticks", 2)
    assert table_ids(cluster, cluster.leader(), "ticks") == [10, 11]
