"""The asyncio client (`api_clients.aio`) against a real cluster: tables, appends retried
without duplicates, reads, a subscription that rides through a leader kill, and logins."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow as pa
import pytest

from api_clients import aio
from hastream.errors import (
    PermissionDenied,
    RaftStoreError,
    SchemaMismatch,
    TableNotFound,
    Unauthenticated,
)
from hastream.model import OFFSET_EARLIEST
from proto import hastream_pb2 as pb
from tests.harness import LocalCluster, assert_replicas_hold_exactly

SCHEMA = pa.schema([("id", pa.int64()), ("sym", pa.string())])

pytestmark = pytest.mark.cluster


def rows(first: int, count: int) -> pa.Table:
    ids = list(range(first, first + count))
    return pa.table({"id": ids, "sym": [f"s{i}" for i in ids]}, schema=SCHEMA)


def test_tables_appends_reads_and_a_subscription_through_a_leader_kill(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster")
    cluster.start()
    sites = [node.site for node in cluster.nodes.values()]

    async def scenario() -> list[int]:
        host, port = sites[0].split(":")
        async with await aio.connect(host, int(port), highAvailabilitySites=sites[1:]) as session:
            with pytest.raises(TableNotFound):
                await session.getTableInfo("absent")
            info = await session.haStreamTable(2, SCHEMA, "aio_t", 10_000, keyColumn="id")
            assert info.raft_group == 2
            received: list[int] = []

            async def consume() -> None:
                async for first, table in session.subscribe("aio_t", offset=OFFSET_EARLIEST):
                    assert first == len(received)  # gap-free, in order
                    received.extend(table.column("id").to_pylist())
                    if len(received) >= 600:
                        return

            consumer = asyncio.create_task(consume())
            result = await session.append("aio_t", rows(0, 200))
            assert (result.first_offset, result.row_count) == (0, 200)
            again = await session.append("aio_t", rows(150, 100))  # 150..199 are known keys
            assert (again.row_count, again.duplicates) == (50, 50)
            leader = cluster.leader()
            cluster.kill(leader)
            await session.append("aio_t", rows(250, 350))  # follows the new leader
            await asyncio.wait_for(consumer, timeout=60)
            assert received == list(range(600))
            table = await session.read("aio_t", 0)
            assert table.column("id").to_pylist() == list(range(600))
            # Another session, first at a follower: the end is the leader's (the follower
            # learns of the newest rows a few ms after their acknowledgement).
            await session.append("aio_t", rows(600, 10))
            follower = next(alias for alias in cluster.alive() if alias != cluster.leader())
            host, port = cluster.nodes[follower].site.split(":")
            async with await aio.connect(host, int(port), highAvailabilitySites=sites) as other:
                assert (await other.read("aio_t", 0)).num_rows == 610
                tail = await other.read("aio_t", 605, 610)
                assert tail.column("id").to_pylist() == list(range(605, 610))
            cluster.start_node(leader)
            return received

    try:
        acked = asyncio.run(scenario())
        assert_replicas_hold_exactly(cluster, "aio_t", acked)
    finally:
        cluster.stop()


def test_logins_and_grants_apply_to_the_asyncio_client(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster")
    cluster.enable_authentication("aio-admin-password")
    cluster.start()
    cluster.create_table("aio_secure", SCHEMA)
    sites = [node.site for node in cluster.nodes.values()]
    host, port = sites[0].split(":")

    async def scenario() -> None:
        with pytest.raises(Unauthenticated):
            await aio.connect(host, int(port), "admin", "wrong-password", sites[1:])
        async with await aio.connect(
            host, int(port), "admin", "aio-admin-password", sites[1:]
        ) as admin:
            await admin.append("aio_secure", rows(0, 10))
            await admin.createUser("reader", "reader-password")
            await admin.grant("reader", "TABLE_READ", "aio_secure")
            await admin.createUser("passerby", "passerby-password")
            assert sorted(await admin.getUserList()) == ["admin", "passerby", "reader"]
            await admin.deleteUser("passerby")
            # Answered by the node that took the delete (the session's preferred site).
            access = {entry["user"]: entry for entry in await admin.getUserAccess()}
            assert set(access) == {"admin", "reader"}
        anonymous = aio.AioSession(sites)
        with pytest.raises(Unauthenticated):
            await anonymous.getTableInfo("aio_secure")
        await anonymous.close()
        async with await aio.connect(
            host, int(port), "reader", "reader-password", sites[1:]
        ) as reader:
            assert (await reader.read("aio_secure", 0)).num_rows == 10
            with pytest.raises(PermissionDenied):
                await reader.append("aio_secure", rows(10, 10))
            assert (await reader.getTableInfo("aio_secure")).row_count == 10

    try:
        asyncio.run(scenario())
    finally:
        cluster.stop()


def test_an_append_follows_a_table_created_again_with_another_schema(tmp_path: Path) -> None:
    """A session remembers a table's schema; another client drops the table and creates it
    again with other column types. Data that fits the new schema is appended once (after the
    cluster refused the first try, or the remembered schema refused the data); data that
    does not raises SchemaMismatch, with nothing appended."""
    cluster = LocalCluster(tmp_path / "cluster")
    cluster.start()
    sites = [node.site for node in cluster.nodes.values()]
    narrow = pa.schema([("id", pa.int64()), ("qty", pa.int32())])
    wide = pa.schema([("id", pa.int64()), ("qty", pa.int64())])
    with_sym = pa.schema([("id", pa.int64()), ("qty", pa.int64()), ("sym", pa.string())])

    async def scenario() -> list[int]:
        async with aio.AioSession(sites) as session, aio.AioSession(sites) as other:
            await session.haStreamTable(2, narrow, "aio_again", 10_000)
            await session.append("aio_again", [(0, 1), (1, 2)])  # the schema is remembered

            async def create_again(schema: pa.Schema) -> None:
                await other.dropStreamTable("aio_again")
                await other.haStreamTable(2, schema, "aio_again", 10_000)

            # Row tuples fit both: the remembered int32 schema converts them, the cluster
            # refuses the request for its schema, and the fresh one is used.
            await create_again(wide)
            result = await session.append("aio_again", [(10, 2)])
            assert (result.first_offset, result.row_count) == (0, 1)
            # A pyarrow table of the new schema does not fit the remembered one.
            await create_again(with_sym)
            sym_rows = pa.table({"id": [11], "qty": [5], "sym": ["a"]}, schema=with_sym)
            result = await session.append("aio_again", sym_rows)
            assert (result.first_offset, result.row_count) == (0, 1)
            with pytest.raises(SchemaMismatch):  # the old shape, against the fresh schema
                await session.append("aio_again", [(12, 3)])
            await session.append("aio_again", [(12, 3, "b")])
            table = await session.read("aio_again", 0)
            assert table.schema.equals(with_sym)
            ids: list[int] = table.column("id").to_pylist()
            return ids

    try:
        acked = asyncio.run(scenario())
        assert acked == [11, 12]
        assert_replicas_hold_exactly(cluster, "aio_again", acked)
    finally:
        cluster.stop()


def test_a_session_remembers_at_most_tables_remembered_max_tables() -> None:
    memory: dict[str, int] = {}
    for number in range(aio.TABLES_REMEMBERED_MAX + 5):
        aio._remember(memory, f"t{number}", number)
    assert len(memory) == aio.TABLES_REMEMBERED_MAX
    assert "t0" not in memory  # the oldest went first
    aio._remember(memory, "t5", -1)  # remembered again: now the newest
    aio._remember(memory, "extra", 0)
    assert "t5" in memory
    assert "t6" not in memory


def test_a_session_dials_anew_after_a_failed_connect_to_a_restarted_node(
    tmp_path: Path,
) -> None:
    """A node killed and restarted: a session's calls to it dial a new channel once a
    connect failed (api_clients/dials.py) and reach it again; another session's
    subscription and appends run on meanwhile."""
    cluster = LocalCluster(tmp_path / "cluster")
    cluster.start()
    leader = cluster.leader()
    follower = next(alias for alias in cluster.nodes if alias != leader)
    site = cluster.nodes[follower].site

    async def scenario() -> list[int]:
        host, port = cluster.nodes[leader].site.split(":")
        sites = [node.site for node in cluster.nodes.values()]
        async with await aio.connect(host, int(port), highAvailabilitySites=sites) as session:
            await session.haStreamTable(2, SCHEMA, "aio_r", 10_000, keyColumn="id")
            received: list[int] = []

            async def consume() -> None:
                async for _, table in session.subscribe("aio_r", offset=OFFSET_EARLIEST):
                    received.extend(table.column("id").to_pylist())
                    if len(received) >= 20:
                        return

            consumer = asyncio.create_task(consume())
            await session.append("aio_r", rows(0, 10))
            pinned = aio.AioSession([site], deadline_s=3)
            before = pinned._dials.current(site)
            await pinned.call("GetStreamingRaftGroups", pb.Empty())
            cluster.kill(follower)
            with pytest.raises(RaftStoreError):
                await pinned.call("GetStreamingRaftGroups", pb.Empty())
            assert pinned._dials.current(site) is not before  # a failed connect: dialled anew
            cluster.start_node(follower)
            await pinned.call("GetStreamingRaftGroups", pb.Empty())
            await pinned.close()
            await session.append("aio_r", rows(10, 10))
            await asyncio.wait_for(consumer, timeout=60)
            return received

    try:
        assert asyncio.run(scenario()) == list(range(20))
    finally:
        cluster.stop()
