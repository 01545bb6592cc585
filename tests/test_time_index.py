"""Start by time on a real three-node cluster: every stored batch keeps the time its leader
stamped it; `offsetForTime` finds the first row stamped at or after a time (the same after
every node restarted, the index rebuilt from the data files), `subscribe(startTime=...)`
starts there, and `read(includeMetadata=True)` gives each row's offset and stamp."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from api_clients import Publisher, Session
from api_clients.times import epoch_ms
from hastream.errors import InvalidArgument
from tests.harness import LocalCluster, wait_until

pytestmark = pytest.mark.cluster

SCHEMA = pa.schema([("id", pa.int64()), ("sym", pa.string())])
BATCHES = 4
ROWS_PER_BATCH = 50


def _rows(first: int) -> pa.Table:
    ids = range(first, first + ROWS_PER_BATCH)
    return pa.table({"id": list(ids), "sym": [f"s{i % 5}" for i in ids]}, schema=SCHEMA)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _next_ms(after: int) -> int:
    """A wall-clock ms strictly after `after` (polled: the clock moves on by itself)."""
    wait_until(lambda: _now_ms() > after, timeout_s=5, interval_s=0.001, message="the clock")
    return _now_ms()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path / "cluster").start()
    yield cluster
    cluster.stop()


def _session(cluster: LocalCluster) -> Session:
    return Session([f"127.0.0.1:{node.port}" for node in cluster.nodes.values()], deadline_s=60)


def test_start_by_time_finds_each_batch_and_survives_restarting_every_node(
    cluster: LocalCluster,
) -> None:
    # Batches published with a clock tick between them: times[i] lies after batch i-1's
    # stamp and at or before batch i's.
    times: list[int] = []
    with _session(cluster) as session:
        session.haStreamTable(2, SCHEMA, "T", 1000)
        publisher = Publisher(session, "T")
        last = _now_ms()
        for batch in range(BATCHES):
            times.append(_next_ms(last))
            publisher.append(_rows(batch * ROWS_PER_BATCH))
            last = _now_ms()
        for batch, at in enumerate(times):
            answer = session.offsetForTime("T", at)
            assert (answer.found, answer.offset) == (True, batch * ROWS_PER_BATCH), batch
            assert answer.timestamp_ms >= at
        assert session.offsetForTime("T", 0).offset == 0, "before everything: the first row"
        later = session.offsetForTime("T", _next_ms(last) + 60_000)
        assert (later.found, later.offset, later.timestamp_ms) == (False, 200, -1)
        as_datetime = datetime.datetime.fromtimestamp(times[2] / 1000, tz=datetime.UTC)
        assert session.offsetForTime("T", as_datetime).offset == 2 * ROWS_PER_BATCH

        data = session.read("T", 0, includeMetadata=True)
        assert data.column("_offset").to_pylist() == list(range(BATCHES * ROWS_PER_BATCH))
        stamps = [epoch_ms(t, "t") for t in data.column("_ingest_time").to_pylist()]
        for batch in range(BATCHES):
            chunk = stamps[batch * ROWS_PER_BATCH : (batch + 1) * ROWS_PER_BATCH]
            assert len(set(chunk)) == 1, "one publish, one stamp"
            assert chunk[0] >= times[batch]
        assert data.schema.names == ["id", "sym", "_offset", "_ingest_time"]

    for alias in sorted(cluster.nodes):  # the index lives in memory: rebuilt at start
        cluster.terminate(alias)
    for alias in sorted(cluster.nodes):
        cluster.start_node(alias, wait=False)
    cluster.leader(2)
    with _session(cluster) as session:
        for batch, at in enumerate(times):
            assert session.offsetForTime("T", at).offset == batch * ROWS_PER_BATCH, batch


def test_a_subscription_from_a_time_gets_the_rows_stamped_from_then_on(
    cluster: LocalCluster,
) -> None:
    with _session(cluster) as session:
        session.haStreamTable(2, SCHEMA, "S", 1000)
        publisher = Publisher(session, "S")
        publisher.append(_rows(0))
        start = _next_ms(_now_ms())
        publisher.append(_rows(ROWS_PER_BATCH))
        with pytest.raises(InvalidArgument, match="startTime"):
            session.subscribe("S", lambda msg: None, offset=0, startTime=start)
        with pytest.raises(InvalidArgument, match="startTime"):
            session.subscribe("S", lambda msg: None, startTime="yesterday")
        received: list[int] = []
        lock = threading.Lock()

        def handler(message: pa.Table) -> None:
            with lock:
                received.extend(message.column("id").to_pylist())

        session.subscribe("S", handler, actionName="since", startTime=start)
        publisher.append(_rows(2 * ROWS_PER_BATCH))
        expected = list(range(ROWS_PER_BATCH, 3 * ROWS_PER_BATCH))
        wait_until(lambda: len(received) >= len(expected), timeout_s=30, message="rows")
        session.unsubscribe("S", "since")
        assert received == expected
