"""The in-process test tier of the node's shell: one group (applier, local replica, group
commit, group) built exactly as node.py builds the node-local group, in a tmp dir, with
real files. Restart = close and build again on the same directories."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from hastream.errors import RaftStoreError
from hastream.model import LOCAL_GROUP, NodeAddress
from raftstore import commands
from raftstore.apply import REPAIR_DIR, Applier, ApplierSettings
from raftstore.batcher import Batcher
from raftstore.catch_up import FetchRecords, Repairer
from raftstore.group import Group, GroupSettings, Member
from raftstore.local_replica import LOCAL_ADDRESS, LocalReplica
from raftstore.replica import RoleSignal
from raftstore.retention import Retention
from raftstore.storage.files import REAL_FILES, Files, PowerLoss, SimFiles
from raftstore.storage.segments import DataRecord
from raftstore.threads import Threads
from tests.harness import wait_until

SELF = NodeAddress("127.0.0.1", 1, "self")


def _no_peers(*_: Any) -> Iterator[DataRecord]:
    raise AssertionError("this shell has no peers")


@dataclass
class Shell:
    root: Path
    fetch: FetchRecords = _no_peers
    peers: Sequence[NodeAddress] = ()
    checkpoint_interval_s: float = 3600.0
    files: Files = REAL_FILES
    group: Group | None = None
    # The threads' owner, as Node's (a restart builds the group again on the same owner).
    threads: Threads = field(default_factory=Threads)
    seal_key: bytes | None = None  # the seals' key (checked_payload.py), a node's has one

    def start(self) -> Shell:
        data_dir = self.root / "persistence" / "local"
        role = RoleSignal()
        repairer = Repairer(
            LOCAL_GROUP,
            data_dir / REPAIR_DIR,
            self.fetch,
            self.peers,
            spawn=self.threads.start,
            files=self.files,
        )
        settings = ApplierSettings(
            group_id=LOCAL_GROUP, data_dir=data_dir, files=self.files, seal_key=self.seal_key
        )
        applier = Applier(settings, repairer, Retention())
        replica = LocalReplica(
            self.root / "raftlog" / "local",
            applier,
            role,
            self.checkpoint_interval_s,
            spawn=self.threads.start,
            files=self.files,
        )
        batcher = Batcher(LOCAL_GROUP, replica.propose, spawn=self.threads.start)
        group_settings = GroupSettings(
            group_id=LOCAL_GROUP,
            data_dir=data_dir,
            self_address=SELF,
            members={LOCAL_ADDRESS: Member(address=SELF, advertised=SELF)},
        )
        self.group = Group(group_settings, applier, replica, role, batcher)
        group = self.group
        wait_until(group.ready, timeout_s=30, message="replayed")
        return self

    def stop(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.threads.join(10.0)

    def restart(self) -> None:
        self.stop()
        self.start()

    def crash(self, *, torn: bool = False) -> None:
        """Lose power (SimFiles only): everything not fsynced is gone, file data and
        directory entries alike; the threads stop without writing anything more; then start
        again on what survived."""
        files = self.files
        assert isinstance(files, SimFiles), "crash needs the simulated disk"
        files.crash_at(0, torn=torn)
        with contextlib.suppress(PowerLoss):
            files.listdir(self.root)  # the power goes here; every later call raises
        group = self.g
        self.group = None
        for close in (group._batcher.close, group._replica.close, group.applier.close):
            with contextlib.suppress(PowerLoss, OSError):
                close()
        files.restart()
        self.start()

    @property
    def g(self) -> Group:
        assert self.group is not None, "shell not started"
        return self.group

    # --- operations as a client would do them ---

    def create(self, table: str, schema: pa.Schema, key_column: str | None = None) -> None:
        self.g.create_table(
            commands.CreateTable(
                table=table,
                schema_ipc=schema.serialize().to_pybytes(),
                cache_limit=1000,
                key_column=key_column,
                retention_minutes=1440,
            )
        )

    def publish(
        self, table: str, rows: pa.Table, producer_id: bytes = b"", sequence: int = 0
    ) -> tuple[int, int]:
        """(rows kept, rows dropped as duplicates)."""
        _, result = self.g.publish(
            commands.AppendItem(
                table=table, producer_id=producer_id, sequence=sequence, payload=ipc(rows)
            )
        )
        return result.row_count, result.duplicates

    def rows(self, table: str) -> pa.Table:
        store = self.g.store(table)
        slices = store.read(store.earliest_offset, store.row_count, store.row_count + 1)
        batches = [rows.batch for rows in slices]
        if not batches:
            return store.meta.schema.empty_table()
        return pa.Table.from_batches(batches, schema=store.meta.schema)

    def checkpoint(self) -> None:
        """Ask for a checkpoint and wait until it is written."""
        applier = self.g.applier
        if self.g.status()["last_applied"] == 0:
            return  # nothing applied: nothing to checkpoint
        before = applier.checkpoints_written
        self.g.request_checkpoint()
        wait_until(lambda: applier.checkpoints_written > before, timeout_s=10, message="checkpoint")


def fetch_from(shells: dict[NodeAddress, Shell]) -> FetchRecords:
    """A repair's fetch from other shells (their stores, in process: no network)."""

    def fetch(
        peer: NodeAddress,
        group_id: int,
        table: str,
        offset_from: int,
        offset_to: int,
        created_lsn: int,
    ) -> Iterator[DataRecord]:
        shells[peer].g.applier.check_incarnation(table, created_lsn)
        store = shells[peer].g.store(table)
        yield from store.records(offset_from, offset_to)

    return fetch


def ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    payload: bytes = sink.getvalue().to_pybytes()
    return payload


def raises(call: Any, *args: Any, **kwargs: Any) -> RaftStoreError | None:
    """The typed error `call` raised, or None."""
    try:
        call(*args, **kwargs)
    except RaftStoreError as error:
        return error
    return None
