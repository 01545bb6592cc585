"""Repair: fetching the rows a replica lacks from its peers, into a side directory.

A replica lacks rows when a checkpoint restored a state ahead of its data files (a leader
installed its checkpoint on a lagging follower) or when damage moved a table's files aside.
The applier (apply.py) then hands the gaps to the `Repairer`, stops applying, and keeps
serving nothing from the group until the repair is swapped in.

One owner, one job at a time: `start` cancels a running job (a second checkpoint install
arrives while the first repair runs) and the new one starts from what is durable. The job's
thread writes only under `side_root`; the live data files belong to the applier's thread,
which swaps the fetched segments in (`take_outcome`, then `apply.Applier._swap_in`). So a
restore can close and reopen the live stores at any time without racing a fetch.

A fetched record must be the next one (`first_offset`), end within the gap and come from an
entry at or before the state it completes (`lsn_max`); anything else is a PeerProtocolError
and the next peer is tried. The side directory is then reopened, which checks every record's
CRC and the offset chain, before the job reports it done.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from hastream.errors import (
    CorruptionError,
    IncarnationDropped,
    OffsetOutOfRange,
    PeerProtocolError,
    RaftStoreError,
)
from hastream.model import NodeAddress
from raftstore import limits
from raftstore.health import RepairProgress
from raftstore.storage.files import REAL_FILES, Files
from raftstore.storage.segments import DataRecord, TableLog
from raftstore.threads import Spawn

log = logging.getLogger(__name__)

# Records of table incarnation (table, created_lsn) [offset_from, offset_to) from a peer, as
# the peer stores them: (peer, group_id, table, offset_from, offset_to, created_lsn). Raises
# IncarnationDropped when the peer has applied the incarnation's drop.
FetchRecords = Callable[[NodeAddress, int, str, int, int, int], Iterator[DataRecord]]

# A round over every peer that fetched nothing waits this long before the next.
_RETRY_S: Final = 0.5
# A job that failed on this node's disk tries again after a backoff up to this long.
_DISK_RETRY_MAX_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class TableGap:
    """Rows `[offset_from, offset_to)` of table incarnation `(table, created_lsn)`, all
    written by entries at or before `lsn_max`. `restartable`: the live store holds no rows,
    so when every peer's retention removed the rows before some offset, the replica may
    start the table there instead."""

    table: str
    created_lsn: int
    offset_from: int
    offset_to: int
    lsn_max: int
    restartable: bool


@dataclass(frozen=True, slots=True)
class FetchedTable:
    """The rows of `gap`, fetched, synced and verified in `directory`, starting at
    `first_offset` (gap.offset_from, or later when peers' retention forced a restart).
    `dropped`: a peer has applied the drop of this incarnation, so nothing was fetched (no
    node may still hold the rows; this replica's own replay of that committed drop is
    coming) and `directory` is empty."""

    gap: TableGap
    directory: Path
    first_offset: int
    dropped: bool = False


@dataclass(frozen=True, slots=True)
class RepairOutcome:
    generation: int
    tables: tuple[FetchedTable, ...]


class _Cancelled(Exception):
    pass


class Repairer:
    """Runs one repair job at a time, each in a thread started through `spawn` (the node's
    threads.Threads, which forgets finished jobs). `start`, `cancel` and `take_outcome` are
    called from the applier's thread; `progress` from any thread."""

    def __init__(
        self,
        group_id: int,
        side_root: Path,
        fetch: FetchRecords,
        peers: Sequence[NodeAddress],
        *,
        spawn: Spawn,
        deadline_s: float = limits.REPAIR_DEADLINE_S,
        files: Files = REAL_FILES,
    ) -> None:
        self._group_id = group_id
        self._files = files
        self._side_root = side_root
        self._fetch = fetch
        self._peers = tuple(peers)
        # When each peer last failed a fetch (any job's): asked after the others.
        self._failed_at: dict[NodeAddress, float] = {}
        self._spawn = spawn
        self._deadline_s = deadline_s
        self._lock = threading.Lock()
        self._generation = 0
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._outcome: RepairOutcome | None = None
        self._progress = RepairProgress()
        self._failed: str | None = None
        # Side directories of an earlier process (numbered by its generations): no job of
        # this one runs yet, and each job fetches from scratch.
        for name in self._side_names():
            with contextlib.suppress(OSError):
                self._files.rmtree(self._side_root / name)

    # --- applier thread ---------------------------------------------------------------

    def start(self, gaps: Sequence[TableGap]) -> int:
        """Cancel any running job and fetch `gaps` in a new one; returns its generation."""
        assert gaps, "a repair needs gaps"
        self.cancel()
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._cancel = threading.Event()
            self._outcome = None
            self._failed = None
            self._progress = RepairProgress(
                tables={gap.table: (gap.offset_from, gap.offset_to) for gap in gaps},
                rows_wanted=sum(gap.offset_to - gap.offset_from for gap in gaps),
            )
            cancel = self._cancel
        job = tuple(gaps)
        self._thread = self._spawn(
            f"repair-{self._group_id}", lambda: self._run(generation, job, cancel)
        )
        log.info(
            "repair started group=%d generation=%d tables=%s",
            self._group_id,
            generation,
            ",".join(f"{gap.table}[{gap.offset_from},{gap.offset_to})" for gap in gaps),
        )
        return generation

    def cancel(self) -> None:
        """Stop the running job (if any); its results are never handed out. Does not wait:
        a job blocked in a fetch finds the flag at its next record."""
        with self._lock:
            self._cancel.set()
            self._generation += 1
            self._outcome = None
            self._failed = None

    def take_outcome(self) -> RepairOutcome | None:
        with self._lock:
            outcome, self._outcome = self._outcome, None
            return outcome

    @property
    def active(self) -> bool:
        with self._lock:
            return not self._cancel.is_set()

    # --- any thread -------------------------------------------------------------------

    def progress(self) -> RepairProgress:
        with self._lock:
            return self._progress

    def failed_reason(self) -> str | None:
        """Why the running job has not finished within the deadline; None while it may."""
        with self._lock:
            return self._failed

    def close(self) -> None:
        self.cancel()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    # --- the job's thread -------------------------------------------------------------

    def _run(self, generation: int, gaps: tuple[TableGap, ...], cancel: threading.Event) -> None:
        started = time.monotonic()
        self._remove_older_jobs(generation)
        backoff_s = _RETRY_S
        try:
            while True:
                try:
                    fetched = [self._fetch_gap(gap, cancel, started, generation) for gap in gaps]
                    break
                except OSError as error:
                    # This node's disk (full, EIO, no fds), not the peers: wait and fetch
                    # again from scratch (the side directories are rewritten).
                    log.warning(
                        "repair waits on the disk group=%d error=%s retry_in_s=%.1f",
                        self._group_id,
                        error,
                        backoff_s,
                    )
                    self._note_slow(started)
                    if cancel.wait(backoff_s):
                        raise _Cancelled from None
                    backoff_s = min(backoff_s * 2, _DISK_RETRY_MAX_S)
        except _Cancelled:
            log.info("repair cancelled group=%d generation=%d", self._group_id, generation)
            return
        except Exception:  # a bug here must not leave the group repairing for ever unseen
            log.exception("repair job crashed group=%d", self._group_id)
            with self._lock:
                if self._generation == generation:
                    self._failed = "repair job crashed (see the node log)"
            return
        with self._lock:
            if self._generation == generation and not cancel.is_set():
                self._outcome = RepairOutcome(generation, tuple(fetched))
        log.info(
            "repair fetched group=%d generation=%d took_s=%.1f",
            self._group_id,
            generation,
            time.monotonic() - started,
        )

    def _remove_older_jobs(self, generation: int) -> None:
        """Remove the side directories of earlier (cancelled) jobs; best effort: one still
        running fails its next write and sees its flag."""
        for name in self._side_names():
            suffix = name.rpartition(".")[2]
            if suffix.isdigit() and int(suffix) < generation:
                with contextlib.suppress(OSError):
                    self._files.rmtree(self._side_root / name)

    def _side_names(self) -> list[str]:
        try:
            if not self._files.exists(self._side_root):
                return []
            return self._files.listdir(self._side_root)
        except OSError:
            return []

    def _fetch_gap(
        self, gap: TableGap, cancel: threading.Event, started: float, generation: int
    ) -> FetchedTable:
        # One directory per job: a cancelled job stops only at its next record, and must
        # never write into (or remove) the directory of the job that replaced it.
        directory = self._side_root / f"{gap.table}.{gap.created_lsn}.{generation}"
        side = _fresh_log(self._files, directory, gap.offset_from)
        first_offset = gap.offset_from
        try:
            while side.row_count < gap.offset_to:
                if cancel.is_set():
                    raise _Cancelled
                try:
                    retained_from = self._fetch_round(gap, side, cancel)
                except IncarnationDropped as dropped:
                    log.warning("repair not needed table=%s: %s", gap.table, dropped)
                    return FetchedTable(gap, directory, first_offset, dropped=True)
                if side.row_count >= gap.offset_to:
                    break
                if retained_from is not None and gap.restartable:
                    # Every peer's retention removed the rows before `retained_from`: no
                    # node can send them. The (empty) replica continues where data begins,
                    # or, when the peers (writing on) dropped the whole gap, where the gap
                    # ends: the entries after it append from there.
                    side.close()
                    first_offset = min(retained_from, gap.offset_to)
                    side = _fresh_log(self._files, directory, first_offset)
                    log.warning(
                        "repair restarts table=%s at offset=%d (peers' retention)",
                        gap.table,
                        first_offset,
                    )
                    continue
                self._note_slow(started)
                cancel.wait(_RETRY_S)
            side.sync()
        finally:
            side.close()
        _verify(self._files, directory, first_offset, gap)
        return FetchedTable(gap, directory, first_offset)

    def _fetch_round(self, gap: TableGap, side: TableLog, cancel: threading.Event) -> int | None:
        """Try each peer once. Returns the lowest offset the peers still retain when every
        peer answered that the rows asked for are gone (OffsetOutOfRange), else None."""
        retained: list[int] = []
        for peer in self._peers_in_order():
            if side.row_count >= gap.offset_to:
                return None
            try:
                self._fetch_from(peer, gap, side, cancel)
                self._answered(peer)
            except IncarnationDropped:
                raise  # one peer that applied the drop is enough: drops apply once committed
            except OffsetOutOfRange as error:
                log.warning("repair from %s: %s", peer, error)
                self._answered(peer)
                if error.earliest > side.row_count:
                    retained.append(error.earliest)
            except RaftStoreError as error:
                log.warning("repair from %s failed table=%s error=%s", peer, gap.table, error)
                with self._lock:
                    self._failed_at[peer] = time.monotonic()
            with self._lock:
                self._progress = replace(self._progress, attempts=self._progress.attempts + 1)
        if retained and len(retained) == len(self._peers):
            return min(retained)
        return None

    def _peers_in_order(self) -> list[NodeAddress]:
        """The peers that have not failed first (in the configured order), then those that
        did, the longest ago first: a peer that stopped answering costs each table's fetch
        its silence (limits.PEER_FETCH_IDLE_S) only until it has failed once."""
        with self._lock:
            failed_at = dict(self._failed_at)
        return sorted(self._peers, key=lambda peer: failed_at.get(peer, -math.inf))

    def _answered(self, peer: NodeAddress) -> None:
        with self._lock:
            self._failed_at.pop(peer, None)

    def _fetch_from(
        self, peer: NodeAddress, gap: TableGap, side: TableLog, cancel: threading.Event
    ) -> None:
        records = self._fetch(
            peer, self._group_id, gap.table, side.row_count, gap.offset_to, gap.created_lsn
        )
        for record in records:
            if cancel.is_set():
                raise _Cancelled
            _check_record(peer, gap, side.row_count, record)
            side.append(record)
            with self._lock:
                self._progress = replace(
                    self._progress,
                    rows_fetched=self._progress.rows_fetched + record.row_count,
                    source=str(peer),
                )
            if side.row_count >= gap.offset_to:
                return

    def _note_slow(self, started: float) -> None:
        if time.monotonic() - started <= self._deadline_s:
            return
        with self._lock:
            if self._failed is None:
                self._failed = (
                    f"no peer supplied the missing rows within {self._deadline_s:.0f}s; "
                    "still trying"
                )
                log.error("repair failing group=%d: %s", self._group_id, self._failed)


def _check_record(peer: NodeAddress, gap: TableGap, expected: int, record: DataRecord) -> None:
    if record.first_offset != expected:
        raise PeerProtocolError(
            str(peer), f"sent offset {record.first_offset} of {gap.table}, expected {expected}"
        )
    if record.row_count < 1 or record.first_offset + record.row_count > gap.offset_to:
        raise PeerProtocolError(
            str(peer),
            f"sent rows [{record.first_offset},{record.first_offset + record.row_count}) of "
            f"{gap.table}, past the gap's end {gap.offset_to}",
        )
    if record.lsn > gap.lsn_max:
        raise PeerProtocolError(
            str(peer), f"sent a record of entry {record.lsn}, after the state ({gap.lsn_max})"
        )


def _fresh_log(files: Files, directory: Path, first_offset: int) -> TableLog:
    """An empty side log continuing at `first_offset` (anything left there is discarded:
    a cancelled or crashed job's files)."""
    if files.exists(directory):
        files.rmtree(directory)
    side = TableLog(directory, files=files)
    if first_offset > 0:
        side.start_at(first_offset)
    return side


def _verify(files: Files, directory: Path, first_offset: int, gap: TableGap) -> None:
    """Reopen the side directory (offset chain, headers) and read every record back (each
    read checks the record's CRCs)."""
    reopened = TableLog(directory, files=files)
    try:
        for _ in reopened.read(first_offset, gap.offset_to):
            pass
        if reopened.earliest_offset != first_offset or reopened.row_count != gap.offset_to:
            raise CorruptionError(
                str(directory),
                0,
                f"fetched rows [{reopened.earliest_offset},{reopened.row_count}), "
                f"expected [{first_offset},{gap.offset_to})",
            )
    finally:
        with contextlib.suppress(OSError):
            reopened.close()
