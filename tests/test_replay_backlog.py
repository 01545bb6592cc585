"""A member restarted with a long log past its checkpoint, most of it no longer held in
memory, replays it reading each entry back from the journal file once.

Before: every tick read all committed, unapplied entries (up to APPLY_ENTRIES_MAX) back
from the file, then applied only what fit in APPLY_SLICE_S; a node restarted with 250 MB of
log past its checkpoint applied two entries a tick and was not ready a minute later. A real
Raft member in this process, with a real journal; the limits are lowered so that a few MB
of log are mostly out of memory and a tick's slice ends after a few entries."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hastream.errors import RaftStoreError
from raftstore import limits, replication
from raftstore.replica import RoleSignal
from raftstore.replication import RaftReplica, RaftSettings
from raftstore.storage.journal import DurableJournal
from tests.harness import free_ports, wait_until
from tests.raft_members import RecordingHooks

ENTRIES = 400
COMMAND_BYTES = 8 * 1024


def _settings(directory: Path, address: str) -> RaftSettings:
    return RaftSettings(
        group_id=2,
        self_address=address,
        peer_addresses=(),  # a group of one: its own majority
        directory=directory,
        secret="replay-backlog-test",
        election_timeout_s=0.5,
        checkpoint_interval_s=3600.0,  # no checkpoint: the restart replays the whole log
    )


def _write_log(settings: RaftSettings) -> list[bytes]:
    hooks = RecordingHooks()
    replica = RaftReplica(settings, hooks, RoleSignal())
    try:
        wait_until(replica.is_leader_ready, timeout_s=30, message="a group of one leads")
        commands = [i.to_bytes(4, "big") * (COMMAND_BYTES // 4) for i in range(ENTRIES)]
        answered = threading.Semaphore(0)
        errors: list[RaftStoreError] = []

        def done(result: Any, error: RaftStoreError | None) -> None:
            if error is not None:
                errors.append(error)
            answered.release()

        for command in commands:
            replica.propose(command, done)
        for _ in commands:
            assert answered.acquire(timeout=30), "a proposal was not answered"
        assert not errors, errors[:3]
        proposed = set(commands)
        return [applied for applied in hooks.applied if applied in proposed]
    finally:
        replica.close()


def _count_read_back(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The command bytes of every read back from a journal file from now on."""
    read_back: list[int] = []
    real_read_back = DurableJournal._read_back

    def counted(self: DurableJournal, first: int, stop: int) -> list[bytes]:
        commands = real_read_back(self, first, stop)
        read_back.append(sum(len(command) for command in commands))
        return commands

    monkeypatch.setattr(DurableJournal, "_read_back", counted)
    return read_back


def test_a_restarted_member_reads_its_backlog_back_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings(tmp_path / "member", f"127.0.0.1:{free_ports(1)[0]}")
    written = _write_log(settings)
    assert len(written) == ENTRIES

    # On the restart: the journal keeps 64 KiB of commands in memory (the rest is read
    # back), a tick applies for 1 ms, and reads 64 KiB at a time.
    monkeypatch.setattr(limits, "RAFT_LOG_RESIDENT_BYTES", 64 * 1024)
    monkeypatch.setattr(limits, "APPLY_SLICE_S", 0.001)
    monkeypatch.setattr(limits, "APPLY_READ_BYTES_MAX", 64 * 1024)
    read_back = _count_read_back(monkeypatch)
    hooks = RecordingHooks()

    def replayed() -> list[bytes]:
        return [applied for applied in hooks.applied if len(applied) == COMMAND_BYTES]

    replica = RaftReplica(settings, hooks, RoleSignal())
    try:
        wait_until(
            lambda: len(replayed()) >= ENTRIES, timeout_s=60, interval_s=0.02, message="replayed"
        )
        assert replayed() == written  # every entry, once, in order
        journal = replica._sync_obj._journal
        log_bytes = journal.command_bytes(journal.index_at(0), len(journal))
        assert log_bytes >= ENTRIES * COMMAND_BYTES
        assert sum(read_back) > log_bytes // 2, "the backlog was mostly out of memory"
        assert sum(read_back) <= log_bytes, f"read back {sum(read_back):,} of {log_bytes:,} B"
    finally:
        replica.close()


def test_the_term_before_a_lagging_followers_next_entry_is_read_without_its_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the leader sends a follower that lags far behind starts with the term of the
    entry before the first it sends; pysyncobj read that whole entry for it, from the
    journal file once out of memory, on every send."""
    settings = _settings(tmp_path / "member", f"127.0.0.1:{free_ports(1)[0]}")
    _write_log(settings)
    monkeypatch.setattr(limits, "RAFT_LOG_RESIDENT_BYTES", 64 * 1024)
    replica = RaftReplica(settings, RecordingHooks(), RoleSignal())
    try:
        wait_until(replica.replayed, timeout_s=60, interval_s=0.02, message="the log replayed")
        sync_obj = replica._sync_obj
        first = sync_obj._journal.index_at(0)
        read_back = _count_read_back(monkeypatch)
        with sync_obj._tick_lock:
            found = sync_obj._SyncObj__getPrevLogIndexTerm(first + 11)
            entries = sync_obj._SyncObj__getEntries(first + 10, 1)  # the same, read whole
        assert found == (first + 10, entries[0][2])
        assert len(read_back) == 1, "only the whole entry's read went to the file"
        with sync_obj._tick_lock:
            assert sync_obj._SyncObj__getPrevLogIndexTerm(first) == (None, None)  # before the log
    finally:
        replica.close()


class _Member:
    """The parts of a Raft member `_entries_to_apply` uses, around a real journal on real
    files that holds 64 bytes of commands in memory (so most are read back): its real
    `_SyncObj__getEntries`, wrapped to note the index of every entry it returns."""

    def __init__(self, directory: Path, commands: list[bytes]) -> None:
        self._journal = DurableJournal(
            directory, resident_bytes_max=64, segment_bytes_max=4096, kernel_syncs=False
        )
        for index, command in enumerate(commands, start=1):
            self._journal.append(command, index, 1)
        self._log_view_end: int | None = None
        self._read_ahead: list[Any] = []
        self.read: list[int] = []

    def _SyncObj__getEntries(self, first: int, count: int, bytes_max: int) -> list[Any]:
        entries = replication._SyncObj._SyncObj__getEntries(self, first, count, bytes_max)
        self.read += [entry[1] for entry in entries]
        return entries

    _entries_to_apply = replication._SyncObj._entries_to_apply

    def close(self) -> None:
        self._journal.close()


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=60),
    ticks=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 20)), min_size=1, max_size=40),
    read_bytes=st.integers(1, 100),
)
def test_ticks_that_apply_part_of_what_they_read_get_every_entry_once_in_order(
    sizes: list[int], ticks: list[tuple[int, int]], read_bytes: int
) -> None:
    """Each tick asks for up to `count` entries after the last applied and applies `budget`
    of them (its slice ends); against the commands written: the entries come in log order,
    each applied once, and none is read from the journal twice."""
    commands = [bytes([index % 256]) * size for index, size in enumerate(sizes, start=1)]
    applied: list[Any] = []
    with tempfile.TemporaryDirectory() as directory, pytest.MonkeyPatch.context() as patch:
        patch.setattr(limits, "APPLY_READ_BYTES_MAX", read_bytes)
        member = _Member(Path(directory), commands)
        try:
            for count, budget in ticks:
                count = min(count, len(sizes) - len(applied))
                if count == 0:
                    break
                for entry in member._entries_to_apply(len(applied) + 1, count):
                    if budget == 0:
                        break  # the slice is over: this entry waits for the next tick
                    applied.append(entry)
                    budget -= 1
        finally:
            member.close()
    written = [(command, index, 1) for index, command in enumerate(commands, start=1)]
    assert applied == written[: len(applied)]
    assert len(set(member.read)) == len(member.read), "an entry read twice"
