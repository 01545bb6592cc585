"""bench.lean_core's three processes replicate what its publisher sends: every node's
journal ends up with the same entries, the bare core's data files with the same rows, and a
publish of the wrong schema is refused with nothing written. (The NATS side of the
benchmark is bench.vs_nats's, tested in test_bench_vs_nats.py.)"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from bench.lean_core import LEAN_SYSTEMS, LeanPublisher, lean_cluster
from bench.publish_rows import RowPool, one_row
from tests.harness import wait_until

pytestmark = pytest.mark.cluster


def _same_bytes(paths: list[Path]) -> bool:
    contents = [path.read_bytes() for path in paths]
    return bool(contents[0]) and all(content == contents[0] for content in contents)


@pytest.mark.parametrize("apply", sorted(LEAN_SYSTEMS.values()))
def test_every_node_holds_every_acknowledged_publish(apply: str) -> None:
    pool = RowPool.make(1_000)
    with lean_cluster(apply) as cluster:
        publisher = LeanPublisher(cluster.leader_port, window=8)
        try:
            for number in range(20):
                publisher.append(one_row(number))
            for number in range(30):
                publisher.append_async(pool.table(number * 100, 100))
            assert publisher.flush() == 0
            wrong = pa.table({"id": ["x"], "v1": [1.5]})
            publisher.append(wrong)
            assert publisher.flush() == 1  # refused, answered, nothing proposed
            publisher.append(one_row(99))
            assert publisher.flush() == 1
        finally:
            publisher.close()
        nodes = [cluster.root / f"node{node}" for node in range(3)]
        journals = [node / "journal" for node in nodes]
        wait_until(lambda: _same_bytes(journals), timeout_s=10, message="journals agree")
        entries = 51 + (1 if apply == "product" else 0)  # the product's entry 1 creates the table
        if apply == "bytes":
            data = [node / "data" for node in nodes]
            # The followers apply on the next frame or the commit notice 10 ms later.
            wait_until(lambda: _same_bytes(data), timeout_s=10, message="data files agree")
        assert entries == _journal_entries(journals[0])


def _journal_entries(path: Path) -> int:
    """The records of a lean journal: length, crc32, index, payload."""
    raw, at, count = path.read_bytes(), 0, 0
    while at < len(raw):
        length = int.from_bytes(raw[at : at + 4], "little")
        at += 16 + length
        count += 1
    return count
