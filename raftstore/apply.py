"""Applying one group's committed entries on this node, and owning what they change.

The replica calls `Applier.apply(lsn, command)` on its apply thread for every committed
entry, in order. The applier decodes the command, lets the pure state machine decide
(state_machine.py), and performs the effects on the table stores (data files, cache,
wakeups). It also restores checkpoints, swaps in repaired tables (catch_up.py) and runs
retention (retention.py), all on the same thread, so one thread owns the live files.

The apply rule (docs/durability.md): every replica reaches the same state from the same
entries, and nothing a command contains can stop a replica.
- A command that does not decode, or that the state machine refuses, is a recorded no-op
  with its reason: the same on every replica (the bytes are the same everywhere).
- Effects are idempotent: appends are recognised by offset (a replay writes nothing), a
  created table's files are named after its incarnation (`<table>.<created_lsn>`), so a
  re-created table never meets its predecessor's files, and a drop removes exactly its own.
- The environment is not the command: an OSError (disk full, too many open files, I/O
  error, permission) while performing effects leaves the entry *not applied* (STALLED): the
  replica keeps it and offers it again after a backoff, and the effects not yet performed
  are performed then. The replica is in doubt meanwhile (health.py).
- Damage is repaired, never skipped: a table whose files fail their checks, hold rows
  that contradict the log, or lack rows a restored checkpoint says it has, is a *gap*: its
  rows are fetched from peers (catch_up.py). Entries that touch a table with a gap wait for
  it; the others go on (a later drop of that table ends its gap: no fetch needed).

Threads: `apply`, `checkpoint`, `restore`, `on_tick` run on the replica's apply thread.
The read accessors and `report_damage` may be called from any thread (`_lock`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pyarrow as pa

from hastream.errors import (
    CheckpointDeferred,
    CorruptionError,
    IncarnationDropped,
    InvalidArgument,
    NodeUnavailable,
    RaftStoreError,
    TableNotFound,
)
from raftstore import commands, limits
from raftstore.cache_budget import CacheBudget
from raftstore.catch_up import FetchedTable, Repairer, RepairOutcome, TableGap
from raftstore.health import HEALTHY, Health, ReplicaState
from raftstore.replica import STALLED, Snapshot
from raftstore.retention import Retention
from raftstore.state_machine import (
    AppendRecords,
    AppendResult,
    CommandResult,
    CreateTableFiles,
    DropTableFiles,
    Effect,
    GroupStateMachine,
    TableMeta,
    TableView,
)
from raftstore.storage.files import REAL_FILES, Files, ensure_dir
from raftstore.tables import TableStore

log = logging.getLogger(__name__)

_INCARNATION: Final = re.compile(r"([A-Za-z][A-Za-z0-9_]*)\.(\d+)")
QUARANTINE_DIR: Final = ".quarantine"
REPAIR_DIR: Final = ".repair"
_BACKOFF_FIRST_S: Final = 0.1


def table_directory(data_dir: Path, table: str, created_lsn: int) -> Path:
    """Where one incarnation of a table keeps its data files."""
    return data_dir / f"{table}.{created_lsn}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplierSettings:
    group_id: int
    data_dir: Path  # persistenceDir/group-<id>
    dedup_window_rows: int = limits.DEDUP_WINDOW_ROWS
    files: Files = REAL_FILES  # the disk (a simulated one in tests)
    # The key of the leader's seals on checked payloads (checked_payload.py); None: none
    # made or trusted, every payload read.
    seal_key: bytes | None = None


@dataclass(slots=True)
class _Pending:
    """An entry decided by the state machine whose effects are not all performed yet."""

    lsn: int
    effects: collections.deque[Effect]
    result: AppendResult | CommandResult


class _TableDamaged(Exception):
    """A table's files cannot be trusted; raised inside `_perform`, handled by the caller."""

    def __init__(self, table: str, detail: str) -> None:
        self.table = table
        self.detail = detail
        super().__init__(f"table {table}: {detail}")


class _WaitForRepair(Exception):
    """The effect needs a table whose rows are being fetched: the entry waits."""


class _RowsMissing(Exception):
    """A table's files end before rows the state says it holds (they must be fetched)."""

    def __init__(self, table: str, offset_from: int, offset_to: int) -> None:
        self.table = table
        self.offset_from = offset_from
        self.offset_to = offset_to
        super().__init__(f"table {table} lacks rows [{offset_from},{offset_to})")


class Applier:
    def __init__(
        self,
        settings: ApplierSettings,
        repairer: Repairer,
        retention: Retention,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        cache_budget: CacheBudget | None = None,
    ) -> None:
        """`cache_budget`: the node's one bound on every table's row cache (a private one
        by default)."""
        self.group_id = settings.group_id
        self._cache_budget = cache_budget if cache_budget is not None else CacheBudget()
        self._settings = settings
        self._data_dir = settings.data_dir
        self._files = settings.files
        self._repairer = repairer
        self._retention = retention
        self._monotonic = monotonic
        self._lock = threading.RLock()
        self._machine = self._new_machine()
        self._stores: dict[str, TableStore] = {}
        self._stall_reason: str | None = None  # the environment error apply waits on
        self._gaps: dict[str, TableGap] = {}  # tables whose files lack rows: being fetched
        # Tables whose missing rows no peer holds because a peer applied the drop of their
        # incarnation (table -> created_lsn): no files, appends not written, until this
        # replica applies that committed drop too.
        self._dropped_ahead: dict[str, int] = {}
        self._health = HEALTHY
        self._pending: _Pending | None = None
        # A restored state whose stores are not all open yet (an OSError interrupted it).
        self._reconcile_needed = False
        self._key_windows_needed = False
        self._outcome: RepairOutcome | None = None  # fetched, not yet swapped in
        self._retry_at = 0.0
        self._backoff_s = _BACKOFF_FIRST_S
        self._damage: collections.deque[tuple[str, int, str]] = collections.deque()
        self.entries_applied = 0
        self.noops_recorded = 0
        self.stalls = 0
        self.corruptions_repaired = 0
        self.repairs_completed = 0
        self.checkpoints_written = 0
        self.checkpoints_durable = 0
        self.checkpoint_lsn = 0  # the state the newest checkpoint taken here holds
        self.checkpoints_loaded = 0
        # The live table incarnations of the checkpoint being written: (lsn, live).
        self._checkpoint_live: tuple[int, set[tuple[str, int]]] | None = None
        self._drops_since_checkpoint = 0
        ensure_dir(self._files, self._data_dir, root=self._data_dir)

    def _new_machine(self) -> GroupStateMachine:
        settings = self._settings
        return GroupStateMachine(
            self.group_id,
            dedup_window_rows=settings.dedup_window_rows,
            seal_key=settings.seal_key,
        )

    # --- ApplyHooks (apply thread) ------------------------------------------------------

    def apply(self, lsn: int, command: memoryview) -> Any:
        if not self._may_apply():
            return STALLED
        pending = self._pending
        if pending is None:
            if lsn <= self._machine.lsn_applied:
                return None  # already in the restored state: skipped by rule, never redone
            decoded: commands.Command | InvalidArgument
            try:
                decoded = commands.decode(command)
            except InvalidArgument as error:
                decoded = error
            if self._touches_a_gap(decoded):
                return STALLED  # it waits for its table's rows (a drop of it goes on)
            pending = self._decide(lsn, decoded)
            self._pending = pending
        # The replica offers the same entry again until it is applied; a restore (the only
        # thing that moves the log under us) clears the pending entry.
        assert pending.lsn == lsn, (pending.lsn, lsn)
        if not self._perform_pending(pending):
            return STALLED
        self._pending = None
        self.entries_applied += 1
        self._cleared()
        return pending.result

    def _may_apply(self) -> bool:
        if self._stall_reason is not None:
            if self._monotonic() < self._retry_at:
                return False
            if self._reconcile_needed and not self._reconcile():
                return False
        return not self._reconcile_needed

    def _touches_a_gap(self, command: commands.Command | InvalidArgument) -> bool:
        """An append to a table whose rows are being fetched must wait before the state
        machine decides it (its key window is rebuilt from those rows)."""
        if not self._gaps or not isinstance(command, commands.Append):
            return False
        return any(item.table in self._gaps for item in command.items)

    def _decide(self, lsn: int, decoded: commands.Command | InvalidArgument) -> _Pending:
        """Run the state machine. Anything the entry holds that it cannot apply becomes a
        no-op with the reason, identically on every replica."""
        if isinstance(decoded, InvalidArgument):
            return self._noop(lsn, decoded)
        with self._lock:
            try:
                effects, result = self._machine.apply(lsn, decoded)
            except RaftStoreError as error:
                return self._noop(lsn, error)
        return _Pending(lsn, collections.deque(effects), result)

    def _noop(self, lsn: int, error: RaftStoreError) -> _Pending:
        log.error("entry recorded as a no-op group=%d lsn=%d reason=%s", self.group_id, lsn, error)
        self.noops_recorded += 1
        with self._lock:
            self._machine.apply(lsn, commands.Noop())
        return _Pending(lsn, collections.deque(), CommandResult(lsn, error))

    def _perform_pending(self, pending: _Pending) -> bool:
        """Perform the entry's remaining effects in order. False: it must wait."""
        try:
            while pending.effects:
                self._perform(pending.effects[0])
                pending.effects.popleft()
        except OSError as error:
            self._stall(f"{type(error).__name__}: {error}")
            return False
        except _TableDamaged as damage:
            self._repair_damaged(damage.table, damage.detail)
            return False
        except _RowsMissing as missing:
            self._repair_missing(missing)
            return False
        except _WaitForRepair:
            return False  # the entry waits for its table's rows (no new stall: not an error)
        return True

    def _perform(self, effect: Effect) -> None:
        if isinstance(effect, AppendRecords):
            self._append(effect)
        elif isinstance(effect, CreateTableFiles):
            self._create_files(effect.meta)
        elif isinstance(effect, DropTableFiles):
            self._drop_files(effect.table, effect.created_lsn)
        else:  # pragma: no cover - exhaustive over Effect
            raise AssertionError(f"unknown effect {effect!r}")

    def _append(self, effect: AppendRecords) -> None:
        if effect.table in self._gaps:
            raise _WaitForRepair
        if effect.table in self._dropped_ahead:
            return  # the table's committed drop is coming: its rows are needed nowhere
        store = self._stores.get(effect.table)
        if store is None:
            raise _TableDamaged(effect.table, "no open data files")
        first = effect.first_offset
        end = first + effect.row_count
        have = store.row_count
        if first > have:
            raise _RowsMissing(effect.table, have, first)
        if end <= have:  # a replay: these rows are on disk already
            if effect.lsn > store.lsn_last:
                raise _TableDamaged(
                    effect.table,
                    f"files hold rows up to {have} from entries <= {store.lsn_last}, but entry "
                    f"{effect.lsn} wrote [{first},{end})",
                )
            return
        if first < have:
            raise _TableDamaged(
                effect.table, f"rows [{first},{end}) straddle the end of the files ({have})"
            )
        try:
            if effect.batch is None:  # a sealed publish taken unread (checked_payload.py)
                assert effect.encoded is not None
                store.append_unread(
                    effect.lsn, first, effect.unread_rows, effect.encoded, effect.timestamp_ms
                )
            else:
                store.append(effect.lsn, first, effect.batch, effect.timestamp_ms, effect.encoded)
        except CorruptionError as error:  # a failed write that could not be cut back
            self._reopen(effect.table, store, error)
            raise OSError(f"write to {effect.table} failed: {error.detail}") from error

    def _create_files(self, meta: TableMeta) -> None:
        old = self._stores.pop(meta.table, None)
        if old is not None:  # the state machine refuses a second create; never reached
            old.close()
        try:
            store = self._open(meta, self._directory(meta))
        except CorruptionError as error:
            # Files of this very incarnation that fail their checks: they held rows of this
            # table, which the coming entries (replay) or a repair bring back.
            self._quarantine(meta, error.detail)
            self.corruptions_repaired += 1
            store = self._open(meta, self._directory(meta))
        with self._lock:
            self._stores[meta.table] = store

    def _drop_files(self, table: str, created_lsn: int) -> None:
        """Close a dropped table's files. They are removed once a checkpoint that no longer
        holds the table is durable (`checkpoint_written`): until then a restart replays
        entries from before the drop, which need them."""
        if self._dropped_ahead.get(table) == created_lsn:
            del self._dropped_ahead[table]
        gap = self._gaps.get(table)
        if gap is not None and gap.created_lsn == created_lsn:
            del self._gaps[table]  # dropped: its rows are not needed any more
            self._restart_repair()
        with self._lock:
            store = self._stores.get(table)
            if store is not None and store.meta.created_lsn == created_lsn:
                del self._stores[table]
            else:
                store = None
        if store is not None:
            store.close()
        self._drops_since_checkpoint += 1
        log.info("dropped table group=%d table=%s", self.group_id, table)

    # --- environment errors -------------------------------------------------------------

    def _stall(self, reason: str) -> None:
        now = self._monotonic()
        if self._stall_reason != reason:
            log.error(
                "apply stalled group=%d reason=%s retry_in_s=%.2f",
                self.group_id,
                reason,
                self._backoff_s,
            )
        self.stalls += 1
        self._stall_reason = reason
        self._retry_at = now + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, limits.APPLY_RETRY_MAX_S)
        self._refresh_health()

    def _cleared(self) -> None:
        if self._stall_reason is not None:
            log.info("apply resumed group=%d after=%s", self.group_id, self._stall_reason)
            self._stall_reason = None
            self._refresh_health()
        self._backoff_s = _BACKOFF_FIRST_S

    def _refresh_health(self) -> None:
        """Health from its parts: an environment error first, then a repair."""
        if self._stall_reason is not None:
            health = Health(ReplicaState.STALLED, self._stall_reason)
        elif self._gaps:
            failed = self._repairer.failed_reason()
            state = ReplicaState.FAILED if failed else ReplicaState.REPAIRING
            reason = failed or "fetching " + ", ".join(
                f"{gap.table}[{gap.offset_from},{gap.offset_to})" for gap in self._gaps.values()
            )
            health = Health(state, reason, self._repairer.progress())
        else:
            health = HEALTHY
        with self._lock:
            self._health = health

    # --- damage and repair --------------------------------------------------------------

    def report_damage(self, table: str, created_lsn: int, detail: str) -> None:
        """A reader or the scrub found damage in a table's files (any thread); the apply
        thread moves them aside and repairs the table at its next tick."""
        with self._lock:
            self._damage.append((table, created_lsn, detail))

    def _repair_damaged(self, table: str, detail: str) -> None:
        with self._lock:
            view = self._machine.table(table)
            store = self._stores.pop(table, None)
        if store is not None:
            store.close()
        self._quarantine(view.meta, detail)
        self.corruptions_repaired += 1
        self._begin_repair([self._gap(view, 0, restartable=True)])

    def _repair_missing(self, missing: _RowsMissing) -> None:
        with self._lock:
            view = self._machine.table(missing.table)
        log.error(
            "rows missing group=%d table=%s rows=[%d,%d)",
            self.group_id,
            missing.table,
            missing.offset_from,
            missing.offset_to,
        )
        self._begin_repair([self._gap(view, missing.offset_from, restartable=False)])

    def _gap(self, view: TableView, offset_from: int, *, restartable: bool) -> TableGap:
        """The rows a table's files must hold: everything the state says, less the rows of
        the pending entry not written yet (they are written after the repair)."""
        offset_to = view.row_count
        lsn_max = self._machine.lsn_applied
        pending = self._pending
        if pending is not None:
            for effect in pending.effects:
                if isinstance(effect, AppendRecords) and effect.table == view.meta.table:
                    offset_to = min(offset_to, effect.first_offset)
            lsn_max = pending.lsn
        return TableGap(
            table=view.meta.table,
            created_lsn=view.meta.created_lsn,
            offset_from=offset_from,
            offset_to=offset_to,
            lsn_max=lsn_max,
            restartable=restartable,
        )

    def _begin_repair(self, gaps: list[TableGap]) -> None:
        """Register the gaps and (re)start the one repair job with every gap known."""
        fresh = [gap for gap in gaps if gap.offset_to > gap.offset_from]
        if not fresh and not self._gaps:
            self._reopen_missing_stores()
            return
        for gap in fresh:
            self._gaps[gap.table] = gap
        self._restart_repair()

    def _restart_repair(self) -> None:
        """One job at a time, for all gaps (a restarted job discards the cancelled one's
        side directories and starts from what is durable)."""
        self._outcome = None
        if self._gaps:
            self._repairer.start(sorted(self._gaps.values(), key=lambda gap: gap.table))
        else:
            self._repairer.cancel()
            self._reopen_missing_stores()
            if self._key_windows_needed:
                self._rebuild_key_windows()
        self._refresh_health()

    def _quarantine(self, meta: TableMeta, detail: str) -> None:
        """Move a table's files aside (never served, never skipped): they are kept for an
        operator under `.quarantine/`, the newest QUARANTINED_TABLES_MAX per group."""
        directory = self._directory(meta)
        if not self._files.exists(directory):
            return
        aside_root = self._data_dir / QUARANTINE_DIR
        ensure_dir(self._files, aside_root, root=aside_root)
        aside = aside_root / f"{directory.name}.{int(time.time() * 1000)}"
        log.error(
            "damaged table moved aside group=%d table=%s to=%s detail=%s",
            self.group_id,
            meta.table,
            aside,
            detail,
        )
        self._files.replace(directory, aside)
        self._files.fsync_dir(self._data_dir)
        self._files.fsync_dir(aside_root)
        _keep_newest(self._files, aside_root, limits.QUARANTINED_TABLES_MAX)

    def _reopen(self, table: str, store: TableStore, error: CorruptionError) -> None:
        """Reopen a store after a write that could not be undone: opening cuts the torn
        tail. If the files fail to open, the table is repaired."""
        log.warning("reopening table files group=%d table=%s: %s", self.group_id, table, error)
        with contextlib.suppress(OSError):
            store.close()
        with self._lock:
            self._stores.pop(table, None)
        try:
            reopened = self._open(store.meta, self._directory(store.meta))
        except CorruptionError as reopen_error:
            raise _TableDamaged(table, reopen_error.detail) from reopen_error
        with self._lock:
            self._stores[table] = reopened

    def _reopen_missing_stores(self) -> None:
        """Open the store of every table that has none (after a repair or quarantine)."""
        with self._lock:
            views = self._machine.tables()
        for view in views:
            if view.meta.table not in self._stores and view.meta.table not in self._dropped_ahead:
                store = self._open(view.meta, self._directory(view.meta))
                with self._lock:
                    self._stores[view.meta.table] = store

    def _take_damage_reports(self) -> None:
        while True:
            with self._lock:
                if not self._damage:
                    return
                table, created_lsn, detail = self._damage.popleft()
                store = self._stores.get(table)
            if store is None or store.meta.created_lsn != created_lsn:
                continue  # dropped, re-created or already moved aside meanwhile
            try:
                self._repair_damaged(table, detail)
            except OSError as error:
                self._stall(f"moving damaged {table} aside: {error}")
                with self._lock:
                    self._damage.appendleft((table, created_lsn, detail))
                return

    def _poll_repair(self) -> None:
        outcome = self._outcome or self._repairer.take_outcome()
        if outcome is None:
            self._refresh_health()  # progress, or failed past the deadline
            return
        self._outcome = outcome
        try:
            for fetched in outcome.tables:
                gap = self._gaps.get(fetched.gap.table)
                if gap != fetched.gap:  # dropped (or re-gapped) meanwhile: not needed
                    remove_tree(self._files, fetched.directory)
                    continue
                if fetched.dropped:
                    remove_tree(self._files, fetched.directory)
                    self._wait_for_drop(fetched.gap)
                    del self._gaps[fetched.gap.table]
                    continue
                self._swap_in(fetched)
                del self._gaps[fetched.gap.table]
            self._outcome = None
            self.repairs_completed += 1
            log.info("repair complete group=%d tables=%d", self.group_id, len(outcome.tables))
            self._restart_repair()
        except OSError as error:
            log.error("swapping in repaired tables failed group=%d: %s", self.group_id, error)
            self._retry_at = self._monotonic() + self._backoff_s
        except _TableDamaged as damage:
            self._outcome = None
            self._repair_damaged(damage.table, damage.detail)

    def _wait_for_drop(self, gap: TableGap) -> None:
        """A peer applied the drop of `gap`'s incarnation, so no node may still hold its
        rows and this replica will apply the same committed drop. Until then the table has
        no files here (readers get TableNotFound, as after the drop) and its appends are
        decided by the state machine but not written. Its key window is left empty: the
        duplicates it drops until the drop may differ from other replicas', for rows that
        are going away."""
        with self._lock:
            store = self._stores.pop(gap.table, None)
            view = self._machine.table(gap.table)
            if gap.table in self._machine.key_windows_pending():
                key_column = view.meta.key_column
                assert key_column is not None, gap.table
                key_type = view.meta.schema.field(key_column).type
                self._machine.rebuild_key_window(
                    gap.table, pa.array([], type=key_type), view.row_count
                )
        if store is not None:
            store.close()
        self._dropped_ahead[gap.table] = gap.created_lsn
        log.warning(
            "table dropped on a peer; waiting for the drop here group=%d table=%s",
            self.group_id,
            gap.table,
        )

    def check_incarnation(self, table: str, created_lsn: int) -> None:
        """For a peer repairing incarnation (table, created_lsn) (any thread): returns when
        this replica's state holds it; raises IncarnationDropped when this replica applied
        past its creation and no longer holds it (so it applied its drop: the incarnation
        existed at `created_lsn` on every replica), else TableNotFound (not created here
        yet: ask later or elsewhere)."""
        with self._lock:
            applied = self._machine.lsn_applied
            try:
                held: int | None = self._machine.table(table).meta.created_lsn
            except TableNotFound:
                held = None
        if held == created_lsn:
            return
        if applied >= created_lsn and (held is None or held > created_lsn):
            raise IncarnationDropped(table, created_lsn)
        raise TableNotFound(table)

    def _swap_in(self, fetched: FetchedTable) -> None:
        """Put fetched rows in place of, or after, the live files: by rename, durably. A
        crash in between leaves a valid prefix; the next start fetches the rest."""
        gap = fetched.gap
        with self._lock:
            view = self._machine.table(gap.table)
            store = self._stores.pop(gap.table, None)
        if view.meta.created_lsn != gap.created_lsn:  # never: a restore cancels the job
            remove_tree(self._files, fetched.directory)
            return
        if store is not None:
            store.close()
        live = self._directory(view.meta)
        if fetched.first_offset != gap.offset_from or gap.offset_from == 0:
            remove_tree(self._files, live)
            self._files.replace(fetched.directory, live)
            self._files.fsync_dir(fetched.directory.parent)
            self._files.fsync_dir(self._data_dir)
        else:
            _move_segments(self._files, fetched.directory, live)
            remove_tree(self._files, fetched.directory)
        try:
            swapped = self._open(view.meta, live)
        except CorruptionError as error:
            raise _TableDamaged(gap.table, error.detail) from error
        with self._lock:
            self._stores[gap.table] = swapped
        if swapped.row_count < gap.offset_to:
            raise _TableDamaged(
                gap.table, f"{swapped.row_count} rows after the repair, want {gap.offset_to}"
            )
        log.info(
            "repaired table group=%d table=%s rows=[%d,%d)",
            self.group_id,
            gap.table,
            fetched.first_offset,
            gap.offset_to,
        )

    # --- checkpoints --------------------------------------------------------------------

    def checkpoint(self) -> Snapshot:
        if self._health.in_doubt or self._pending is not None or self._reconcile_needed:
            reason = self._health.reason or "an entry waits to be applied"
            raise CheckpointDeferred(self.group_id, reason)
        started = self._monotonic()
        with self._lock:
            stores = list(self._stores.values())
        for store in stores:
            try:
                store.sync()
            except OSError as error:
                raise CheckpointDeferred(self.group_id, f"data not synced: {error}") from error
            except CorruptionError as error:  # a write failed and could not be undone
                self.report_damage(store.meta.table, store.meta.created_lsn, error.detail)
                raise CheckpointDeferred(self.group_id, f"table damaged: {error}") from error
        with self._lock:
            snapshot = Snapshot(self._machine.lsn_applied, self._machine.snapshot())
            self._checkpoint_live = (snapshot.lsn, self._live_incarnations())
        self.checkpoints_written += 1
        self.checkpoint_lsn = snapshot.lsn
        log.info(
            "checkpoint group=%d lsn=%d tables=%d took_ms=%.1f",
            self.group_id,
            snapshot.lsn,
            len(stores),
            (self._monotonic() - started) * 1000,
        )
        return snapshot

    def restore(self, snapshot: Snapshot) -> None:
        """Replace the state with a checkpoint's: at start, or when the leader installs its
        checkpoint on this lagging follower. Raises InvalidArgument on a malformed state
        (the node then refuses to start rather than run on a wrong state)."""
        machine = GroupStateMachine.restore(
            self.group_id,
            snapshot.state,
            dedup_window_rows=self._settings.dedup_window_rows,
            seal_key=self._settings.seal_key,
        )
        if machine.lsn_applied != snapshot.lsn:
            raise InvalidArgument(
                "checkpoint", f"state at lsn {machine.lsn_applied}, file says {snapshot.lsn}"
            )
        self._repairer.cancel()
        self._outcome = None
        self._gaps.clear()
        self._dropped_ahead.clear()
        with self._lock:
            stores = list(self._stores.values())
            self._stores.clear()
            self._machine = machine
            self._pending = None
        for store in stores:
            store.close()
        self.checkpoints_loaded += 1
        self._key_windows_needed = True
        self._reconcile_needed = True
        self._stall_reason = None
        self._refresh_health()
        self._reconcile()
        log.info(
            "restored checkpoint group=%d lsn=%d tables=%d health=%s",
            self.group_id,
            snapshot.lsn,
            len(machine.tables()),
            self._health.state.value,
        )

    def _reconcile(self) -> bool:
        """Open every table's files and compare them with the restored state: rebuild the
        key windows when they are whole, start a repair when rows are missing. False when
        an OSError interrupted it (retried after a backoff)."""
        gaps: list[TableGap] = []
        try:
            with self._lock:
                views = self._machine.tables()
            for view in views:
                store = self._open_or_quarantine(view)
                if store.row_count < view.row_count:
                    restartable = store.row_count == store.earliest_offset
                    gaps.append(self._gap(view, store.row_count, restartable=restartable))
            self._reconcile_needed = False
            self._rebuild_key_windows(skip={gap.table for gap in gaps})
            if gaps:
                self._begin_repair(gaps)
        except OSError as error:
            self._stall(f"opening data files: {error}")
            return False
        except _TableDamaged as damage:
            self._reconcile_needed = False
            self._repair_damaged(damage.table, damage.detail)
        return True

    def _open_or_quarantine(self, view: TableView) -> TableStore:
        store = self._stores.get(view.meta.table)
        if store is not None:
            return store
        try:
            store = self._open(view.meta, self._directory(view.meta))
        except CorruptionError as error:
            self._quarantine(view.meta, error.detail)
            self.corruptions_repaired += 1
            store = self._open(view.meta, self._directory(view.meta))
        with self._lock:
            self._stores[view.meta.table] = store
        return store

    def _rebuild_key_windows(self, skip: set[str] | frozenset[str] = frozenset()) -> None:
        """Rebuild the key windows a restore left empty, from the tables' last rows (those
        in `skip` wait for their repair)."""
        with self._lock:
            pending = [table for table in self._machine.key_windows_pending() if table not in skip]
        for table in pending:
            with self._lock:
                span = self._machine.key_window_range(table)
                view = self._machine.table(table)
                store = self._stores[table]
            assert span is not None, table
            assert view.meta.key_column is not None, table
            offset_from = max(span[0], store.earliest_offset)
            try:
                keys = store.read_keys(offset_from, span[1], view.meta.key_column)
            except CorruptionError as error:
                raise _TableDamaged(table, error.detail) from error
            with self._lock:
                self._machine.rebuild_key_window(table, keys, offset_from)
        self._key_windows_needed = bool(skip)

    def _live_incarnations(self) -> set[tuple[str, int]]:
        return {(view.meta.table, view.meta.created_lsn) for view in self._machine.tables()}

    def checkpoint_written(self, lsn: int) -> None:
        """The checkpoint at `lsn` is durable and the log before it is gone: files of tables
        it does not hold are needed by no replay any more. Remove them (a drop only closes
        its table's files: a restart before this point replays entries that need them)."""
        if self._checkpoint_live is None or self._checkpoint_live[0] != lsn:
            return
        _, live = self._checkpoint_live
        self._checkpoint_live = None
        self._drops_since_checkpoint = 0
        self.checkpoints_durable += 1
        self._collect_garbage(live, lsn)

    def checkpoint_wanted(self) -> bool:
        """A table was dropped since the last checkpoint: its files go once one is durable."""
        return self._drops_since_checkpoint > 0 and not self._health.in_doubt

    def _collect_garbage(self, live: set[tuple[str, int]], lsn_applied: int) -> None:
        """Remove files of table incarnations not in `live` and created at or before
        `lsn_applied` (the state of a durable checkpoint)."""
        try:
            names = self._files.listdir(self._data_dir)
        except OSError:
            return
        for name in names:
            match = _INCARNATION.fullmatch(name)
            if match is None:
                continue
            incarnation = (match.group(1), int(match.group(2)))
            if incarnation not in live and incarnation[1] <= lsn_applied:
                log.info("removing files of a dropped table group=%d dir=%s", self.group_id, name)
                with contextlib.suppress(OSError):
                    remove_tree(self._files, self._data_dir / name)

    # --- ticks --------------------------------------------------------------------------

    def on_tick(self) -> None:
        # Every tick of the Raft loop comes here: the checks are read without the lock
        # first (a report appended meanwhile is taken by the next tick).
        if self._damage:
            self._take_damage_reports()
        if self._gaps:
            if self._monotonic() >= self._retry_at:
                self._poll_repair()
            return
        if (
            self._health.state is ReplicaState.HEALTHY
            and self._pending is None
            and self._retention.due()
        ):
            with self._lock:
                stores = list(self._stores.values())
            try:
                self._retention.run_if_due(stores)
            except OSError as error:
                log.warning("retention failed group=%d: %s", self.group_id, error)

    def in_doubt(self) -> bool:
        return self._health.in_doubt

    def close(self) -> None:
        """Sync and close every store (the replica is closed first: no more applies)."""
        self._repairer.close()
        with self._lock:
            stores = list(self._stores.values())
            self._stores.clear()
        for store in stores:
            with contextlib.suppress(OSError):
                store.sync()
            store.close()

    # --- reads (any thread) -------------------------------------------------------------

    def _directory(self, meta: TableMeta) -> Path:
        return table_directory(self._data_dir, meta.table, meta.created_lsn)

    def _open(self, meta: TableMeta, directory: Path) -> TableStore:
        return TableStore(meta, directory, files=self._files, budget=self._cache_budget)

    @property
    def machine(self) -> GroupStateMachine:
        """The state machine (read-only use: validation and views; apply thread mutates)."""
        return self._machine

    def health(self) -> Health:
        return self._health

    def has_table(self, table: str) -> bool:
        with self._lock:
            return table in self._stores or self._machine.has_table(table)

    def table_names(self) -> list[str]:
        with self._lock:
            return [view.meta.table for view in self._machine.tables()]

    def table_view(self, table: str) -> TableView:
        with self._lock:
            return self._machine.table(table)

    def store(self, table: str) -> TableStore:
        """The table's open files. Raises TableNotFound when the state does not hold the
        table (or holds it only until a drop peers already applied), NodeUnavailable
        (retryable) while it does and its files are being reopened (a restored checkpoint,
        a repair swapping fetched rows in): the table exists."""
        with self._lock:
            store = self._stores.get(table)
            reopening = (
                store is None
                and table not in self._dropped_ahead
                and self._machine.has_table(table)
            )
        if reopening:
            raise NodeUnavailable(f"table {table!r}: its files are being reopened here")
        if store is None:
            raise TableNotFound(table)
        return store

    def stores(self) -> Iterator[TableStore]:
        with self._lock:
            stores = list(self._stores.values())
        return iter(stores)

    def topic_offset(self, topic: str) -> int | None:
        with self._lock:
            return self._machine.topic_offset(topic)

    def topics(self) -> dict[str, int]:
        with self._lock:
            return self._machine.topics()

    def topic_count(self) -> int:
        with self._lock:
            return self._machine.topic_count()

    def key_window_rows(self) -> dict[str, int]:
        """Rows each keyed table's dedup window holds (any thread)."""
        with self._lock:
            return self._machine.key_window_rows()

    def status(self) -> dict[str, Any]:
        with self._lock:
            tables = {
                name: {"row_count": store.row_count, "earliest_offset": store.earliest_offset}
                for name, store in self._stores.items()
            }
        return {
            "health": self._health.to_json(),
            "catching_up": self._health.state is not ReplicaState.HEALTHY,
            "lsn_applied": self._machine.lsn_applied,
            "entries_applied": self.entries_applied,
            "noops_recorded": self.noops_recorded,
            "apply_stalls": self.stalls,
            "corruptions_repaired": self.corruptions_repaired,
            "repairs_completed": self.repairs_completed,
            "checkpoints_written": self.checkpoints_written,
            "checkpoints_durable": self.checkpoints_durable,
            "checkpoint_lsn": self.checkpoint_lsn,
            "checkpoints_loaded": self.checkpoints_loaded,
            "retention_rows_removed": self._retention.rows_removed,
            # The leader's checks of small publishes kept for their apply (check_memo.py),
            # and how many applies took one back instead of reading the payload again.
            "payload_checks_kept": len(self._machine.check_memo),
            "payload_checks_reused": self._machine.check_memo.hits,
            # Sealed publishes (checked_payload.py) applied without reading the payload.
            "payload_seals_taken": self._machine.seals_taken,
            "table_stats": tables,
        }


def remove_tree(files: Files, path: Path) -> None:
    """Remove a table's directory durably, whatever an operator made of it (a symlink to a
    directory: the link and what it points to; see RealFiles). Missing is fine."""
    if not files.exists(path):
        return
    files.rmtree(path)
    files.fsync_dir(path.parent)


def _move_segments(files: Files, source: Path, destination: Path) -> None:
    """Rename every segment of `source` into `destination` (oldest first; an empty segment
    there with a clashing name is a start marker and is replaced), then fsync."""
    for name in sorted(files.listdir(source)):
        target = destination / name
        if files.exists(target):
            if _file_size(files, target) != 0:
                raise OSError(f"{target} exists and is not empty")
            files.unlink(target)
        files.replace(source / name, target)
    files.fsync_dir(destination)
    files.fsync_dir(source)


def _file_size(files: Files, path: Path) -> int:
    fd = files.open(path, os.O_RDONLY | os.O_CLOEXEC, 0o600)
    try:
        return files.size(fd)
    finally:
        files.close(fd)


def _keep_newest(files: Files, directory: Path, keep: int) -> None:
    """Remove all but the `keep` newest entries (their names end in `.<ms>`)."""
    names = sorted(files.listdir(directory), key=lambda name: int(name.rsplit(".", 1)[-1]))
    for old in names[: max(0, len(names) - keep)]:
        with contextlib.suppress(OSError):
            remove_tree(files, directory / old)
