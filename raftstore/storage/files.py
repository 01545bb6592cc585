"""The storage layer's file interface, and what is built on it.

- `Files`: the few file operations `segments.py`, `journal.py` and `checkpoint.py` perform,
  as one Protocol, so a test can swap the disk for a simulated one.
- `RealFiles`: `os` itself (the default everywhere). The hot operations are the `os`
  builtins bound as static methods, so a call through the interface costs what a direct
  `os.writev` costs: no extra Python frame on the append path.
- `SimFiles`: an in-memory file system that keeps fsynced and un-fsynced state apart, for
  file data AND for directory entries (a created, renamed or removed name is durable only
  once its parent directory is fsynced, as on POSIX), and can lose power at any point
  (`crash`, `crash_at`), optionally keeping a random prefix of un-fsynced appended bytes.
  It also injects OSErrors (`fail`, `fail_randomly`, `disk_bytes_max`, `open_files_max`).
  In the spirit of TigerBeetle's simulated storage: in-process tests can lose power without
  touching the real file system.
- `ensure_dir`: a directory made durable in its parent (a power loss must never lose a
  directory the node relied on).
- `OpenFiles` / `FileHandle`: a process-wide bound on open data-file descriptors, so a
  thousand tables do not exhaust the fd limit; and `raise_fd_soft_limit`.

Contract of every writer: files are written through fds opened with `O_APPEND` (every
write lands at the end of the file; `ftruncate` moves the end), except the Raft journal's
segments, which `extend` grows ahead of their records and `pwritev` fills in place (an
fdatasync of bytes written over the file's own zeroed blocks need not commit a new size).
Nothing here seeks, so the simulated file system needs no per-fd position.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import logging
import os
import random
import resource
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final, Protocol, TypeVar

from raftstore import limits

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
_T = TypeVar("_T")

FILE_MODE: Final = 0o644
# The page cache's unit: `drop_cached` forgets whole pages only.
PAGE_BYTES: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Appends of at least this many bytes have their blocks allocated first (`preallocate`):
# below it the saving is smaller than the extra system call.
PREALLOCATE_BYTES_MIN: Final = 64 * 1024


class Files(Protocol):
    """The file operations of the storage layer. Paths are absolute; fds are ints.

    Errors are the `os` ones: OSError subclasses with `errno` set (FileNotFoundError,
    FileExistsError, IsADirectoryError, NotADirectoryError, OSError(EBADF, ENOSPC, EIO...)).
    Durability is POSIX's: written bytes are durable after `fsync`/`fdatasync` of the file;
    a new, renamed or removed name after `fsync_dir` of its parent directory.
    """

    def open(self, path: Path, flags: int, mode: int, /) -> int:
        """`os.open`: O_RDONLY/O_WRONLY/O_RDWR with O_CREAT, O_EXCL, O_TRUNC, O_APPEND,
        O_CLOEXEC. Files only (directories are synced through `fsync_dir`)."""
        ...

    def close(self, fd: int, /) -> None: ...

    def pread(self, fd: int, size: int, position: int, /) -> bytes:
        """Up to `size` bytes at `position` (fewer at the end of the file)."""
        ...

    def write(self, fd: int, data: Buffer, /) -> int:
        """Append (the fd is O_APPEND); returns the bytes written, maybe fewer (disk full)."""
        ...

    def writev(self, fd: int, buffers: Sequence[Buffer], /) -> int:
        """Append the buffers in order; returns the bytes written, maybe fewer."""
        ...

    def pwritev(self, fd: int, buffers: Sequence[Buffer], position: int, /) -> int:
        """`os.pwritev`: the buffers in order at `position` of a file not opened with
        O_APPEND (where one is, Linux appends); returns the bytes written, maybe fewer."""
        ...

    def extend(self, fd: int, size: int, /) -> bool:
        """Grow the file to `size` bytes with zeros whose blocks are allocated
        (`fallocate`, mode 0); nothing when it is that long already. False, with the file
        as it was, when it cannot (a full disk, a file system without fallocate): a write
        there then allocates as it goes. Not an operation of the fault plan: it is
        advisory, and a full disk meets the write that follows."""
        ...

    def fsync(self, fd: int, /) -> None: ...

    def fdatasync(self, fd: int, /) -> None: ...

    def start_writeback(self, fd: int, /) -> None:
        """Start writing the file's dirty pages to disk, without waiting for them and without
        making anything durable (a later fsync still must): spreads a big fsync's work over
        the writes before it."""

    def drop_cached(self, fd: int, position: int, length: int, /) -> None:
        """Let the page cache forget the file's clean pages in [position, position + length)
        (`posix_fadvise(POSIX_FADV_DONTNEED)`; advisory: dirty pages stay, a later read goes
        to the disk). Written files that are not read back soon are dropped behind their
        writes: the kernel then reuses those pages for the next writes instead of taking
        pages nobody used lately, which on a VM whose host takes back free memory cost a
        fault in the host each (a 12.7 MB write: ~25 ms into fresh pages, ~3.5 ms into
        recycled ones, here). Durability is unchanged: only clean pages are dropped."""

    def preallocate(self, fd: int, position: int, length: int, /) -> None:
        """Allocate the file's blocks for [position, position + length) without changing
        its size (`fallocate(FALLOC_FL_KEEP_SIZE)`), right before the append that fills
        them. ext4 then maps the range once, where an append into unallocated space reserves
        every page for delayed allocation and allocates at writeback: 60 MB appended in
        600 KB writes took 16.6 ms of CPU, 13.2 ms with each write's range allocated first
        (this VM, fdatasync every second write). Advisory: a failure (the disk filling up, a
        file system without fallocate) is ignored, and what it allocated of the range is
        given back; the append then meets the same condition and reports it. Nothing a read
        or a power loss sees changes: the size is the appends'. Callers append to the file
        from one thread only."""

    def ftruncate(self, fd: int, size: int, /) -> None: ...

    def size(self, fd: int, /) -> int:
        """The file's size in bytes (`fstat`)."""
        ...

    def replace(self, source: Path, target: Path, /) -> None:
        """`os.replace`: atomic rename, over `target` if it exists."""
        ...

    def free_bytes(self, path: Path, /) -> int:
        """Bytes an unprivileged writer may still add on the file system holding `path`
        (`statvfs`: f_bavail * f_frsize)."""
        ...

    def unlink(self, path: Path, /) -> None: ...

    def listdir(self, path: Path, /) -> list[str]:
        """Names in the directory, in no particular order."""
        ...

    def mkdir(self, path: Path, /) -> None:
        """One directory; its parent must exist. Durable only after `fsync_dir(parent)`."""
        ...

    def rmtree(self, path: Path, /) -> None:
        """The directory and everything under it (a symlink to a directory: the link and
        the directory it points to). Durable after `fsync_dir(parent)`."""
        ...

    def fsync_dir(self, path: Path, /) -> None:
        """Make the names created, renamed or removed in this directory durable."""
        ...

    def exists(self, path: Path, /) -> bool: ...

    def is_dir(self, path: Path, /) -> bool: ...


def _fstat_size(fd: int, /) -> int:
    return os.fstat(fd).st_size


def _libc_function(name: str, *argtypes: Any) -> Any:
    """libc's `name` through ctypes (os has no binding), returning an int and setting
    errno, or None where libc lacks it."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def _libc_sync_file_range() -> Callable[[int], None] | None:
    """`sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`, or None where libc lacks it."""
    function = _libc_function(
        "sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint
    )
    if function is None:
        return None

    def start_writeback(fd: int, /) -> None:
        if function(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    return start_writeback


def _no_writeback(fd: int, /) -> None:
    """Where sync_file_range is missing: the fsync does all the work, as before."""


_FALLOC_FL_KEEP_SIZE: Final = 0x01


def _libc_fallocate() -> Callable[[int, int, int], None] | None:
    """`Files.preallocate` through libc's fallocate (os.posix_fallocate cannot keep the
    size), or None where libc lacks it."""
    function = _libc_function(
        "fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64
    )
    if function is None:
        return None

    def preallocate(fd: int, position: int, length: int, /) -> None:
        if function(fd, _FALLOC_FL_KEEP_SIZE, position, length) == 0:
            return
        if ctypes.get_errno() == errno.ENOSPC:
            # ext4 keeps what it did allocate past the end of the file, where no append
            # reaches and a hole punch does not (it stops at the size): truncating to the
            # file's own size gives it back, and changes no byte. (Only this thread appends
            # to the file, so the size cannot move in between.) Other errors (a file system
            # without fallocate) allocated nothing.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, os.fstat(fd).st_size)

    return preallocate


def _no_preallocation(fd: int, position: int, length: int, /) -> None:
    """Where fallocate is missing: appends allocate as they go, as before."""


def _libc_extend() -> Callable[[int, int], bool] | None:
    """`Files.extend` through libc's fallocate (glibc's posix_fallocate writes zeros where
    the file system lacks fallocate), or None where libc lacks it."""
    function = _libc_function(
        "fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64
    )
    if function is None:
        return None

    def extend(fd: int, size: int, /) -> bool:
        current = os.fstat(fd).st_size
        if size <= current:
            return True
        if function(fd, 0, current, size - current) == 0:
            return True
        # What a failed call allocated or grew (ENOSPC part-way) is given back: the file
        # is as it was. Only the journal's tick thread writes or grows its segments.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, current)
        return False

    return extend


def _no_extension(fd: int, size: int, /) -> bool:
    """Where fallocate is missing: records are written past the end, as appends."""
    return False


def page_floor(position: int) -> int:
    """The start of the page that holds `position`."""
    return position - position % PAGE_BYTES


def drop_behind(files: Files, fd: int, dropped: int, end: int) -> int:
    """Let the page cache forget [dropped, end) of the file, whole pages only (the page
    holding `end` gets the next write); returns where the forgotten part now ends."""
    upto = page_floor(end)
    if upto <= dropped:
        return dropped
    files.drop_cached(fd, dropped, upto - dropped)
    return upto


def _fadvise_dont_need(fd: int, position: int, length: int, /) -> None:
    os.posix_fadvise(fd, position, length, os.POSIX_FADV_DONTNEED)


def _keep_cached(fd: int, position: int, length: int, /) -> None:
    """Where posix_fadvise is missing: the kernel keeps the pages, as before."""


_SYNC_FILE_RANGE_WRITE: Final = 2


def _statvfs_free_bytes(path: Path, /) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def _fsync_dir(path: Path, /) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mkdir(path: Path, /) -> None:
    os.mkdir(path, 0o755)


def _rmtree(path: Path, /) -> None:
    # An operator may have moved a table's directory elsewhere and left a symlink: remove
    # the link and what it points to (shutil.rmtree refuses a symlink).
    if os.path.islink(path):
        target = os.path.realpath(path)
        os.unlink(path)
        if os.path.isdir(target):
            shutil.rmtree(target)
        return
    shutil.rmtree(path)


class RealFiles:
    """The real file system through `os`. Stateless; `REAL_FILES` is the instance to use."""

    # The os builtins themselves: a call through the interface adds no Python frame.
    open = staticmethod(os.open)
    close = staticmethod(os.close)
    pread = staticmethod(os.pread)
    write = staticmethod(os.write)
    writev = staticmethod(os.writev)
    pwritev = staticmethod(os.pwritev)
    extend = staticmethod(_libc_extend() or _no_extension)
    fsync = staticmethod(os.fsync)
    fdatasync = staticmethod(os.fdatasync)
    start_writeback = staticmethod(_libc_sync_file_range() or _no_writeback)
    drop_cached = staticmethod(_fadvise_dont_need if hasattr(os, "posix_fadvise") else _keep_cached)
    preallocate = staticmethod(_libc_fallocate() or _no_preallocation)
    ftruncate = staticmethod(os.ftruncate)
    size = staticmethod(_fstat_size)
    replace = staticmethod(os.replace)
    free_bytes = staticmethod(_statvfs_free_bytes)
    unlink = staticmethod(os.unlink)
    listdir = staticmethod(os.listdir)
    mkdir = staticmethod(_mkdir)
    rmtree = staticmethod(_rmtree)
    fsync_dir = staticmethod(_fsync_dir)
    exists = staticmethod(os.path.exists)
    is_dir = staticmethod(os.path.isdir)


REAL_FILES: Final[Files] = RealFiles()


# --- helpers over any Files ----------------------------------------------------------------


def read_file(files: Files, path: Path) -> bytes:
    """The whole file. FileNotFoundError passes through."""
    fd = files.open(path, os.O_RDONLY | os.O_CLOEXEC, FILE_MODE)
    try:
        return read_all(files, fd)
    finally:
        files.close(fd)


def read_all(files: Files, fd: int) -> bytes:
    """Every byte of an open file, read in chunks of at most 64 MiB."""
    size = files.size(fd)
    chunks = []
    position = 0
    while position < size:
        chunk = files.pread(fd, min(size - position, 64 * limits.MIB), position)
        if not chunk:
            break  # The file shrank meanwhile: what was there is all there is.
        chunks.append(chunk)
        position += len(chunk)
    return b"".join(chunks)


# writev refuses (EINVAL) more buffers than this at once.
IOV_MAX: Final = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def allocate_for_append(files: Files, fd: int, position: int, size: int) -> None:
    """`Files.preallocate` the range an append of `size` bytes at `position` (the end of
    the file) is about to fill, when it is large enough to pay (PREALLOCATE_BYTES_MIN)."""
    if size >= PREALLOCATE_BYTES_MIN:
        files.preallocate(fd, position, size)


def write_all(files: Files, fd: int, buffers: Sequence[Buffer]) -> None:
    """Append every buffer, in order: one writev per IOV_MAX buffers, and plain writes to
    finish a short one (a regular file writes short when the disk fills; the next write
    then raises ENOSPC)."""
    if len(buffers) > IOV_MAX:
        for start in range(0, len(buffers), IOV_MAX):
            write_all(files, fd, buffers[start : start + IOV_MAX])
        return
    written = files.writev(fd, buffers)
    size = sum(len(buffer) for buffer in buffers)
    if written == size:
        return
    rest = memoryview(b"".join(buffers))[written:]
    while rest:
        rest = rest[files.write(fd, rest) :]


def write_all_at(files: Files, fd: int, position: int, buffers: Sequence[Buffer]) -> None:
    """Every buffer, in order, at `position` (an fd without O_APPEND): `write_all`'s
    in-place sibling, finishing a short write the same way."""
    assert len(buffers) <= IOV_MAX, "the journal writes a record's two parts at once"
    written = files.pwritev(fd, buffers, position)
    if written == sum(len(buffer) for buffer in buffers):
        return
    rest = memoryview(b"".join(buffers))[written:]
    while rest:
        done = files.pwritev(fd, [rest], position + written)
        rest, written = rest[done:], written + done


def ensure_dir(files: Files, path: Path, *, root: Path) -> None:
    """Make `path` a directory that survives a power loss.

    `root` is the top of the tree the caller owns (`path` is `root` or inside it). Every
    missing component of `path` is created (ancestors of `root` too, like `mkdir -p`), and
    each directory from `root` down to `path` is fsynced into its parent: a created one
    because a new name is durable only once its parent is fsynced, a found one because a run
    that died between its mkdir and that fsync leaves a directory that exists but may still
    vanish in a power loss. Directories above `root` that already exist are not the
    caller's, and are left alone. Costs one directory fsync per level below `root`'s parent.
    Raises OSError (FileExistsError when a component is a file).
    """
    assert path == root or root in path.parents, (path, root)
    missing: list[Path] = []
    probe = path
    while not files.is_dir(probe):
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        try:
            files.mkdir(directory)
        except FileExistsError:
            if not files.is_dir(directory):
                raise
    chain = [path, *path.parents]  # path, its parent, ..., "/"
    owned = chain[: chain.index(root) + 1]  # path up to root
    parents = {directory.parent for directory in (*owned, *missing)}
    for parent in sorted(parents, key=lambda directory: len(directory.parts)):
        files.fsync_dir(parent)


# --- bounded open data files ---------------------------------------------------------------


class FileHandle:
    """One open data file. It is never closed explicitly while someone may use it: it closes
    when the last reference goes (CPython frees it at once). Owners keep a weak reference
    and take a strong one only for the duration of an operation (a writer's append, a
    reader's batch), so the process-wide `OpenFiles` can drop it at any time without a
    thread ever using a closed, or reused, fd number."""

    __slots__ = ("__weakref__", "dropped", "fd", "files", "path", "serial", "used", "written_back")

    def __init__(self, files: Files, path: Path, fd: int, serial: int) -> None:
        self.files = files
        self.path = path
        self.fd = fd
        self.serial = serial  # Its key in OpenFiles.
        self.used = True  # Set on every use; the clock hand clears it (second chance).
        # Writeback's drop-behind: the file's size when its writeback last started, and
        # the page cache told to forget [0, dropped).
        self.written_back = 0
        self.dropped = 0

    def __del__(self) -> None:
        try:
            self.files.close(self.fd)
        except OSError as error:
            # Linux releases the fd even when close fails; a writeback error it may report
            # is reported again by the next fsync of the file, which `sync` opens afresh.
            log.warning("closing data file failed path=%s error=%s", self.path, error)


class OpenFiles:
    """A process-wide bound on open data files: at most `capacity()` handles are held, and
    opening one more drops the least recently used (approximated by the clock algorithm, so
    that a use costs one attribute store and no lock). A dropped handle closes once nobody
    uses it, so the process holds at most capacity() + (handles in use) data-file fds.
    Thread-safe."""

    def __init__(self, *, open_max: int = limits.DATA_FILES_OPEN_MAX) -> None:
        assert open_max >= 1, open_max
        self._open_max = open_max
        self._lock = threading.Lock()
        self._handles: collections.OrderedDict[int, FileHandle] = collections.OrderedDict()
        self._serial = 0
        self.opened_total = 0
        self.evicted_total = 0

    def capacity(self) -> int:
        """`open_max`, and at most 1/DATA_FILES_FD_LIMIT_DIVISOR of the soft fd limit (read
        now: the node raises it at start), so sockets and journals keep the rest."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self._open_max
        share = max(soft // limits.DATA_FILES_FD_LIMIT_DIVISOR, limits.DATA_FILES_OPEN_MIN)
        return min(self._open_max, share)

    @property
    def count(self) -> int:
        """Handles held (not counting dropped ones still in use)."""
        return len(self._handles)

    def open(self, files: Files, path: Path, flags: int) -> FileHandle:
        """Open `path` and hold the handle, dropping the least recently used beyond capacity.
        When the process is out of fds anyway (EMFILE, ENFILE), every held handle is dropped
        and the open is tried once more."""
        self._make_room(self.capacity() - 1)
        try:
            fd = files.open(path, flags, FILE_MODE)
        except OSError as error:
            if error.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            log.warning("out of file descriptors: closing every idle data file path=%s", path)
            self._make_room(0)
            fd = files.open(path, flags, FILE_MODE)
        with self._lock:
            self._serial += 1
            handle = FileHandle(files, path, fd, self._serial)
            self._handles[handle.serial] = handle
            self.opened_total += 1
        return handle

    def forget(self, handle: FileHandle) -> None:
        """Stop holding `handle` (its file is being removed or its table closed): it closes
        as soon as nobody uses it."""
        with self._lock:
            self._handles.pop(handle.serial, None)

    def _make_room(self, kept_max: int) -> None:
        dropped: list[FileHandle] = []
        with self._lock:
            while len(self._handles) > max(kept_max, 0):
                serial, handle = self._handles.popitem(last=False)
                if handle.used and kept_max > 0:
                    handle.used = False
                    self._handles[serial] = handle  # Used since the hand passed: spared.
                else:
                    dropped.append(handle)
            self.evicted_total += len(dropped)
        del dropped  # Outside the lock: closes every dropped handle nobody is using.


OPEN_DATA_FILES: Final = OpenFiles()
"""The process's data-file handles: the fd limit is per process, so its bound is too."""


class Writeback:
    """A thread that starts the disk's writeback of data files (`Files.start_writeback`) for
    the threads that append to them. The appending thread is the Raft thread, and
    sync_file_range can wait for the disk's queue: handing it over keeps that wait off the
    thread that sends heartbeats. Advisory: a request that finds the queue full, or a
    handle already queued, is dropped (the checkpoint's fsync writes what is left), and a
    failure is logged (that fsync reports the disk's errors). A queued request holds its
    handle, so its fd cannot close and be reused before the call. Thread-safe; the thread
    starts with the first request.

    Each request also lets the page cache forget the part of the file whose writeback the
    previous request started (`Files.drop_cached`; pages still being written are skipped),
    so that appends reuse pages instead of taking fresh ones. Reads of those rows (past
    the tables' memory caches) then go to the disk."""

    def __init__(self, *, queue_max: int = limits.WRITEBACK_QUEUE_MAX) -> None:
        assert queue_max >= 1, queue_max
        self._queue_max = queue_max
        self._condition = threading.Condition()
        self._queued: collections.OrderedDict[int, FileHandle] = collections.OrderedDict()
        self._thread: threading.Thread | None = None
        self.started_total = 0
        self.dropped_total = 0  # Queue full: left to the fsync.
        self.failed_total = 0

    def request(self, handle: FileHandle) -> None:
        with self._condition:
            if handle.serial in self._queued:
                return
            if len(self._queued) >= self._queue_max:
                self.dropped_total += 1
                return
            self._queued[handle.serial] = handle
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="data-writeback", daemon=True
                )
                self._thread.start()
            self._condition.notify()

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is queued (tests)."""
        with self._condition:
            return self._condition.wait_for(lambda: not self._queued, timeout_s)

    @staticmethod
    def _drop_behind(handle: FileHandle) -> None:
        handle.dropped = drop_behind(handle.files, handle.fd, handle.dropped, handle.written_back)
        handle.written_back = handle.files.size(handle.fd)

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: bool(self._queued))
                _, handle = next(iter(self._queued.items()))
            try:
                self._drop_behind(handle)
                handle.files.start_writeback(handle.fd)
                self.started_total += 1
            except OSError as error:
                self.failed_total += 1
                log.warning("early writeback failed path=%s error=%s", handle.path, error)
            with self._condition:
                del self._queued[handle.serial]
                self._condition.notify_all()
            del handle  # Closes the file here if its table let it go meanwhile.


DATA_WRITEBACK: Final = Writeback()
"""The process's writeback thread: one is enough for one disk."""


def raise_fd_soft_limit() -> int:
    """Raise the soft limit on open files (RLIMIT_NOFILE) to the hard limit, as servers do
    at start (the usual soft limit, 1,024, is for interactive shells). Returns the soft
    limit now in effect. Never lowers it; a limit the kernel refuses is kept as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        target = limits.FD_SOFT_LIMIT_IF_UNLIMITED
    if soft != resource.RLIM_INFINITY and soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as error:
        log.warning("cannot raise the open files limit soft=%d target=%d: %s", soft, target, error)
        return soft
    log.info("raised the open files limit soft=%d->%d hard=%d", soft, target, hard)
    return target


# --- the simulated file system -------------------------------------------------------------


class PowerLoss(BaseException):
    """Raised by every SimFiles operation from the `crash_at` point until `restart()`. A
    BaseException so that no `except OSError`/`except Exception` cleanup of the code under
    test runs as if the process lived on."""


@dataclass(slots=True)
class Fault:
    """Raise `OSError(error)` from matching operations: `op` (a method name of Files, or
    None for any operation that can fail) on a path containing `path_part` (for fd
    operations, the path the fd was opened with). The first `skip` matching calls go
    through, the next `times` fail, then the fault is spent."""

    error: int
    op: str | None = None
    path_part: str = ""
    skip: int = 0
    times: int = 1


class _SimFile:
    __slots__ = ("cut", "data", "durable")

    def __init__(self) -> None:
        self.data = bytearray()  # What reads see.
        self.durable = b""  # What a power loss leaves (as of the last fsync/fdatasync).
        self.cut = False  # Truncated below its durable bytes since then.


class _SimDir:
    __slots__ = ("durable_entries", "entries")

    def __init__(self) -> None:
        self.entries: dict[str, _SimFile | _SimDir] = {}  # What lookups see.
        self.durable_entries: dict[str, _SimFile | _SimDir] = {}  # As of the last fsync_dir.


@dataclass(slots=True)
class _SimHandle:
    node: _SimFile
    flags: int
    path: PurePosixPath


_SIM_FLAGS: Final = os.O_ACCMODE | os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
_FAULTABLE: Final = frozenset(
    (
        "open",
        "pread",
        "write",
        "writev",
        "pwritev",
        "fsync",
        "fdatasync",
        "ftruncate",
        "replace",
        "unlink",
        "listdir",
        "mkdir",
        "rmtree",
        "fsync_dir",
    )
)


def all_zeros(data: Buffer) -> bool:
    """Whether every byte is zero (one memcmp: a journal's grown tail is a megabyte)."""
    data = data if isinstance(data, bytes) else bytes(data)
    return data == bytes(len(data))


def _common_prefix(first: Buffer, second: Buffer) -> int:
    """How many leading bytes the two have in common (a bisection of slice compares)."""
    low, high = 0, min(len(first), len(second))
    if first[:high] == second[:high]:
        return high
    while high - low > 1:  # first[:low] == second[:low], first[:high] != second[:high]
        middle = (low + high) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle
    return low


def _error(code: int, path: object = None) -> OSError:
    # OSError(errno, ...) is built as its subclass: FileNotFoundError for ENOENT, etc.
    if path is None:
        return OSError(code, os.strerror(code))
    return OSError(code, os.strerror(code), str(path))


class SimFiles:
    """A simulated file system (see the module docstring). Single-threaded use is expected,
    but a lock makes each operation atomic so readers on other threads are safe.

    Durability model: `fsync`/`fdatasync` make a file's bytes durable; `fsync_dir` makes a
    directory's names durable (each name then refers to its file or directory as it will be
    found after a power loss: the file with its own durable bytes). The root `/` always
    exists. `crash()` loses power now: every directory's names go back to its durable ones,
    every file to its durable bytes (with `torn=True`, a file that was only appended to,
    or written over its durable zeros, since its last fsync keeps a random, seeded prefix
    of those writes), and every open fd is gone (closing one is a no-op, any other use is
    EBADF).
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        disk_bytes_max: int | None = None,
        open_files_max: int | None = None,
    ) -> None:
        self.seed = seed
        self._random = random.Random(seed)
        self._lock = threading.RLock()
        self._root = _SimDir()
        self._handles: dict[int, _SimHandle] = {}
        self._stale_fds: set[int] = set()  # Open when the power went: closing them is a no-op.
        self._fd_next = 1000
        self.disk_bytes_max = disk_bytes_max
        self.open_files_max = open_files_max
        self._faults: list[Fault] = []
        self._random_fault_probability = 0.0
        self._random_fault_errors: tuple[int, ...] = ()
        self._random_fault_ops: frozenset[str] = _FAULTABLE
        self._crash_in: int | None = None  # Operations until a scheduled power loss.
        self._crash_torn = False
        self._powered = True
        self.operations = 0  # Operations that can fail (or crash), counted since creation.
        self.crashes = 0
        self.log: list[str] = []  # Faults and crashes, for a failing test's message.

    # --- faults and power ---------------------------------------------------------------

    def fail(self, fault: Fault) -> None:
        """Add a fault to the plan (checked in the order added)."""
        assert fault.op is None or fault.op in _FAULTABLE, fault.op
        self._faults.append(fault)

    def fail_randomly(
        self,
        probability: float,
        *,
        errors: tuple[int, ...] = (errno.EIO, errno.ENOSPC),
        ops: frozenset[str] = _FAULTABLE,
    ) -> None:
        """Fail each operation in `ops` with `probability`, an error drawn from `errors`
        (seeded by `seed`)."""
        assert ops <= _FAULTABLE, ops
        self._random_fault_probability = probability
        self._random_fault_errors = errors
        self._random_fault_ops = ops

    def clear_faults(self) -> None:
        self._faults.clear()
        self._random_fault_probability = 0.0

    def crash_at(self, operations: int, *, torn: bool = False) -> None:
        """Lose power during the `operations`-th next operation that can fail (0 = the next
        one): it runs (its error, if any, is dropped), then the power goes and it raises
        PowerLoss, as does every later call until `restart()`."""
        assert operations >= 0, operations
        self._crash_in = operations
        self._crash_torn = torn

    def crash(self, *, torn: bool = False) -> None:
        """Lose power now, and come back at once (see the class docstring)."""
        with self._lock:
            self._power_loss(torn=torn)
            self._powered = True

    def restart(self) -> None:
        """Power back on after `crash_at` fired."""
        with self._lock:
            assert not self._powered, "restart() without a power loss"
            self._powered = True
            self._crash_in = None

    @property
    def powered(self) -> bool:
        return self._powered

    @property
    def open_fds(self) -> int:
        return len(self._handles)

    def bytes_used(self) -> int:
        """Bytes of every file reachable by name or held open."""
        with self._lock:
            seen: dict[int, int] = {}
            self._measure(self._root, seen)
            for handle in self._handles.values():
                seen[id(handle.node)] = len(handle.node.data)
            return sum(seen.values())

    def durable_bytes(self, path: Path) -> bytes | None:
        """What a power loss now would leave at `path` (None: no such file then)."""
        with self._lock:
            node: _SimFile | _SimDir = self._root
            for name in self._parts(path):
                if not isinstance(node, _SimDir) or name not in node.durable_entries:
                    return None
                node = node.durable_entries[name]
            return node.durable if isinstance(node, _SimFile) else None

    def _measure(self, directory: _SimDir, seen: dict[int, int]) -> None:
        for node in directory.entries.values():
            if isinstance(node, _SimDir):
                self._measure(node, seen)
            else:
                seen[id(node)] = len(node.data)

    def _power_loss(self, *, torn: bool) -> None:
        self.crashes += 1
        self.log.append(f"power loss #{self.crashes} torn={torn} after op {self.operations}")
        self._powered = False
        self._crash_in = None
        self._stale_fds.update(self._handles)
        self._handles.clear()
        self._revert(self._root, torn, set())

    def _revert(self, directory: _SimDir, torn: bool, seen: set[int]) -> None:
        directory.entries = dict(directory.durable_entries)
        for node in directory.entries.values():
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, _SimDir):
                self._revert(node, torn, seen)
                continue
            durable = node.durable
            if torn and node.data != durable:
                # The bytes written since the last sync reach the disk in file order, up to
                # a random point: past the durable ones, over their zeros (the journal's
                # grown tail) or over older bytes (a reused journal segment). A file cut
                # since then goes back to its synced bytes whole.
                common = _common_prefix(node.data, durable)
                if common < len(node.data) and (not node.cut or all_zeros(durable[common:])):
                    kept = common + self._random.randint(0, len(node.data) - common)
                    durable = bytes(node.data[:kept]) + durable[kept:]
            node.data = bytearray(durable)
            node.durable = durable
            node.cut = False

    def _run(self, op: str, path: PurePosixPath | None, action: Callable[[], _T]) -> _T:
        """Every operation that can fail: power check, fault plan, crash point."""
        with self._lock:
            if not self._powered:
                raise PowerLoss(f"{op} after the power loss")
            self.operations += 1
            crash_now = self._crash_in == 0
            if self._crash_in is not None:
                self._crash_in -= 1
            if not crash_now:
                self._maybe_fault(op, path)
                return action()
            with contextlib.suppress(OSError):
                action()
            self._power_loss(torn=self._crash_torn)
            raise PowerLoss(f"power lost during {op} {path}")

    def _maybe_fault(self, op: str, path: PurePosixPath | None) -> None:
        where = str(path) if path is not None else ""
        for fault in self._faults:
            if fault.times <= 0 or (fault.op is not None and fault.op != op):
                continue
            if fault.path_part not in where:
                continue
            if fault.skip > 0:
                fault.skip -= 1
                continue
            fault.times -= 1
            self.log.append(f"fault {errno.errorcode[fault.error]} on {op} {where}")
            raise _error(fault.error, path)
        if (
            self._random_fault_probability > 0
            and op in self._random_fault_ops
            and self._random.random() < self._random_fault_probability
        ):
            code = self._random.choice(self._random_fault_errors)
            self.log.append(f"random fault {errno.errorcode[code]} on {op} {where}")
            raise _error(code, path)

    # --- name resolution ----------------------------------------------------------------

    @staticmethod
    def _parts(path: Path | PurePosixPath) -> tuple[str, ...]:
        pure = PurePosixPath(path)
        assert pure.is_absolute(), f"SimFiles takes absolute paths: {path}"
        assert ".." not in pure.parts, path
        return pure.parts[1:]

    def _lookup(self, path: Path | PurePosixPath) -> _SimFile | _SimDir:
        node: _SimFile | _SimDir = self._root
        for name in self._parts(path):
            if not isinstance(node, _SimDir):
                raise _error(errno.ENOTDIR, path)
            if name not in node.entries:
                raise _error(errno.ENOENT, path)
            node = node.entries[name]
        return node

    def _parent(self, path: Path | PurePosixPath) -> tuple[_SimDir, str]:
        parts = self._parts(path)
        assert parts, "the root has no parent"
        parent = self._lookup(PurePosixPath("/", *parts[:-1]))
        if not isinstance(parent, _SimDir):
            raise _error(errno.ENOTDIR, path)
        return parent, parts[-1]

    def _lookup_dir(self, path: Path | PurePosixPath) -> _SimDir:
        node = self._lookup(path)
        if not isinstance(node, _SimDir):
            raise _error(errno.ENOTDIR, path)
        return node

    def _handle(self, fd: int) -> _SimHandle:
        handle = self._handles.get(fd)
        if handle is None:
            raise _error(errno.EBADF)
        return handle

    # --- Files ------------------------------------------------------------------------------

    def open(self, path: Path, flags: int, mode: int, /) -> int:
        assert flags & ~_SIM_FLAGS == 0, f"unsupported open flags {flags:#o}"
        pure = PurePosixPath(path)
        return self._run("open", pure, lambda: self._open(pure, flags))

    def _open(self, path: PurePosixPath, flags: int) -> int:
        if self.open_files_max is not None and len(self._handles) >= self.open_files_max:
            raise _error(errno.EMFILE, path)
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is not None and flags & os.O_CREAT and flags & os.O_EXCL:
            raise _error(errno.EEXIST, path)
        if isinstance(node, _SimDir):
            # Where Linux would open a directory read-only: the storage code never does
            # (directories are synced through fsync_dir).
            raise _error(errno.EISDIR, path)
        if node is None:
            if not flags & os.O_CREAT:
                raise _error(errno.ENOENT, path)
            node = _SimFile()
            parent.entries[name] = node
        elif flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY:
            node.data = bytearray()
        fd = self._fd_next
        self._fd_next += 1
        self._handles[fd] = _SimHandle(node, flags, path)
        return fd

    def close(self, fd: int, /) -> None:
        with self._lock:
            if fd in self._stale_fds:
                self._stale_fds.discard(fd)  # Gone with the power; the old process's close.
                return
            if not self._powered:
                raise PowerLoss("close after the power loss")
            self._handle(fd)
            del self._handles[fd]

    def pread(self, fd: int, size: int, position: int, /) -> bytes:
        handle = self._handle_or_badf(fd)
        return self._run("pread", handle.path, lambda: self._pread(fd, size, position))

    def _pread(self, fd: int, size: int, position: int) -> bytes:
        handle = self._handle(fd)
        if handle.flags & os.O_ACCMODE == os.O_WRONLY:
            raise _error(errno.EBADF)
        if size < 0 or position < 0:
            raise _error(errno.EINVAL)
        return bytes(handle.node.data[position : position + size])

    def write(self, fd: int, data: Buffer, /) -> int:
        handle = self._handle_or_badf(fd)
        return self._run("write", handle.path, lambda: self._append(fd, bytes(data)))

    def writev(self, fd: int, buffers: Sequence[Buffer], /) -> int:
        handle = self._handle_or_badf(fd)
        if len(buffers) > IOV_MAX:
            raise _error(errno.EINVAL)  # as the kernel does
        data = b"".join(bytes(buffer) for buffer in buffers)
        return self._run("writev", handle.path, lambda: self._append(fd, data))

    def _append(self, fd: int, data: bytes) -> int:
        handle = self._handle(fd)
        if handle.flags & os.O_ACCMODE == os.O_RDONLY:
            raise _error(errno.EBADF)
        assert handle.flags & os.O_APPEND, "SimFiles appends only through O_APPEND fds"
        return self._write_at(handle, len(handle.node.data), data)

    def pwritev(self, fd: int, buffers: Sequence[Buffer], position: int, /) -> int:
        handle = self._handle_or_badf(fd)
        if len(buffers) > IOV_MAX:
            raise _error(errno.EINVAL)
        data = b"".join(bytes(buffer) for buffer in buffers)
        return self._run("pwritev", handle.path, lambda: self._pwrite(fd, data, position))

    def _pwrite(self, fd: int, data: bytes, position: int) -> int:
        handle = self._handle(fd)
        if handle.flags & os.O_ACCMODE == os.O_RDONLY:
            raise _error(errno.EBADF)
        if position < 0:
            raise _error(errno.EINVAL)
        if handle.flags & os.O_APPEND:
            position = len(handle.node.data)  # Linux: pwrite on an O_APPEND fd appends
        return self._write_at(handle, position, data)

    def _write_at(self, handle: _SimHandle, position: int, data: bytes) -> int:
        """`data` at `position` (a gap before it reads as zeros); a full disk writes
        short, and the next write that needs room raises ENOSPC."""
        node = handle.node
        if not data:
            return 0  # nothing written: no gap filled either
        if self.disk_bytes_max is not None:
            # Bytes written over are no new room; a gap of zeros before `position` is.
            room = self.disk_bytes_max - self.bytes_used() + len(node.data) - position
            if room <= 0:
                raise _error(errno.ENOSPC, handle.path)
            data = data[:room]
        if position > len(node.data):
            node.data += bytes(position - len(node.data))
        node.data[position : position + len(data)] = data
        return len(data)

    def extend(self, fd: int, size: int, /) -> bool:
        with self._lock:
            if not self._powered:
                raise PowerLoss("extend after the power loss")
            handle = self._handle(fd)
            node = handle.node
            grow = size - len(node.data)
            if grow <= 0:
                return True
            if handle.flags & os.O_ACCMODE == os.O_RDONLY:
                return False  # fallocate: EBADF
            if self.disk_bytes_max is not None and self.bytes_used() + grow > self.disk_bytes_max:
                return False
            node.data += bytes(grow)
            return True

    def fsync(self, fd: int, /) -> None:
        handle = self._handle_or_badf(fd)
        self._run("fsync", handle.path, lambda: self._sync(fd))

    def fdatasync(self, fd: int, /) -> None:
        handle = self._handle_or_badf(fd)
        self._run("fdatasync", handle.path, lambda: self._sync(fd))

    def start_writeback(self, fd: int, /) -> None:
        """Nothing becomes durable, and it is not an operation of the fault plan: it runs
        on the writeback thread, whose timing would make `crash_at` counts irreproducible."""

    def drop_cached(self, fd: int, position: int, length: int, /) -> None:
        """Changes nothing a read or a power loss sees; not an operation of the fault plan."""
        self._handle_or_badf(fd)
        if position < 0 or length < 0:
            raise _error(errno.EINVAL)

    def preallocate(self, fd: int, position: int, length: int, /) -> None:
        """Changes nothing a read or a power loss sees, and fails silently as the real one
        does: not an operation of the fault plan (its disk-full faults hit the append)."""

    def _sync(self, fd: int) -> None:
        node = self._handle(fd).node
        node.durable = bytes(node.data)
        node.cut = False

    def ftruncate(self, fd: int, size: int, /) -> None:
        handle = self._handle_or_badf(fd)
        self._run("ftruncate", handle.path, lambda: self._truncate(fd, size))

    def _truncate(self, fd: int, size: int) -> None:
        handle = self._handle(fd)
        if handle.flags & os.O_ACCMODE == os.O_RDONLY or size < 0:
            raise _error(errno.EINVAL)
        data = handle.node.data
        if size < len(handle.node.durable):
            handle.node.cut = True
        if size <= len(data):
            del data[size:]
        else:
            data += bytes(size - len(data))

    def size(self, fd: int, /) -> int:
        with self._lock:
            if not self._powered:
                raise PowerLoss("size after the power loss")
            return len(self._handle(fd).node.data)

    def free_bytes(self, path: Path, /) -> int:
        """What `disk_bytes_max` leaves (a disk without one: as good as endless)."""
        if self.disk_bytes_max is None:
            return 1 << 62
        return max(0, self.disk_bytes_max - self.bytes_used())

    def _handle_or_badf(self, fd: int) -> _SimHandle:
        with self._lock:
            if not self._powered:
                raise PowerLoss("fd operation after the power loss")
            return self._handle(fd)

    def replace(self, source: Path, target: Path, /) -> None:
        pure_source, pure_target = PurePosixPath(source), PurePosixPath(target)
        self._run("replace", pure_source, lambda: self._replace(pure_source, pure_target))

    def _replace(self, source: PurePosixPath, target: PurePosixPath) -> None:
        source_parent, source_name = self._parent(source)
        target_parent, target_name = self._parent(target)  # Before the source's name: ENOTDIR.
        if source_name not in source_parent.entries:
            raise _error(errno.ENOENT, source)
        node = source_parent.entries[source_name]
        existing = target_parent.entries.get(target_name)
        if existing is node:
            return
        if target in source.parents:
            raise _error(errno.ENOTEMPTY, target)  # Over its own ancestor, as Linux answers.
        if isinstance(node, _SimDir):
            assert source not in target.parents, "a directory renamed into itself"
            if isinstance(existing, _SimFile):
                raise _error(errno.ENOTDIR, target)
            if isinstance(existing, _SimDir) and existing.entries:
                raise _error(errno.ENOTEMPTY, target)
        elif isinstance(existing, _SimDir):
            raise _error(errno.EISDIR, target)
        del source_parent.entries[source_name]
        target_parent.entries[target_name] = node

    def unlink(self, path: Path, /) -> None:
        pure = PurePosixPath(path)
        self._run("unlink", pure, lambda: self._unlink(pure))

    def _unlink(self, path: PurePosixPath) -> None:
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is None:
            raise _error(errno.ENOENT, path)
        if isinstance(node, _SimDir):
            raise _error(errno.EISDIR, path)
        del parent.entries[name]

    def listdir(self, path: Path, /) -> list[str]:
        pure = PurePosixPath(path)
        return self._run("listdir", pure, lambda: list(self._lookup_dir(pure).entries))

    def mkdir(self, path: Path, /) -> None:
        pure = PurePosixPath(path)
        self._run("mkdir", pure, lambda: self._mkdir(pure))

    def _mkdir(self, path: PurePosixPath) -> None:
        if not self._parts(path):
            raise _error(errno.EEXIST, path)
        parent, name = self._parent(path)
        if name in parent.entries:
            raise _error(errno.EEXIST, path)
        parent.entries[name] = _SimDir()

    def rmtree(self, path: Path, /) -> None:
        pure = PurePosixPath(path)
        self._run("rmtree", pure, lambda: self._rmtree(pure))

    def _rmtree(self, path: PurePosixPath) -> None:
        self._lookup_dir(path)
        parent, name = self._parent(path)
        # Only the name goes: the removed directory's own names stay as they were, so a power
        # loss before the parent's fsync brings the whole tree back as it was last synced.
        del parent.entries[name]

    def fsync_dir(self, path: Path, /) -> None:
        pure = PurePosixPath(path)
        self._run("fsync_dir", pure, lambda: self._fsync_dir(pure))

    def _fsync_dir(self, path: PurePosixPath) -> None:
        directory = self._lookup_dir(path)
        directory.durable_entries = dict(directory.entries)

    def exists(self, path: Path, /) -> bool:
        with self._lock:
            if not self._powered:
                raise PowerLoss("exists after the power loss")
            try:
                self._lookup(path)
            except OSError:
                return False
            return True

    def is_dir(self, path: Path, /) -> bool:
        with self._lock:
            if not self._powered:
                raise PowerLoss("is_dir after the power loss")
            try:
                return isinstance(self._lookup(path), _SimDir)
            except OSError:
                return False
