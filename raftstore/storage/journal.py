"""The Raft log on disk: checksummed, fsynced, torn-tail safe, in segment files.

pysyncobj's own FileJournal never fsyncs, has no checksum and a 32-bit offset (see
docs/durability.md). This class speaks our names (append, truncate_from, drop_first,
entries by position, term/vote/commit metadata); `replication.py` adapts it to pysyncobj's
journal interface (`_PysyncobjJournal`), and the local replica uses it as it is. It never
imports pysyncobj. Every file operation goes
through the `files` interface (storage/files.py), the real file system by default.

Layout: segment files `<dir>/raft.journal` (segment 0, the name of the single file older
versions wrote) and `<dir>/raft.journal.<n>` (segment n), each

    file header:  magic "HSRJ" (4) | version u8 | reserved (3)
    record:       crc32 u32 | command_len u32 | idx u64 | term u64 | command bytes
                  crc32 covers command_len, idx, term and the command

A segment of version 2 is a reused one (below): its records' crc32 starts from a seed made
of the segment's number, so that the records of the file's earlier use, which follow the
log's end there, fail their check.

Records are added at the end of the newest segment; once it holds `segment_bytes_max`
(RAFT_JOURNAL_SEGMENT_BYTES) the next record starts a new one (the full one is cut to its
records and fdatasynced first, so only the newest segment can end in a torn write). The
newest segment is grown ahead of its records by zeros, RAFT_JOURNAL_EXTEND_BYTES at a time,
and its records are written over them in place: an fdatasync then makes the bytes durable
without committing a new file size, 20-35% less time and CPU per sync with three nodes on
one disk. The zeros are written (`_grow`) where records are small, so that an fdatasync
need not also commit blocks allocated unwritten (fallocate's) as written: x1.06-1.20 rows/s
at waited appends of 100 to 2,000 rows. Entries run on from segment to
segment, their indexes contiguous. Dropping the first entries after a checkpoint
(`drop_first`) stores where the log now starts, `journal_start` = [segment, position] in
raft.meta, and removes the segments wholly before it: no byte is copied (a checkpoint of
the single file rewrote every kept entry, which on a follower that applies behind what it
receives was most of the log, on the Raft thread). Segments before `journal_start` that a
crash left behind are removed at the next open.

Reuse: a full segment a checkpoint freed is renamed `raft.spare.<n>` (up to
RAFT_JOURNAL_SPARES_MAX of them, while the disk has RAFT_JOURNAL_SPARES_FREE_BYTES_MIN
free) instead of removed, and the next new segment is a spare renamed, its header rewritten
as version 2: its blocks are written already, so its records need neither zeros written
ahead of them nor fallocate's unwritten blocks converted at their fdatasync (x1.16 rows/s
at waited 10,000-row appends, x1.17 pipelined: docs/benchmark.md). Each write there runs on
with zeros to the end of its page (a write into part of a page the cache no longer holds
reads the page from the disk first; the next write starts in this cached page). Recovery of
such a segment stops at the first record that fails: what follows is the earlier use's
records, or the page's zeros, not corruption, unless a valid record of the next index
follows (searched for by its 8 index bytes): then the failing record is damage in the
middle of the log, as in version 1. Opening cuts the segment there (the old records after
it gone, so none of the same seed can outlive a crash). Spares give their room back to the
file system: all of them once a look at the disk (at most once a second, from the Raft
tick's housekeeping: `check_spares_room`) finds less than RAFT_JOURNAL_SPARES_FREE_BYTES_MIN
free, or at once when a write of this journal finds the disk full (ENOSPC, EDQUOT).

`add()` only writes (page cache); `sync()` makes everything written so far durable with one
fdatasync. The replication adapter calls `sync()` before a follower acknowledges entries and
before the leader counts itself toward a commit, so "acknowledged" means "fsynced on a
majority". Group commit falls out of this: every entry added during one tick shares one
fdatasync.

Term, vote and commit index live in `<dir>/raft.meta`, written atomically (tmp, fsync,
rename, fsync dir). Term and vote are stored synchronously before pysyncobj sends any message
that reflects them; the commit index at most once per second (a stale commit index is safe:
it only delays re-applying entries after a restart).

Environment errors (ENOSPC, EIO) fail a call cleanly: see `DurableJournal`.

Memory: the journal holds the commands of its newest entries, up to
RAFT_LOG_RESIDENT_BYTES, and of its first two (pysyncobj reads the first entry's index on
every send, and the first two are a checkpoint's trailer); an older command is read back
from its segment, CRC-checked, when asked for (a follower that fell behind, a restart's
replay). The log may hold up to RAFT_LOG_BYTES_MAX between checkpoints without the node
holding it all in RAM.

Recovery: opening fsyncs the segments and the directory (a run killed before its fdatasync
left entries in the page cache only; they are durable before a follower acknowledges them).
A record that is incomplete or fails its CRC at the very end of the newest segment (or,
in a reused one, is not followed by the next record) is a torn
write (it was never acknowledged, because acknowledgement waits for fdatasync): it is
truncated with a WARNING. Zeros from where the records end to the end of the file are the
grown tail (or writes a power loss took back to it): cut silently. A failing record
followed by more data, or anywhere in an older segment, is corruption: the node refuses to
start (CorruptionError) rather than forget acknowledged entries. So is a failing record
whose index `raft.meta` says was fdatasynced (`synced_last_index`, stored with the
commit index at most once per second, and at once when the log is cut below it): a damaged
length field can make an old record look like a torn tail, and a node that dropped entries
it acknowledged could vote a candidate missing committed entries into office.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import json
import logging
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from hastream.checksum import crc32
from hastream.errors import CorruptionError
from raftstore import limits, trace
from raftstore.storage import checkpoint
from raftstore.storage.files import (
    FILE_MODE,
    PAGE_BYTES,
    REAL_FILES,
    Files,
    all_zeros,
    drop_behind,
    ensure_dir,
    page_floor,
    read_all,
    write_all_at,
)
from raftstore.storage.kernel_sync import KernelSync, open_kernel_sync

log = logging.getLogger(__name__)

FILE_MAGIC: Final = b"HSRJ"
FILE_VERSION: Final = 1
FILE_VERSION_REUSED: Final = 2  # a spare reused: records' crc32 seeded (_Segment.take_version)
_FILE_HEADER: Final = struct.Struct("<4sB3x")
_RECORD_HEADER: Final = struct.Struct("<IIQQ")  # crc32, command_len, idx, term
_CRC_COVERED: Final = struct.Struct("<IQQ")  # command_len, idx, term
META_KIND: Final = b"META"
COMMAND_BYTES_MAX: Final = 1 << 31
SEGMENT_NAME: Final = "raft.journal"  # segment 0; segment n is "raft.journal.<n>"
SPARE_PREFIX: Final = "raft.spare."  # a freed segment kept for reuse: "raft.spare.<n>"
# How often a journal holding spares asks the file system for its free room (statvfs).
SPARES_ROOM_CHECK_S: Final = 1.0
_NO_ROOM: Final = frozenset({errno.ENOSPC, errno.EDQUOT})  # a write's errno: the disk is full
_INDEX: Final = struct.Struct("<Q")
_INDEX_OFFSET: Final = 8  # where a record header holds its idx
_ZERO_PAGE: Final = memoryview(bytes(PAGE_BYTES))
# The first entries, always held in memory (pysyncobj reads log[0] and log[1] often).
_PINNED: Final = 2
# Not O_APPEND: records are written in place, over the zeros a segment was grown by.
_OPEN_FLAGS: Final = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC

Entry = tuple[bytes, int, int]  # (command, idx, term): pysyncobj's journal entry shape


def _encode_record(command: bytes, idx: int, term: int, seed: int) -> tuple[bytes, bytes]:
    covered = _CRC_COVERED.pack(len(command), idx, term)
    crc = crc32(command, crc32(covered, seed))
    return struct.pack("<I", crc) + covered, command


def _record_crc(view: memoryview, position: int, length: int, seed: int) -> int:
    """The crc32 of the record at `position` whose command is `length` bytes."""
    body = position + _RECORD_HEADER.size
    return crc32(view[body : body + length], crc32(view[position + 4 : body], seed))


def _page_rest(end: int, size: int) -> memoryview:
    """Zeros from `end` to the end of its page, not past `size` (a reused segment's writes
    cover their last page whole: `DurableJournal.append`)."""
    return _ZERO_PAGE[: max(0, min(-end % PAGE_BYTES, size - end))]


def segment_path(directory: Path, seq: int) -> Path:
    return directory / (SEGMENT_NAME if seq == 0 else f"{SEGMENT_NAME}.{seq}")


def segment_seq(name: str) -> int | None:
    """The segment number a file name stands for, or None (not a segment)."""
    if name == SEGMENT_NAME:
        return 0
    prefix, _, number = name.partition(f"{SEGMENT_NAME}.")
    if prefix or not number.isdigit() or number.startswith("0"):
        return None
    return int(number)


def segment_paths(directory: Path, files: Files = REAL_FILES) -> list[Path]:
    """The journal's segment files in `directory`, oldest first (empty: no journal)."""
    if not files.exists(directory):
        return []
    seqs = sorted(
        seq for name in files.listdir(directory) if (seq := segment_seq(name)) is not None
    )
    return [segment_path(directory, seq) for seq in seqs]


def live_segments(directory: Path, files: Files = REAL_FILES) -> list[tuple[Path, int]]:
    """Each segment file that holds the log, with the position its first live record is at
    (an inspection for tools and fault tests; the node never calls it)."""
    start_seq, start_position = 0, _FILE_HEADER.size
    with contextlib.suppress(FileNotFoundError):
        meta = json.loads(checkpoint.read_checked(directory / "raft.meta", META_KIND, files=files))
        start_seq, start_position = meta.get("journal_start", [start_seq, start_position])
    live = []
    for path in segment_paths(directory, files):
        seq = segment_seq(path.name)
        assert seq is not None
        if seq >= start_seq:
            live.append((path, start_position if seq == start_seq else _FILE_HEADER.size))
    return live


# Records up to this size grow the newest segment by written zeros, bigger ones by fallocate
# (`_grow`). Measured as waited appends (bench.checkouts_ab, rows/s against fallocate
# alone): records of 6.6 KiB x1.16-1.20, 64 KiB x1.12-1.15, 128 KiB x1.06-1.07, 320 KiB
# x0.95-1.02: past a few hundred KiB a MiB of zeros holds too few fdatasyncs to pay.
_ZERO_FILL_RECORD_BYTES_MAX: Final = 128 * 1024


@dataclass(slots=True)
class _Segment:
    seq: int
    path: Path
    fd: int
    end: int  # where the next record goes: the end of the records
    # The file's size: `end`, plus the zeros it was grown by (`_grow`), or, reused, the
    # earlier use's records still after `end`.
    size: int
    dropped: int = 0  # the page cache was told to forget [0, dropped) (_drop_behind)
    version: int = FILE_VERSION  # FILE_VERSION_REUSED: a spare's file
    seed: int = 0  # where its records' crc32 starts: set with the version (`take_version`)

    def take_version(self, version: int) -> None:
        """The header's version, and with it the seed: 0 (plain crc32) in version 1; in a
        reused segment the crc32 of its number, which no earlier use of the file had
        (numbers only grow, and spares are removed when a journal starts over)."""
        self.version = version
        self.seed = crc32(_INDEX.pack(self.seq)) if version == FILE_VERSION_REUSED else 0

    @property
    def reused(self) -> bool:
        return self.version == FILE_VERSION_REUSED


class SyncWaker(Protocol):
    """How the journal's owner hears that an fdatasync `sync_ahead` started has returned,
    once `want_wake` asked for it."""

    def wake(self) -> None:
        """Called on the journal's helper thread right after the fdatasync returned."""

    def watch(self, fd: int) -> None:
        """Called on the journal's own thread: poll `fd`, which turns readable once the
        kernel's fdatasync has returned (kernel_sync.py), and run the journal's owner then."""


@dataclass(eq=False)
class _SyncAhead:
    """An fdatasync of the newest segment `DurableJournal.sync_ahead` started: run by the
    kernel (`done` None: kernel_sync.py) or on the journal's helper thread."""

    segment: _Segment
    count: int  # the entries written when it started: it covers the first `count`
    end: int  # the segment's end then
    started: float
    done: threading.Lock | None  # the helper thread's: held until the fdatasync returned
    waker: SyncWaker | None  # told once it returned, if `wake_wanted` by then
    wake_wanted: bool = False
    returned: bool = False  # the kernel's fdatasync returned (its result taken)
    # When it returned: the helper thread's clock right after; for the kernel's, when the
    # journal saw it had (a poll or a wait), a little later.
    finished_at: float = 0.0
    error: OSError | None = None


def _call_wake(ahead: _SyncAhead) -> None:
    if ahead.waker is not None:
        with contextlib.suppress(OSError):  # a full wake-up pipe is awake already
            ahead.waker.wake()


class DurableJournal:
    """The Raft log of one group on one node. Used by one thread at a time: pysyncobj's tick
    thread, or a leader's proposing thread holding the member's tick lock (replication.py);
    but for the fdatasync `sync_ahead` hands to the kernel or to its own helper thread.

    Environment errors (a full disk, EIO) fail cleanly: a write method that raises OSError
    leaves the files and the entries in memory as they were before the call (a partial
    write is cut off with ftruncate). Two failures refuse every later write with
    CorruptionError (`failed`): a partial write that cannot be cut off, and a failed
    fdatasync, because Linux marks the pages clean after a writeback error, so a retried
    fdatasync could succeed without the entries being on disk (the journal must then be
    reopened: recovery reads what the disk really holds).
    """

    def __init__(
        self,
        directory: Path,
        *,
        files: Files = REAL_FILES,
        resident_bytes_max: int = limits.RAFT_LOG_RESIDENT_BYTES,
        segment_bytes_max: int = limits.RAFT_JOURNAL_SEGMENT_BYTES,
        extend_bytes: int = limits.RAFT_JOURNAL_EXTEND_BYTES,
        spares_max: int = limits.RAFT_JOURNAL_SPARES_MAX,
        spares_free_bytes_min: int = limits.RAFT_JOURNAL_SPARES_FREE_BYTES_MIN,
        kernel_syncs: bool = True,
    ) -> None:
        self._files = files
        self._resident_bytes_max = resident_bytes_max
        self._segment_bytes_max = segment_bytes_max
        self._extend_bytes = extend_bytes
        self._spares_max = spares_max
        self._spares_free_bytes_min = spares_free_bytes_min
        self._spares: list[Path] = []  # freed segments kept for reuse
        self._spares_room_checked_at = float("-inf")  # check_spares_room's last look
        ensure_dir(files, directory, root=directory)
        self._directory = directory
        self._meta_path = directory / "raft.meta"
        # Entry i is (command, index, term) in segment `_seqs[i]` at file position
        # `_positions[i]`; its command is None when it was dropped from memory (read back
        # from the file on demand).
        self._commands: list[bytes | None] = []
        self._indexes: list[int] = []
        self._terms: list[int] = []
        self._seqs: list[int] = []
        self._positions: list[int] = []
        self._segments: list[_Segment] = []  # oldest first; records go to the last
        self._by_seq: dict[int, _Segment] = {}
        self._next_seq = 0
        self._bytes_total = 0  # command bytes of the entries
        # Commands [_PINNED, _evict_upto) are out of memory; [_evict_upto, len) are held
        # and add up to _resident_bytes (the pinned first two are not counted).
        self._evict_upto = _PINNED
        self._resident_bytes = 0
        self._dirty = False
        self._failed: CorruptionError | None = None
        self._meta: dict[str, Any] = self._load_meta()
        self._meta_dirty = False
        self.syncs = 0  # fdatasync calls, for stats
        # The index of the last entry an fdatasync covered (every entry at open is synced).
        self._synced_index = 0
        self._ahead: _SyncAhead | None = None
        self._ahead_requests: queue.SimpleQueue[_SyncAhead | None] | None = None
        self._ahead_thread: threading.Thread | None = None
        # `sync_ahead`'s fdatasyncs run by the kernel (kernel_sync.py), opened at the first;
        # only for the real files (a test's files intercept fdatasync in Python).
        self._kernel_syncs = kernel_syncs and files is REAL_FILES
        self._kernel: KernelSync | None = None
        try:
            self._open_and_recover()
        except BaseException:
            for segment in self._segments:
                self._files.close(segment.fd)
            raise

    # --- recovery -------------------------------------------------------------------

    def _load_meta(self) -> dict[str, Any]:
        try:
            body = checkpoint.read_checked(self._meta_path, META_KIND, files=self._files)
        except FileNotFoundError:
            return {}
        try:
            meta = json.loads(body)
        except ValueError as error:
            raise CorruptionError(str(self._meta_path), 0, f"not JSON: {error}") from error
        if not isinstance(meta, dict):
            raise CorruptionError(str(self._meta_path), 0, f"not a JSON object: {meta!r}")
        for key in ("term", "commit_index", "synced_last_index"):
            if key in meta and type(meta[key]) is not int:
                raise CorruptionError(str(self._meta_path), 0, f"{key} is {meta[key]!r}")
        start = meta.get("journal_start", [0, _FILE_HEADER.size])
        if (
            type(start) is not list
            or len(start) != 2
            or not all(type(value) is int for value in start)
            or start[0] < 0
            or start[1] < _FILE_HEADER.size
        ):
            raise CorruptionError(str(self._meta_path), 0, f"journal_start is {start!r}")
        return meta

    def _open_and_recover(self) -> None:
        start_seq, start_position = self._meta.get("journal_start", [0, _FILE_HEADER.size])
        # A compaction of older versions may have left its copy behind.
        with contextlib.suppress(FileNotFoundError):
            self._files.unlink(self._directory / f"{SEGMENT_NAME}.tmp")
        seqs = [segment_seq(path.name) for path in segment_paths(self._directory, self._files)]
        found = sorted(seq for seq in seqs if seq is not None)
        stale = [seq for seq in found if seq < start_seq]
        try:
            for seq in stale:  # before the log's start: a crash came between the two steps
                self._files.unlink(segment_path(self._directory, seq))
            if stale:
                self._files.fsync_dir(self._directory)
        except OSError as error:  # garbage: the next cut or open removes it
            log.warning("journal segments before the log's start not removed yet: %s", error)
        live = [seq for seq in found if seq >= start_seq]
        self._spares = self._find_spares(keep=bool(live))
        if live and live[0] != start_seq:
            raise CorruptionError(
                str(segment_path(self._directory, start_seq)),
                0,
                f"journal segment {start_seq}, where raft.meta says the log starts, is missing",
            )
        if not live:  # a new journal (or one whose files are gone: identity.py tells)
            self._next_seq = start_seq
            self._new_segment()
            if start_position != _FILE_HEADER.size:
                self._store_meta({"journal_start": [start_seq, _FILE_HEADER.size]})
            return
        for number, seq in enumerate(live):
            path = segment_path(self._directory, seq)
            fd = self._files.open(path, _OPEN_FLAGS, FILE_MODE)
            segment = _Segment(seq, path, fd, 0, 0)
            self._segments.append(segment)
            self._by_seq[seq] = segment
            last = number == len(live) - 1
            self._recover_segment(segment, start_position if number == 0 else None, last=last)
        self._next_seq = live[-1] + 1
        # A run killed before its fdatasync leaves entries in the page cache: durable before
        # anyone relies on them (a follower would acknowledge them). Also the directory: a
        # run killed between a rename (raft.meta) or a new segment and the directory's fsync.
        for segment in self._segments:
            self._files.fsync(segment.fd)
        self._files.fsync_dir(self._directory)
        self._synced_index = self._indexes[-1] if self._indexes else 0

    def _find_spares(self, *, keep: bool) -> list[Path]:
        """The spares in the directory; all removed instead unless `keep`
        (a journal that starts over numbers its segments anew, and a spare's old records
        could then carry the seed of a new segment of its number)."""
        spares = [
            self._directory / name
            for name in self._files.listdir(self._directory)
            if name.startswith(SPARE_PREFIX) and name[len(SPARE_PREFIX) :].isdigit()
        ]
        if keep:
            return spares
        for path in spares:  # an OSError fails the open: the node retries it at its start
            self._files.unlink(path)
        if spares:
            self._files.fsync_dir(self._directory)
        return []

    def _new_segment(self) -> None:
        """Start segment `_next_seq` (header written and durable with its name) as the one
        records go to: a spare reused if there is one, else a new file. A failure leaves no
        such segment (nor a header cut short)."""
        seq = self._next_seq
        path = segment_path(self._directory, seq)
        segment = self._reuse_spare(seq, path) if self._spares else None
        if segment is None:
            fd = self._files.open(path, _OPEN_FLAGS | os.O_TRUNC, FILE_MODE)
            try:
                write_all_at(self._files, fd, 0, [_FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION)])
                self._files.fsync(fd)
                self._files.fsync_dir(self._directory)
            except BaseException:
                self._files.close(fd)
                with contextlib.suppress(OSError):
                    self._files.unlink(path)
                raise
            segment = _Segment(seq, path, fd, _FILE_HEADER.size, _FILE_HEADER.size)
        self._segments.append(segment)
        self._by_seq[seq] = segment
        self._next_seq = seq + 1

    def _reuse_spare(self, seq: int, path: Path) -> _Segment | None:
        """A spare as segment `seq`: its header rewritten as version 2 and made
        durable before the rename makes it the segment (a crash between leaves a spare).
        None, with that spare removed, when any step fails: a new file is made instead."""
        spare = self._spares.pop()
        fd = None
        try:
            fd = self._files.open(spare, os.O_RDWR | os.O_CLOEXEC, FILE_MODE)
            size = self._files.size(fd)
            header = _FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION_REUSED)
            write_all_at(self._files, fd, 0, [header, _page_rest(len(header), size)])
            self._files.fsync(fd)
            self._files.replace(spare, path)
            self._files.fsync_dir(self._directory)
        except OSError as error:
            log.warning("journal spare not reused path=%s: %s", spare, error)
            if fd is not None:
                self._files.close(fd)
            with contextlib.suppress(OSError):
                self._files.unlink(spare)
            with contextlib.suppress(OSError):
                self._files.unlink(path)
            return None
        segment = _Segment(seq, path, fd, _FILE_HEADER.size, max(size, _FILE_HEADER.size))
        segment.take_version(FILE_VERSION_REUSED)
        return segment

    def _recover_segment(self, segment: _Segment, start: int | None, *, last: bool) -> None:
        """Load the records of `segment` from `start` (None: after its header). Only the
        last segment may end in a torn write; an empty file there is a segment whose creation
        a crash interrupted (it gets its header)."""
        data = read_all(self._files, segment.fd)
        if not data and last and start in (None, _FILE_HEADER.size):
            write_all_at(self._files, segment.fd, 0, [_FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION)])
            segment.end = segment.size = _FILE_HEADER.size
            return
        if len(data) < _FILE_HEADER.size:
            raise CorruptionError(
                str(segment.path), 0, f"journal of {len(data)} bytes is shorter than its header"
            )
        magic, version = _FILE_HEADER.unpack_from(data, 0)
        if magic != FILE_MAGIC or version not in (FILE_VERSION, FILE_VERSION_REUSED):
            raise CorruptionError(str(segment.path), 0, f"bad journal header {magic!r} v{version}")
        segment.take_version(version)
        position = _FILE_HEADER.size if start is None else start
        if position > len(data):
            raise CorruptionError(
                str(segment.path),
                position,
                f"raft.meta says the log starts at {position}, past the end ({len(data)})",
            )
        end = self._scan(segment, data, position, last=last)
        if end < len(data):
            self._files.ftruncate(segment.fd, end)
        segment.end = segment.size = end

    def _scan(self, segment: _Segment, data: bytes, position: int, *, last: bool) -> int:
        """Load every valid record from `position`; return where valid data ends (a torn
        tail of the last segment is cut there)."""
        view = memoryview(data)
        while position < len(data):
            problem = self._check_record(segment, view, position)
            if problem is not None:
                if not last:
                    raise CorruptionError(str(segment.path), position, problem)
                self._torn_or_corrupt(segment, data, position, problem)
                return position
            _, length, idx, term = _RECORD_HEADER.unpack_from(view, position)
            start = position + _RECORD_HEADER.size
            command = bytes(view[start : start + length])
            self._append_entry(command, idx, term, segment.seq, position)
            position = start + length
        return position

    def _check_record(self, segment: _Segment, view: memoryview, position: int) -> str | None:
        if position + _RECORD_HEADER.size > len(view):
            return "incomplete record header"
        crc, length, idx, _ = _RECORD_HEADER.unpack_from(view, position)
        start = position + _RECORD_HEADER.size
        if start + length > len(view):
            return f"record of {length} bytes runs past end of file"
        computed = _record_crc(view, position, length, segment.seed)
        if computed != crc:
            return f"crc mismatch stored={crc:#x} computed={computed:#x}"
        if self._indexes and idx != self._indexes[-1] + 1:
            # A valid record that breaks the index chain is never a torn write.
            raise CorruptionError(
                str(segment.path), position, f"index {idx} does not follow {self._indexes[-1]}"
            )
        return None

    def _torn_or_corrupt(self, segment: _Segment, data: bytes, position: int, problem: str) -> None:
        """A torn write is the last thing in the file: the failing record reaches the end of
        the file, or only zero bytes follow it, and it was never fdatasynced. Anything else is
        corruption (in a reused segment: `_no_next_record`)."""
        view = memoryview(data)
        synced_last = int(self._meta.get("synced_last_index", 0))
        if self._indexes and self._indexes[-1] + 1 <= synced_last:
            raise CorruptionError(
                str(segment.path),
                position,
                f"{problem}; entry {self._indexes[-1] + 1} was fdatasynced "
                f"(synced_last_index {synced_last} in raft.meta), so this is no torn write",
            )
        if all_zeros(view[position:]):
            return  # the zeros the segment was grown by (a write there lost, if any)
        if segment.reused and self._indexes:
            self._no_next_record(segment, data, position, problem)
            log.info(
                "reused journal segment ends path=%s position=%d detail=%s",
                segment.path,
                position,
                problem,
            )
            return
        length = 0
        if position + _RECORD_HEADER.size <= len(view):
            _, length, _, _ = _RECORD_HEADER.unpack_from(view, position)
        record_end = position + _RECORD_HEADER.size + length
        if record_end < len(view) and not all_zeros(view[record_end:]):
            raise CorruptionError(str(segment.path), position, problem)
        log.warning(
            "truncated torn journal tail path=%s position=%d detail=%s",
            segment.path,
            position,
            problem,
        )

    def _no_next_record(self, segment: _Segment, data: bytes, position: int, problem: str) -> None:
        """In a reused segment, the failing record at `position` ends the log unless a
        valid record of the next index lies after it (its index field's 8 bytes searched
        for, each find checked whole): then it is damage inside the log."""
        wanted = self._indexes[-1] + 2  # the record after the one failing here
        needle = _INDEX.pack(wanted)
        view = memoryview(data)
        found = data.find(needle, position + _INDEX_OFFSET)
        while found != -1:
            start = found - _INDEX_OFFSET
            if self._valid_at(segment, view, start, wanted):
                raise CorruptionError(
                    str(segment.path),
                    position,
                    f"{problem}; entry {wanted} follows at {start}, so this is no log end",
                )
            found = data.find(needle, found + 1)

    @staticmethod
    def _valid_at(segment: _Segment, view: memoryview, position: int, idx: int) -> bool:
        """A whole record of index `idx` that passes its crc32 starts at `position`."""
        if position + _RECORD_HEADER.size > len(view):
            return False
        crc, length, found_idx, _ = _RECORD_HEADER.unpack_from(view, position)
        if found_idx != idx or position + _RECORD_HEADER.size + length > len(view):
            return False
        return bool(_record_crc(view, position, length, segment.seed) == crc)

    def _append_entry(self, command: bytes, idx: int, term: int, seq: int, position: int) -> None:
        self._commands.append(command)
        self._indexes.append(idx)
        self._terms.append(term)
        self._seqs.append(seq)
        self._positions.append(position)
        self._bytes_total += len(command)
        if len(self._commands) > self._evict_upto:
            self._resident_bytes += len(command)
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest held commands (not the pinned first two, nor the last) from
        memory while more than `resident_bytes_max` are held."""
        last = len(self._commands) - 1
        while self._resident_bytes > self._resident_bytes_max and self._evict_upto < last:
            command = self._commands[self._evict_upto]
            assert command is not None
            self._resident_bytes -= len(command)
            self._commands[self._evict_upto] = None
            self._evict_upto += 1

    # --- entries ----------------------------------------------------------------------

    def append(self, command: bytes, idx: int, term: int) -> None:
        """Write one entry after the last (no fdatasync: see `sync`). Raises OSError from the
        disk, with nothing changed; CorruptionError once the journal has failed."""
        self._check_writable()
        if not isinstance(command, bytes):
            command = bytes(command)
        assert len(command) < COMMAND_BYTES_MAX
        if self._indexes:
            assert idx == self._indexes[-1] + 1, f"journal gap: {idx} after {self._indexes[-1]}"
        segment = self._segments[-1]
        if segment.end >= self._segment_bytes_max and self._seqs and self._seqs[-1] == segment.seq:
            self._roll()
            segment = self._segments[-1]
        position = segment.end
        started = trace.clock()
        header, body = _encode_record(command, idx, term, segment.seed)
        end = position + len(header) + len(body)
        buffers: list[bytes | memoryview] = [header, body]
        try:
            if end > segment.size:
                self._grow(segment, end)
            if segment.reused:
                buffers.append(_page_rest(end, segment.size))
            try:
                write_all_at(self._files, segment.fd, position, buffers)
            except OSError as error:
                self._cut_back(segment, position, error)
                raise
        except OSError as error:
            if error.errno in _NO_ROOM:  # the zeros' growth or the record found the disk full
                self._release_spares(f"a write failed: {error}")
            raise
        segment.end = end
        segment.size = max(segment.size, segment.end)  # a write past the zeros grew the file
        self._append_entry(command, idx, term, segment.seq, position)
        self._dirty = True
        tracer = trace.current()
        if tracer.on:
            tracer.journal_added(command, idx, started, trace.clock())

    def _grow(self, segment: _Segment, needed: int) -> None:
        """Grow the newest segment to hold `needed` bytes and the next ones, by zeros (up
        to `extend_bytes` past its records, not past `segment_bytes_max` unless one record
        needs it): written for small records (a write that fails fails the append, with
        nothing changed), allocated (`Files.extend`) for big ones (where that cannot, the
        record's write grows the file itself).

        Why two ways: ext4's fallocate leaves the blocks *unwritten*, and the fdatasync
        after a record that first fills one must also commit that block's conversion to
        written in the file system's journal: a second device flush. Written zeros cost
        about 1.5 ms per MiB here, once (the first fdatasync after them writes them and
        allocates their blocks); every later fdatasync over them is one flush. For records
        of a few KiB to 128 KiB (waited appends of 1 to 2,000 rows) that pays (x1.06-1.20
        rows/s, docs/benchmark.md); for records of hundreds of KiB, a MiB holds only a few
        fdatasyncs and the zeros cost as much disk bandwidth as they save."""
        size = max(needed, min(segment.end + self._extend_bytes, self._segment_bytes_max))
        if size > needed and needed - segment.end <= _ZERO_FILL_RECORD_BYTES_MAX:
            self._zero_fill(segment, size)
            segment.size = size
        elif self._files.extend(segment.fd, size):
            segment.size = size

    def _zero_fill(self, segment: _Segment, size: int) -> None:
        """Write zeros from the file's end to `size`. Raises the write's OSError with the
        file cut back as it was, as a failed record write: the record was to go there (a
        disk without room for a MiB of zeros is one the data files have filled already:
        docs/durability.md). Not fdatasynced here: the next `sync` writes them with the
        first record over them (its file system journal commit allocates the whole range
        once), and an fdatasync failing here could be the one report of an error in the
        records written before."""
        start = max(segment.size, segment.end)
        try:
            write_all_at(self._files, segment.fd, start, [bytes(size - start)])
        except OSError:
            # Zeros past the records are the grown tail even if this fails: harmless.
            with contextlib.suppress(OSError):
                self._files.ftruncate(segment.fd, start)
            raise

    def _roll(self) -> None:
        """Records go to a new segment from now on. The full one is cut to its records and
        made durable first, so that only the newest segment can ever end in a torn write
        (or in zeros)."""
        self._settle_ahead()
        full = self._segments[-1]
        if full.size > full.end:
            self._files.ftruncate(full.fd, full.end)
            full.size = full.end
        self._sync_newest()
        self._new_segment()

    def truncate_from(self, count: int) -> None:
        """Keep only the first `count` entries (a leader overwrote the rest)."""
        self._settle_ahead()
        if count < len(self._indexes):
            self._truncate_to(count)

    def drop_first(self, entry_to: int) -> None:
        """Drop the first `entry_to` entries, or all if there are fewer (after a checkpoint):
        raft.meta durably names where the log now starts, then the segments wholly before
        it are removed.

        Raises OSError from the disk (the fdatasync, or raft.meta not written) with nothing
        dropped. Removing the old segments can fail after that without an error: they are
        garbage, removed at the next drop or open."""
        self._check_writable()
        if entry_to <= 0:
            return
        entry_to = min(entry_to, len(self._indexes))
        # The start stored below must be within what is on disk, whatever a power loss
        # keeps: entries up to a checkpoint are applied, but a follower applies what its
        # leader committed before its own fdatasync.
        self.sync()
        if entry_to < len(self._indexes):
            start = [self._seqs[entry_to], self._positions[entry_to]]
        else:
            newest = self._segments[-1]
            start = [newest.seq, newest.end]
            if newest.reused and newest.size > newest.end:
                # The log will start at its end, with no record before it to tell what
                # index comes next: the earlier use's records after it go first.
                self._files.ftruncate(newest.fd, newest.end)
                self._files.fsync(newest.fd)
                newest.size = newest.end
        # The new first two stay in memory (pinned): read before anything changes.
        pinned = {i: self._command(i) for i in range(entry_to, min(entry_to + _PINNED, len(self)))}
        self._store_meta({"journal_start": start})
        self._bytes_total -= sum(self._length(i) for i in range(entry_to))
        self._commands = self._commands[entry_to:]
        for i, command in pinned.items():
            self._commands[i - entry_to] = command
        del self._indexes[:entry_to]
        del self._terms[:entry_to]
        del self._seqs[:entry_to]
        del self._positions[:entry_to]
        self._evict_upto = max(_PINNED, self._evict_upto - entry_to)
        self._resident_bytes = sum(
            len(command) for command in self._commands[self._evict_upto :] if command is not None
        )
        self._remove_segments_before(start[0])

    def _remove_segments_before(self, seq: int) -> None:
        """Remove the segments before `seq`, keeping the newest full ones as spares
        (renamed) while there are fewer than `spares_max`."""
        gone = [segment for segment in self._segments if segment.seq < seq]
        if not gone:
            return
        self._segments = [segment for segment in self._segments if segment.seq >= seq]
        for segment in gone:
            del self._by_seq[segment.seq]
            with contextlib.suppress(OSError):
                self._files.close(segment.fd)
        try:
            for segment in reversed(gone):
                if self._keeps_spare(segment):
                    spare = self._directory / f"{SPARE_PREFIX}{segment.seq}"
                    self._files.replace(segment.path, spare)
                    self._spares.append(spare)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        self._files.unlink(segment.path)
            self._files.fsync_dir(self._directory)
        except OSError as error:
            log.warning(
                "journal segments before the log's start not removed yet dir=%s: %s",
                self._directory,
                error,
            )

    def _keeps_spare(self, segment: _Segment) -> bool:
        """Whether a freed `segment` is kept as a spare: a full one, while there are
        fewer than `spares_max` and the disk has `spares_free_bytes_min` free besides."""
        if len(self._spares) >= self._spares_max or segment.size < self._segment_bytes_max:
            return False
        free = self._free_bytes()
        return free is not None and free >= self._spares_free_bytes_min

    def _free_bytes(self) -> int | None:
        """The journal's file system's free room; None when `statvfs` fails."""
        try:
            return self._files.free_bytes(self._directory)
        except OSError:
            return None

    def check_spares_room(self, now: float) -> None:
        """Give the spares' room back once the file system has less than
        `spares_free_bytes_min` free: the data files, another journal or another program
        filled it since they were kept, and the room is theirs first. Called from the Raft
        tick's housekeeping with its monotonic clock; looks at most every
        SPARES_ROOM_CHECK_S, and not at all while the journal holds no spare."""
        if not self._spares or now < self._spares_room_checked_at + SPARES_ROOM_CHECK_S:
            return
        self._spares_room_checked_at = now
        free = self._free_bytes()  # None, no answer: kept, and asked again at the next look
        if free is not None and free < self._spares_free_bytes_min:
            self._release_spares(f"{free} bytes free, under {self._spares_free_bytes_min}")

    def _release_spares(self, reason: str) -> None:
        """Remove every spare now. Not made durable (no directory fsync): a spare a crash
        brings back is only reused, or removed by the next look."""
        released = 0
        while self._spares:
            spare = self._spares.pop()
            try:
                self._files.unlink(spare)
            except FileNotFoundError:
                continue
            except OSError as error:
                log.warning("journal spare not removed path=%s: %s", spare, error)
                continue
            released += 1
        if released:
            log.warning(
                "journal spares removed dir=%s count=%d: %s", self._directory, released, reason
            )

    def _command(self, i: int) -> bytes:
        command = self._commands[i]
        return command if command is not None else self._read_back(i, i + 1)[0]

    def _read_back(self, first: int, stop: int) -> list[bytes]:
        """The commands of entries [first, stop) from their segments, each checked against
        its CRC, index and term (a mismatch is corruption: the file changed under the
        node)."""
        commands: list[bytes] = []
        i = first
        while i < stop:
            seq = self._seqs[i]
            run_stop = min(stop, bisect.bisect_right(self._seqs, seq, i))
            commands += self._read_run(self._by_seq[seq], i, run_stop)
            i = run_stop
        return commands

    def _read_run(self, segment: _Segment, first: int, stop: int) -> list[bytes]:
        start = self._positions[first]
        end = self._record_end(stop - 1)
        data = self._files.pread(segment.fd, end - start, start)
        if len(data) != end - start:
            raise CorruptionError(str(segment.path), start, "journal shorter than its index")
        view = memoryview(data)
        commands: list[bytes] = []
        offset = 0
        for i in range(first, stop):
            crc, length, idx, term = _RECORD_HEADER.unpack_from(view, offset)
            body = offset + _RECORD_HEADER.size
            computed = _record_crc(view, offset, length, segment.seed)
            if (crc, idx, term) != (computed, self._indexes[i], self._terms[i]):
                raise CorruptionError(
                    str(segment.path),
                    start + offset,
                    f"record read back is not entry {self._indexes[i]} (term {self._terms[i]}): "
                    f"index {idx}, term {term}, crc stored={crc:#x} computed={computed:#x}",
                )
            commands.append(bytes(view[body : body + length]))
            offset = body + length
        return commands

    def entries(
        self, first: int, count: int | None = None, bytes_max: int | None = None
    ) -> list[Entry]:
        """Entries from position `first` on: at most `count`, and with `bytes_max` only as
        many as reach it (the one that crosses it included, as pysyncobj's __getEntries)."""
        stop = len(self) if count is None else min(len(self), first + count)
        first = max(0, first)
        if bytes_max is not None:
            total = 0
            for i in range(first, stop):
                total += self._length(i)
                if total >= bytes_max:
                    stop = i + 1
                    break
        if first >= stop:
            return []
        commands = self._commands[first:stop]
        evicted_from, evicted_to = max(first, _PINNED), min(stop, self._evict_upto)
        if evicted_from < evicted_to:
            commands[evicted_from - first : evicted_to - first] = self._read_back(
                evicted_from, evicted_to
            )
        return [
            (command, idx, term)  # type: ignore[misc]
            for command, idx, term in zip(
                commands, self._indexes[first:stop], self._terms[first:stop], strict=True
            )
        ]

    def terms(self, index: int, count: int) -> list[int]:
        """The terms of up to `count` entries from Raft index `index` on (none when the log
        does not hold `index`), without reading their commands."""
        if not self._indexes or index < self._indexes[0]:
            return []
        first = index - self._indexes[0]
        return self._terms[first : first + count]

    def command_bytes(self, index: int, count: int) -> int:
        """The command bytes of up to `count` entries from Raft index `index` on (0 when the
        log does not hold `index`), from the record positions: no command is read back."""
        if not self._indexes or index < self._indexes[0]:
            return 0
        first = index - self._indexes[0]
        return sum(self._length(i) for i in range(first, min(len(self), first + count)))

    def _record_end(self, i: int) -> int:
        """Where entry i's record ends in its segment."""
        following = i + 1
        if following < len(self._positions) and self._seqs[following] == self._seqs[i]:
            return self._positions[following]
        return self._by_seq[self._seqs[i]].end

    def _length(self, i: int) -> int:
        """Command bytes of entry i (from the record positions)."""
        return self._record_end(i) - self._positions[i] - _RECORD_HEADER.size

    def index_at(self, i: int) -> int:
        """The Raft index of the entry at position i (no read of its command)."""
        return self._indexes[i]

    def __getitem__(self, item: int | slice) -> Any:
        if isinstance(item, slice):
            first, stop, step = item.indices(len(self))
            assert step == 1, "journal slices are contiguous"
            return self.entries(first, max(0, stop - first))
        # pysyncobj reads log[-1] and log[0] many times per tick: the held case stays cheap.
        command = self._commands[item]  # IndexError as a list's
        if command is None:
            command = self._command(range(len(self))[item])
        return (command, self._indexes[item], self._terms[item])

    def __len__(self) -> int:
        return len(self._indexes)

    def close(self) -> None:
        """Sync, store the metadata and close. The files are closed even if that fails."""
        try:
            self.sync()
            self._store_meta_if_dirty()
        finally:
            self._stop_ahead()
            for segment in self._segments:
                self._files.close(segment.fd)
            self._segments = []
            self._by_seq = {}

    # --- term, vote, commit index ------------------------------------------------------

    def set_commit_index(self, commit_index: int) -> None:
        """Remembered, stored with the next `store_meta_if_changed` (a stale commit index
        only delays re-applying entries after a restart)."""
        if self._meta.get("commit_index") != commit_index:
            self._meta["commit_index"] = commit_index
            self._meta_dirty = True

    @property
    def commit_index(self) -> int:
        return int(self._meta.get("commit_index", 1))

    def set_term(self, term: int, voted_for_node_id: Any) -> None:
        """Raises OSError with term and vote unchanged (in memory; see `write_atomic` for the
        file); CorruptionError once the journal has failed."""
        # Raft: term and vote must be durable before any message reflecting them is sent.
        self._check_writable()
        self._store_meta({"term": term, "voted_for": voted_for_node_id})

    @property
    def term(self) -> int:
        return int(self._meta.get("term", 0))

    @property
    def voted_for(self) -> Any:
        return self._meta.get("voted_for")

    def store_meta_if_changed(self) -> None:
        """Store the commit index (and the synced index) if they moved since the last."""
        self._store_meta_if_dirty()

    # --- durability ------------------------------------------------------------------

    def sync(self) -> None:
        """Make every entry added so far durable (one fdatasync, after waiting for the one
        `sync_ahead` started, if any). Raises OSError the first time fdatasync fails,
        CorruptionError from then on (see the class docstring)."""
        self._check_writable()
        self._settle_ahead()
        if self._dirty:
            self._sync_newest()

    def sync_ahead(self, waker: SyncWaker | None = None) -> float | None:
        """Make what is written durable without waiting: start an fdatasync and return at
        once. The kernel runs it (kernel_sync.py) where it can, else the journal's helper
        thread; either way `waker` hears when it returned if `want_wake` asked for it.
        At most one runs: while it does, this does nothing; once it has returned, this
        takes what it made durable (`durable_index`) and starts the next one if entries
        were written since. Returns the seconds of an fdatasync it took (for the latency
        metric), else None. Raises like `sync` for an fdatasync that failed.

        The leader calls this instead of `sync`: its tick thread sends the new entries and
        takes the followers' acknowledgements while its own fdatasync runs, and its commit
        counts it only up to `durable_index` (replication.py). A follower syncs before it
        acknowledges, as before."""
        self._check_writable()
        took: float | None = None
        ahead = self._ahead
        if ahead is not None:
            if not self._returned(ahead):
                return None
            took = ahead.finished_at - ahead.started
            self._settle_ahead()
        if not self._dirty:
            return took
        self._ahead = self._start_ahead(self._segments[-1], waker)
        return took

    def _start_ahead(self, segment: _Segment, waker: SyncWaker | None) -> _SyncAhead:
        kernel = self._kernel_sync()
        if kernel is not None:
            try:
                kernel.submit(segment.fd)
            except OSError as error:
                # Refused before it started (a kernel before 4.18, a file system without
                # it): nothing of the file's state was consumed; the thread takes over.
                log.warning("kernel fdatasync refused, using a helper thread: %s", error)
                self._kernel_syncs = False
                self._close_kernel()
            else:
                count, started = len(self._indexes), trace.clock()
                return _SyncAhead(segment, count, segment.end, started, None, waker)
        if self._ahead_requests is None:
            self._ahead_requests = queue.SimpleQueue()
            self._ahead_thread = threading.Thread(
                target=self._ahead_loop,
                args=(self._ahead_requests,),
                name="journal-sync",
                daemon=True,
            )
            self._ahead_thread.start()
        done = threading.Lock()
        done.acquire()
        ahead = _SyncAhead(segment, len(self._indexes), segment.end, trace.clock(), done, waker)
        self._ahead_requests.put(ahead)
        return ahead

    def _kernel_sync(self) -> KernelSync | None:
        if self._kernel is None and self._kernel_syncs:
            self._kernel = open_kernel_sync()
            if self._kernel is None:
                log.warning("kernel fdatasync unavailable here, using a helper thread")
                self._kernel_syncs = False
        return self._kernel

    def _close_kernel(self) -> None:
        kernel, self._kernel = self._kernel, None
        if kernel is not None:
            with contextlib.suppress(OSError):
                kernel.close()

    def _returned(self, ahead: _SyncAhead) -> bool:
        """Whether the fdatasync `ahead` started has returned (a kernel's: one look at its
        eventfd, and its result taken if so)."""
        if ahead.done is not None:
            return not ahead.done.locked()
        if not ahead.returned:
            assert self._kernel is not None
            try:
                ahead.returned = self._kernel.poll()
            except OSError as error:
                ahead.error, ahead.returned = error, True
            if ahead.returned:
                ahead.finished_at = trace.clock()
        return ahead.returned

    @property
    def durable_index(self) -> int:
        """The index of the last entry an fdatasync has covered, counting one `sync_ahead`
        started that has returned without an error but is not taken yet."""
        ahead = self._ahead
        if ahead is not None and ahead.count and self._returned(ahead) and ahead.error is None:
            return max(self._synced_index, self._indexes[ahead.count - 1])
        return self._synced_index

    def _ahead_loop(self, requests: queue.SimpleQueue[_SyncAhead | None]) -> None:
        """The helper thread: one fdatasync per request, until None."""
        while (ahead := requests.get()) is not None:
            try:
                self._files.fdatasync(ahead.segment.fd)
            except OSError as error:
                ahead.error = error
            ahead.finished_at = trace.clock()
            assert ahead.done is not None
            ahead.done.release()
            if ahead.wake_wanted:  # read after the release: see want_wake
                _call_wake(ahead)

    def want_wake(self) -> None:
        """Ask to hear when the running fdatasync (if any) returns: the caller waits for it
        (the leader's commit). Without this it returns silently, and the tick thread, woken
        by the followers' acknowledgements anyway, is not woken once more per entry.
        The kernel's: the waker watches its eventfd (readable already if it has returned).
        The helper thread's: `wake_wanted` is set before the finish is checked, and read by
        the helper after it released: if both see the other's step, `wake` runs twice
        (harmless), never zero times."""
        ahead = self._ahead
        if ahead is None:
            return
        if ahead.done is None:
            if not ahead.returned and ahead.waker is not None:
                assert self._kernel is not None
                ahead.waker.watch(self._kernel.fileno())
            return
        ahead.wake_wanted = True
        if not ahead.done.locked():
            _call_wake(ahead)

    def _settle_ahead(self) -> None:
        """Wait for the fdatasync `sync_ahead` started, if any, and take what it made
        durable. Every call that changes the files (a truncation, a new segment, a drop, the
        close) comes here first: none runs beside it."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        if ahead.done is not None:
            ahead.done.acquire()
        elif not ahead.returned:
            assert self._kernel is not None
            try:
                self._kernel.wait()
            except OSError as error:
                ahead.error = error
            ahead.returned, ahead.finished_at = True, trace.clock()
        if ahead.error is not None:
            self._sync_failed(ahead.segment, ahead.error)
        # The entries it started with are all still here: anything that removes entries or
        # changes segments settles first.
        assert ahead.count <= len(self._indexes)
        assert ahead.segment is self._segments[-1]
        self._synced(ahead.count, ahead.started, ahead.finished_at)
        if ahead.segment.end == ahead.end:  # nothing written since it started
            self._dirty = False
            self._drop_behind(ahead.segment)

    def _stop_ahead(self) -> None:
        """End the helper thread and the kernel's context (close): the fdatasync either may
        run is waited for."""
        with contextlib.suppress(OSError, CorruptionError):
            self._settle_ahead()
        self._close_kernel()
        if self._ahead_requests is None:
            return
        self._ahead_requests.put(None)
        if self._ahead_thread is not None:
            self._ahead_thread.join(timeout=5)
        self._ahead_requests = self._ahead_thread = None

    def use_helper_thread(self) -> None:
        """`sync_ahead`'s fdatasyncs on the helper thread even where the kernel could run
        them (a measurement knob: tuning.py). Called before the first `sync_ahead`; a
        kernel context opened already would stay in use."""
        self._kernel_syncs = False

    def use_segment_bytes(self, segment_bytes_max: int) -> None:
        """Roll segments at `segment_bytes_max` from now on, never more than it was opened
        with (a measurement and test knob: tuning.py). The room kept free besides spares
        scales with them (RAFT_JOURNAL_SPARES_FREE_SEGMENTS segments)."""
        assert 0 < segment_bytes_max <= self._segment_bytes_max
        self._segment_bytes_max = segment_bytes_max
        room = limits.RAFT_JOURNAL_SPARES_FREE_SEGMENTS * segment_bytes_max
        self._spares_free_bytes_min = min(self._spares_free_bytes_min, room)

    def use_resident_bytes(self, resident_bytes_max: int) -> None:
        """Hold at most `resident_bytes_max` command bytes in memory from now on, never more
        than it was opened with (a test knob: tuning.py); the older ones are dropped now and
        read back from the segments when asked for."""
        assert 0 < resident_bytes_max <= self._resident_bytes_max
        self._resident_bytes_max = resident_bytes_max
        self._evict()

    @property
    def sync_fd(self) -> int | None:
        """The eventfd the kernel's fdatasyncs report on (kernel_sync.py), if they run."""
        return None if self._kernel is None else self._kernel.fileno()

    def _sync_newest(self) -> None:
        """fdatasync the segment records go to (every other one was synced when it was
        full)."""
        started = trace.clock()
        segment = self._segments[-1]
        try:
            self._files.fdatasync(segment.fd)
        except OSError as error:
            self._sync_failed(segment, error)
        self._dirty = False
        self._synced(len(self._indexes), started, trace.clock())
        self._drop_behind(segment)

    def _sync_failed(self, segment: _Segment, error: OSError) -> None:
        """An fdatasync failed: refuse every later write (see the class docstring)."""
        self._failed = CorruptionError(
            str(segment.path),
            segment.end,
            f"fdatasync failed ({error}): what it covered may not be on disk",
        )
        raise error

    def _synced(self, count: int, started: float, finished: float) -> None:
        """Bookkeeping after an fdatasync that covered the first `count` entries."""
        self.syncs += 1
        if not count:
            return
        last = self._indexes[count - 1]
        self._synced_index = max(self._synced_index, last)
        tracer = trace.current()
        if tracer.on:
            tracer.journal_synced(last, started, finished)
        if self._meta.get("synced_last_index") != last:
            self._meta["synced_last_index"] = last
            self._meta_dirty = True  # stored with the commit index (onOneSecondTimer)

    def _drop_behind(self, segment: _Segment) -> None:
        """Let the page cache forget what fdatasync made durable (`Files.drop_cached`: the
        next writes reuse those pages), once JOURNAL_DROP_BEHIND_BYTES have gathered. The
        file is read back only for a follower far behind or at a restart; the newest
        entries' commands are held in memory anyway (RAFT_LOG_RESIDENT_BYTES)."""
        if segment.end - segment.dropped < limits.JOURNAL_DROP_BEHIND_BYTES:
            return
        with contextlib.suppress(OSError):  # advisory: nothing depends on it
            segment.dropped = drop_behind(self._files, segment.fd, segment.dropped, segment.end)

    @property
    def dirty(self) -> bool:
        """Entries were written or truncated since the last fdatasync."""
        return self._dirty

    @property
    def settled(self) -> bool:
        """Nothing written since the last fdatasync, none running and the journal not
        failed: `sync` and `sync_ahead` would do nothing (most ticks ask)."""
        return not self._dirty and self._ahead is None and self._failed is None

    @property
    def failed(self) -> CorruptionError | None:
        """Why the journal refuses writes, or None."""
        return self._failed

    @property
    def bytes_total(self) -> int:
        """Command bytes in the log (held in memory or not)."""
        return self._bytes_total

    @property
    def resident_bytes(self) -> int:
        """Command bytes held in memory (the pinned first two not counted)."""
        return self._resident_bytes

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    def _check_writable(self) -> None:
        assert self._segments, "journal used after close()"
        if self._failed is not None:
            raise self._failed

    def _cut_back(self, segment: _Segment, position: int, error: OSError) -> None:
        """Remove what a failed write left after `position`; if even that fails, the journal
        refuses every later write (a later entry must never land after garbage)."""
        try:
            self._files.ftruncate(segment.fd, position)
            segment.size = position
        except OSError as cut_error:
            self._failed = CorruptionError(
                str(segment.path),
                position,
                f"cannot remove a partial write ({error}): {cut_error}",
            )
            raise self._failed from cut_error

    def _truncate_to(self, count: int) -> None:
        """Drop entries [count, ...). Raises OSError with nothing dropped, or, when the cut
        reaches back into an older segment, with some newer segments gone already: they go
        newest first and their entries with them, so the entries in memory are those on
        disk, and a crash leaves segments that chain up, ending earlier as the cut asked."""
        self._check_writable()
        kept_last = self._indexes[count - 1] if count else 0
        synced_last = int(self._meta.get("synced_last_index", 0))
        if synced_last > kept_last:
            # Durably before the cut: entries written later at these indexes are not synced,
            # and a torn one must not be taken for corruption.
            self._store_meta({"synced_last_index": kept_last})
        seq, position = self._seqs[count], self._positions[count]
        try:
            later = [segment for segment in self._segments if segment.seq > seq]
            for segment in reversed(later):
                with contextlib.suppress(FileNotFoundError):
                    self._files.unlink(segment.path)
                first = bisect.bisect_left(self._seqs, segment.seq)
                self._forget_tail(first, keep_through=segment.seq - 1)
            if later:
                self._files.fsync_dir(self._directory)
            self._files.ftruncate(self._by_seq[seq].fd, position)
            self._by_seq[seq].size = position
        except OSError:
            if synced_last > kept_last and self._indexes:
                # What is still in the log is as synced as it was.
                self._meta["synced_last_index"] = min(synced_last, self._indexes[-1])
                self._meta_dirty = True
            raise
        self._forget_tail(count, keep_through=seq)
        newest = self._segments[-1]
        newest.end = position
        newest.dropped = min(newest.dropped, page_floor(position))

    def _forget_tail(self, count: int, *, keep_through: int) -> None:
        """Entries [count, ...) leave memory, and the segments after `keep_through` (their
        files are gone)."""
        self._bytes_total -= sum(self._length(i) for i in range(count, len(self._indexes)))
        for segment in [segment for segment in self._segments if segment.seq > keep_through]:
            del self._by_seq[segment.seq]
            with contextlib.suppress(OSError):
                self._files.close(segment.fd)
        self._segments = [segment for segment in self._segments if segment.seq <= keep_through]
        for command in self._commands[max(count, self._evict_upto) :]:
            assert command is not None
            self._resident_bytes -= len(command)
        self._evict_upto = max(_PINNED, min(self._evict_upto, count))
        del self._commands[count:]
        del self._indexes[count:]
        del self._terms[count:]
        del self._seqs[count:]
        del self._positions[count:]
        self._synced_index = min(self._synced_index, self._indexes[-1] if self._indexes else 0)
        self._dirty = True

    def _store_meta_if_dirty(self) -> None:
        if self._meta_dirty:
            self._check_writable()
            self._store_meta({})

    def _store_meta(self, changes: dict[str, Any]) -> None:
        """Write the metadata with `changes` applied; memory changes only once it is durable
        (on OSError, the metadata in memory is as before)."""
        meta = {**self._meta, **changes}
        body = json.dumps(meta, sort_keys=True).encode()
        checkpoint.write_atomic(self._meta_path, META_KIND, body, files=self._files)
        self._meta = meta
        self._meta_dirty = False
