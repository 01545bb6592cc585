"""storage/files.py: SimFiles behaves like the real file system until the power goes, then keeps
exactly what was fsynced (file bytes and directory entries); ensure_dir; OpenFiles."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deploy.local_cluster import wait_until
from hastream.wire import MIB
from raftstore.storage.files import (
    FILE_MODE,
    PAGE_BYTES,
    REAL_FILES,
    Fault,
    Files,
    OpenFiles,
    PowerLoss,
    SimFiles,
    Writeback,
    ensure_dir,
    read_file,
    write_all,
)
from tests.chaos.faults import free_bytes

pytestmark = pytest.mark.storage

ROOT = Path("/node")
APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC


def _sim() -> SimFiles:
    sim = SimFiles(seed=7)
    ensure_dir(sim, ROOT, root=ROOT)
    return sim


def _write_file(files: Files, path: Path, data: bytes, *, fsync: bool = True) -> None:
    fd = files.open(path, APPEND, FILE_MODE)
    try:
        write_all(files, fd, [data])
        if fsync:
            files.fsync(fd)
    finally:
        files.close(fd)


# --- SimFiles against the real file system (no power loss) ---------------------------------

_RELATIVE_PATHS = ("a", "b", "a/b", "a/c", "b/a", "a/b/c")
_OPEN_FLAGS = tuple(
    access | extra
    for access in (os.O_RDONLY, os.O_WRONLY | os.O_APPEND, os.O_RDWR | os.O_APPEND, os.O_RDWR)
    for extra in (0, os.O_CREAT, os.O_CREAT | os.O_EXCL, os.O_TRUNC, os.O_CREAT | os.O_TRUNC)
    if not (access == os.O_RDONLY and extra & os.O_TRUNC)  # Unspecified by POSIX.
)

Outcome = tuple[Any, ...]


def _outcome(call: Callable[[], Any]) -> Outcome:
    try:
        return ("ok", call())
    except OSError as error:
        return ("error", type(error).__name__, error.errno)


def _tree(files: Files, root: Path) -> dict[str, bytes | None]:
    """Every name under root: a directory maps to None, a file to its bytes."""
    result: dict[str, bytes | None] = {}

    def walk(directory: Path, prefix: str) -> None:
        for name in sorted(files.listdir(directory)):
            path = directory / name
            if files.is_dir(path):
                result[prefix + name + "/"] = None
                walk(path, prefix + name + "/")
            else:
                result[prefix + name] = read_file(files, path)

    walk(root, "")
    return result


class SimFilesLikeRealFiles(RuleBasedStateMachine):
    """Every operation, with the same arguments, on a real tmp dir and on SimFiles: the same
    results, the same errors, the same tree of names and bytes after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.real_root = Path(tempfile.mkdtemp(prefix="simfiles-model-"))
        self.sim = SimFiles(seed=1)
        self.sim_root = Path("/model")
        self.sim.mkdir(self.sim_root)
        self.fds: list[tuple[int, int]] = []  # (real fd, simulated fd) of open files
        self.in_place: set[int] = set()  # real fds opened for writing without O_APPEND

    def teardown(self) -> None:
        for real_fd, _ in self.fds:
            os.close(real_fd)
        shutil.rmtree(self.real_root)

    def _both(self, call: Callable[[Files, Path], Any]) -> Outcome:
        real = _outcome(lambda: call(REAL_FILES, self.real_root))
        sim = _outcome(lambda: call(self.sim, self.sim_root))
        assert real == sim, (real, sim)
        return real

    def _both_fd(self, index: int, call: Callable[[Files, int], Any]) -> Outcome:
        real_fd, sim_fd = self.fds[index % len(self.fds)]
        real = _outcome(lambda: call(REAL_FILES, real_fd))
        sim = _outcome(lambda: call(self.sim, sim_fd))
        assert real == sim, (real, sim)
        return real

    @rule(path=st.sampled_from(_RELATIVE_PATHS))
    def mkdir(self, path: str) -> None:
        self._both(lambda files, root: files.mkdir(root / path))

    @rule(path=st.sampled_from(_RELATIVE_PATHS), flags=st.sampled_from(_OPEN_FLAGS))
    def open(self, path: str, flags: int) -> None:
        opens_a_directory = flags & (os.O_ACCMODE | os.O_CREAT) == os.O_RDONLY
        assume(not (opens_a_directory and (self.real_root / path).is_dir()))  # Not simulated.
        real = _outcome(lambda: REAL_FILES.open(self.real_root / path, flags, FILE_MODE))
        sim = _outcome(lambda: self.sim.open(self.sim_root / path, flags, FILE_MODE))
        assert real[0] == sim[0], (real, sim)
        if real[0] == "ok":
            self.fds.append((real[1], sim[1]))
            if flags & os.O_ACCMODE == os.O_RDWR and not flags & os.O_APPEND:
                self.in_place.add(real[1])
        else:
            assert real == sim

    @precondition(lambda self: self.fds)
    @rule(index=st.integers(0, 100))
    def close(self, index: int) -> None:
        real_fd, sim_fd = self.fds.pop(index % len(self.fds))
        self.in_place.discard(real_fd)
        REAL_FILES.close(real_fd)
        self.sim.close(sim_fd)

    @precondition(lambda self: self.fds)
    @rule(index=st.integers(0, 100), parts=st.lists(st.binary(max_size=20), max_size=3))
    def writev(self, index: int, parts: list[bytes]) -> None:
        assume(self.fds[index % len(self.fds)][0] not in self.in_place)  # appends only
        self._both_fd(index, lambda files, fd: files.writev(fd, parts))

    @precondition(lambda self: self.fds)
    @rule(index=st.integers(0, 100), data=st.binary(max_size=20))
    def write(self, index: int, data: bytes) -> None:
        assume(self.fds[index % len(self.fds)][0] not in self.in_place)  # appends only
        self._both_fd(index, lambda files, fd: files.write(fd, data))

    @precondition(lambda self: self.fds)
    @rule(
        index=st.integers(0, 100),
        parts=st.lists(st.binary(max_size=20), max_size=3),
        position=st.integers(0, 60),
    )
    def pwritev(self, index: int, parts: list[bytes], position: int) -> None:
        # In place, past the end (a gap of zeros), or appended (an O_APPEND fd, as Linux).
        self._both_fd(index, lambda files, fd: files.pwritev(fd, parts, position))

    @precondition(lambda self: self.fds)
    @rule(index=st.integers(0, 100), size=st.integers(0, 80))
    def extend(self, index: int, size: int) -> None:
        self._both_fd(index, lambda files, fd: files.extend(fd, size))

    @precondition(lambda self: self.fds)
    @rule(index=st.integers(0, 100), size=st.integers(0, 50), position=st.integers(0, 50))
    def pread(self, index: int, size: int, position: int) -> None:
        self._both_fd(index, lambda files, fd: files.pread(fd, size, position))

    @precondition(lambda self: self.fds)
    @rule(index=st.integers(0, 100), data_only=st.booleans())
    def fsync(self, index: int, data_only: bool) -> None:
        if data_only:
            self._both_fd(index, lambda files, fd: files.fdatasync(fd))
        else:
            self._both_fd(index, lambda files, fd: files.fsync(fd))

    @precondition(lambda self: self.fds)
    @rule(index=st.integers(0, 100), position=st.integers(0, 50), length=st.integers(0, 9000))
    def preallocate(self, index: int, position: int, length: int) -> None:
        # Nothing a read sees: the size and bytes stay (the invariant compares the trees),
        # and neither raises, whatever the fd was opened for.
        self._both_fd(index, lambda files, fd: files.preallocate(fd, position, length))

    @precondition(lambda self: self.fds)
    @rule(index=st.integers(0, 100), size=st.integers(0, 40))
    def ftruncate(self, index: int, size: int) -> None:
        self._both_fd(index, lambda files, fd: files.ftruncate(fd, size))

    @precondition(lambda self: self.fds)
    @rule(index=st.integers(0, 100))
    def size(self, index: int) -> None:
        self._both_fd(index, lambda files, fd: files.size(fd))

    @rule(source=st.sampled_from(_RELATIVE_PATHS), destination=st.sampled_from(_RELATIVE_PATHS))
    def replace(self, source: str, destination: str) -> None:
        assume(not destination.startswith(source + "/"))  # Into itself: EINVAL, never done.
        self._both(lambda files, root: files.replace(root / source, root / destination))

    @rule(path=st.sampled_from(_RELATIVE_PATHS))
    def unlink(self, path: str) -> None:
        self._both(lambda files, root: files.unlink(root / path))

    @rule(path=st.sampled_from((".", *_RELATIVE_PATHS)))
    def listdir(self, path: str) -> None:
        self._both(lambda files, root: sorted(files.listdir(root / path)))

    @rule(path=st.sampled_from(_RELATIVE_PATHS))
    def rmtree(self, path: str) -> None:
        self._both(lambda files, root: files.rmtree(root / path))

    @rule(path=st.sampled_from((".", *_RELATIVE_PATHS)))
    def fsync_dir(self, path: str) -> None:
        self._both(lambda files, root: files.fsync_dir(root / path))

    @rule(path=st.sampled_from(_RELATIVE_PATHS))
    def exists_and_is_dir(self, path: str) -> None:
        self._both(lambda files, root: (files.exists(root / path), files.is_dir(root / path)))

    @invariant()
    def same_tree(self) -> None:
        assert _tree(REAL_FILES, self.real_root) == _tree(self.sim, self.sim_root)


SimFilesLikeRealFiles.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
test_sim_files_behave_like_real_files = pytest.mark.property(SimFilesLikeRealFiles.TestCase)


# --- power loss ----------------------------------------------------------------------------


def test_crash_keeps_fsynced_bytes_and_drops_the_rest() -> None:
    sim = _sim()
    fd = sim.open(ROOT / "f", APPEND, FILE_MODE)
    sim.write(fd, b"synced")
    sim.fsync(fd)
    sim.write(fd, b" lost")
    sim.fsync_dir(ROOT)
    sim.crash()
    assert read_file(sim, ROOT / "f") == b"synced"
    with pytest.raises(OSError, match=os.strerror(errno.EBADF)) as caught:
        sim.write(fd, b"x")  # The old process's fd is gone with the power.
    assert caught.value.errno == errno.EBADF
    sim.close(fd)  # ... and closing it is a no-op.


def test_a_fsynced_file_whose_name_was_never_fsynced_vanishes() -> None:
    sim = _sim()
    _write_file(sim, ROOT / "f", b"data")  # fsync of the file, not of the directory
    assert sim.durable_bytes(ROOT / "f") is None
    sim.crash()
    assert not sim.exists(ROOT / "f")


def test_rename_and_unlink_are_durable_only_after_the_directory_fsync() -> None:
    sim = _sim()
    _write_file(sim, ROOT / "old", b"old")
    _write_file(sim, ROOT / "gone", b"gone")
    sim.fsync_dir(ROOT)
    _write_file(sim, ROOT / "new.tmp", b"new")
    sim.replace(ROOT / "new.tmp", ROOT / "old")
    sim.unlink(ROOT / "gone")
    sim.crash()
    assert sorted(sim.listdir(ROOT)) == ["gone", "old"]
    assert read_file(sim, ROOT / "old") == b"old"
    _write_file(sim, ROOT / "new.tmp", b"new")
    sim.replace(ROOT / "new.tmp", ROOT / "old")
    sim.unlink(ROOT / "gone")
    sim.fsync_dir(ROOT)
    sim.crash()
    assert sim.listdir(ROOT) == ["old"]
    assert read_file(sim, ROOT / "old") == b"new"


def test_rmtree_without_parent_fsync_brings_the_tree_back() -> None:
    sim = _sim()
    ensure_dir(sim, ROOT / "t", root=ROOT / "t")
    _write_file(sim, ROOT / "t" / "f", b"data")
    sim.fsync_dir(ROOT / "t")
    sim.rmtree(ROOT / "t")
    sim.crash()
    assert read_file(sim, ROOT / "t" / "f") == b"data"
    sim.rmtree(ROOT / "t")
    sim.fsync_dir(ROOT)
    sim.crash()
    assert not sim.exists(ROOT / "t")


def test_torn_crash_keeps_a_seeded_prefix_of_appended_bytes() -> None:
    kept = set()
    for seed in range(20):
        sim = SimFiles(seed=seed)
        ensure_dir(sim, ROOT, root=ROOT)
        fd = sim.open(ROOT / "f", APPEND, FILE_MODE)
        sim.write(fd, b"synced|")
        sim.fsync(fd)
        sim.fsync_dir(ROOT)
        sim.write(fd, b"0123456789")
        sim.crash(torn=True)
        data = read_file(sim, ROOT / "f")
        assert data == b"synced|0123456789"[: len(data)], seed
        assert len(data) >= len(b"synced|"), seed
        kept.add(len(data))
    assert len(kept) > 3  # Different seeds tear at different points.


def test_torn_crash_after_a_truncation_keeps_only_the_synced_bytes() -> None:
    sim = _sim()
    fd = sim.open(ROOT / "f", os.O_RDWR | os.O_CREAT | os.O_APPEND, FILE_MODE)
    sim.write(fd, b"0123456789")
    sim.fsync(fd)
    sim.fsync_dir(ROOT)
    sim.ftruncate(fd, 4)
    sim.write(fd, b"abcdef")
    sim.crash(torn=True)
    assert read_file(sim, ROOT / "f") == b"0123456789"


def test_crash_at_runs_the_operation_then_every_call_raises_power_loss() -> None:
    sim = _sim()
    fd = sim.open(ROOT / "f", APPEND, FILE_MODE)
    sim.crash_at(1)  # The second operation from now: the fsync.
    sim.write(fd, b"data")
    with pytest.raises(PowerLoss):
        sim.fsync(fd)
    with pytest.raises(PowerLoss):
        sim.listdir(ROOT)
    sim.close(fd)  # The dead process's close: a no-op, not an error.
    sim.restart()
    assert sim.listdir(ROOT) == []  # The fsync ran, but the name was never made durable.


# --- faults --------------------------------------------------------------------------------


def test_fault_plan_fails_the_chosen_operation_and_path_then_is_spent() -> None:
    sim = _sim()
    sim.fail(Fault(errno.EIO, op="fsync", path_part="journal", skip=1))
    other = sim.open(ROOT / "other", APPEND, FILE_MODE)
    journal = sim.open(ROOT / "journal", APPEND, FILE_MODE)
    sim.fsync(other)
    sim.fsync(journal)  # Skipped once.
    with pytest.raises(OSError, match=os.strerror(errno.EIO)) as caught:
        sim.fsync(journal)
    assert caught.value.errno == errno.EIO
    sim.fsync(journal)  # Spent.
    assert any("EIO on fsync" in line for line in sim.log)


def test_disk_full_writes_short_then_raises_enospc() -> None:
    sim = SimFiles(disk_bytes_max=10)
    ensure_dir(sim, ROOT, root=ROOT)
    fd = sim.open(ROOT / "f", APPEND, FILE_MODE)
    assert sim.writev(fd, [b"0123", b"456789abc"]) == 10
    with pytest.raises(OSError, match=os.strerror(errno.ENOSPC)) as caught:
        sim.write(fd, b"x")
    assert caught.value.errno == errno.ENOSPC
    sim.ftruncate(fd, 4)
    assert sim.write(fd, b"xyz") == 3  # Room again.


def test_open_files_max_raises_emfile() -> None:
    sim = SimFiles(open_files_max=2)
    ensure_dir(sim, ROOT, root=ROOT)
    first = sim.open(ROOT / "a", APPEND, FILE_MODE)
    sim.open(ROOT / "b", APPEND, FILE_MODE)
    with pytest.raises(OSError, match=os.strerror(errno.EMFILE)) as caught:
        sim.open(ROOT / "c", APPEND, FILE_MODE)
    assert caught.value.errno == errno.EMFILE
    sim.close(first)
    sim.open(ROOT / "c", APPEND, FILE_MODE)


def test_random_faults_are_seeded() -> None:
    def run(seed: int) -> list[str]:
        sim = SimFiles(seed=seed)
        ensure_dir(sim, ROOT, root=ROOT)
        sim.fail_randomly(0.3, errors=(errno.EIO,))
        for number in range(30):
            with contextlib.suppress(OSError):
                _write_file(sim, ROOT / f"f{number}", b"x")
        return sim.log

    assert run(3) == run(3)
    assert run(3) != run(4)


# --- durable directories -------------------------------------------------------------------


def test_a_directory_made_with_plain_mkdir_vanishes_with_its_fsynced_files() -> None:
    """Why ensure_dir exists: the file and its directory entry were fsynced, but the
    directory's own name in its parent never was."""
    sim = _sim()
    sim.mkdir(ROOT / "table")
    _write_file(sim, ROOT / "table" / "seg", b"rows")
    sim.fsync_dir(ROOT / "table")
    sim.crash()
    assert not sim.exists(ROOT / "table")


def test_ensure_dir_directories_survive_a_crash_with_their_fsynced_files() -> None:
    sim = _sim()
    ensure_dir(sim, ROOT / "group-1" / "table", root=ROOT)
    _write_file(sim, ROOT / "group-1" / "table" / "seg", b"rows")
    sim.fsync_dir(ROOT / "group-1" / "table")
    sim.crash()
    assert read_file(sim, ROOT / "group-1" / "table" / "seg") == b"rows"


def test_ensure_dir_creates_missing_ancestors_of_the_root_durably() -> None:
    sim = SimFiles()
    ensure_dir(sim, Path("/a/b/c/d"), root=Path("/a/b/c"))
    sim.crash()
    assert sim.is_dir(Path("/a/b/c/d"))


def test_ensure_dir_makes_a_found_but_unsynced_directory_durable() -> None:
    """A run killed between mkdir and the parent's fsync: the next run finds the directory
    (the page cache still has it) and must not take it for durable."""
    sim = _sim()
    sim.mkdir(ROOT / "group-1")
    sim.mkdir(ROOT / "group-1" / "table")
    ensure_dir(sim, ROOT / "group-1" / "table", root=ROOT / "group-1")
    sim.crash()
    assert sim.is_dir(ROOT / "group-1" / "table")


def test_ensure_dir_on_a_file_raises() -> None:
    sim = _sim()
    _write_file(sim, ROOT / "f", b"")
    with pytest.raises(FileExistsError):
        ensure_dir(sim, ROOT / "f", root=ROOT)
    with pytest.raises(FileExistsError):
        ensure_dir(sim, ROOT / "f" / "g", root=ROOT)


def test_ensure_dir_on_the_real_file_system(tmp_path: Path) -> None:
    ensure_dir(REAL_FILES, tmp_path / "x" / "y", root=tmp_path / "x")
    ensure_dir(REAL_FILES, tmp_path / "x" / "y", root=tmp_path / "x")  # Idempotent.
    assert (tmp_path / "x" / "y").is_dir()


# --- bounded open files --------------------------------------------------------------------


def test_open_files_holds_at_most_its_bound_and_spares_recently_used_handles() -> None:
    sim = _sim()
    open_files = OpenFiles(open_max=3)
    handles = [open_files.open(sim, ROOT / f"f{n}", APPEND) for n in range(3)]
    for handle in handles:
        handle.used = False
    handles[0].used = True  # Used since the clock hand passed.
    kept = handles[0]
    del handles
    open_files.open(sim, ROOT / "f3", APPEND)
    assert open_files.count == 3
    assert sim.open_fds == 3  # The dropped handle, unused, was closed at once.
    assert sim.write(kept.fd, b"still open") == 10


def test_a_dropped_handle_in_use_stays_open_until_released() -> None:
    sim = _sim()
    open_files = OpenFiles(open_max=1)
    in_use = open_files.open(sim, ROOT / "a", APPEND)
    open_files.open(sim, ROOT / "b", APPEND)  # Drops `in_use` from the set...
    assert open_files.count == 1
    assert sim.write(in_use.fd, b"ok") == 2  # ... but its fd stays valid while held.
    del in_use
    assert sim.open_fds == 1


def test_open_files_closes_idle_handles_and_retries_on_emfile() -> None:
    sim = SimFiles(open_files_max=4)
    ensure_dir(sim, ROOT, root=ROOT)
    open_files = OpenFiles(open_max=100)  # Larger than what the "process" can open.
    for number in range(10):
        open_files.open(sim, ROOT / f"f{number}", APPEND)
    assert sim.open_fds <= 4


def test_raise_fd_soft_limit_raises_to_the_hard_limit() -> None:
    script = textwrap.dedent(
        """
        import resource
        from raftstore.storage.files import raise_fd_soft_limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        assert raise_fd_soft_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert raise_fd_soft_limit() == hard  # idempotent
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


# --- early writeback ---------------------------------------------------------------------


class _GatedFiles(SimFiles):
    """start_writeback blocks until released, records its fds, and can fail."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started: list[int] = []
        self.dropped: list[tuple[int, int, int]] = []
        self.error: OSError | None = None

    def start_writeback(self, fd: int, /) -> None:
        self.gate.wait(10)
        self.started.append(fd)
        if self.error is not None:
            raise self.error

    def drop_cached(self, fd: int, position: int, length: int, /) -> None:
        super().drop_cached(fd, position, length)
        self.dropped.append((fd, position, length))


def _gated() -> _GatedFiles:
    files = _GatedFiles()
    ensure_dir(files, ROOT, root=ROOT)
    return files


def test_real_start_writeback_starts_on_a_file_and_names_a_bad_fd(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "data", APPEND, FILE_MODE)
    try:
        os.write(fd, b"x" * 65536)
        REAL_FILES.start_writeback(fd)  # Linux: sync_file_range; elsewhere nothing.
    finally:
        os.close(fd)
    if sys.platform == "linux":
        with pytest.raises(OSError, match="Bad file descriptor"):
            REAL_FILES.start_writeback(fd)


def test_writeback_runs_each_file_once_and_drops_beyond_its_queue() -> None:
    files = _gated()
    open_files = OpenFiles(open_max=10)
    handles = [open_files.open(files, ROOT / f"f{n}", APPEND) for n in range(4)]
    writeback = Writeback(queue_max=2)
    writeback.request(handles[0])  # Taken by the thread, which waits at the gate.
    writeback.request(handles[0])  # Already queued: nothing more.
    writeback.request(handles[1])
    writeback.request(handles[2])  # Two queued: dropped, left to the fsync.
    assert writeback.dropped_total == 1
    files.gate.set()
    assert writeback.wait_idle(10)
    assert files.started == [handles[0].fd, handles[1].fd]
    assert writeback.started_total == 2
    writeback.request(handles[3])
    assert writeback.wait_idle(10)
    assert files.started[-1] == handles[3].fd


def test_a_queued_writeback_keeps_its_file_open_until_it_ran() -> None:
    files = _gated()
    open_files = OpenFiles(open_max=1)
    handle = open_files.open(files, ROOT / "a", APPEND)
    fd = handle.fd
    writeback = Writeback()
    writeback.request(handle)
    open_files.forget(handle)  # The table let it go...
    del handle
    assert files.open_fds == 1  # ... but the queued request still holds it.
    files.gate.set()
    assert writeback.wait_idle(10)
    assert files.started == [fd]
    # Closed once the thread is done with it.
    wait_until(lambda: files.open_fds == 0, timeout_s=10, message="the queued fd closed")


def test_a_failed_writeback_is_counted_and_logged_and_the_thread_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    files = _gated()
    files.gate.set()
    files.error = OSError(errno.EIO, "I/O error")
    handle = OpenFiles().open(files, ROOT / "a", APPEND)
    writeback = Writeback()
    with caplog.at_level(logging.WARNING):
        writeback.request(handle)
        assert writeback.wait_idle(10)
    assert writeback.failed_total == 1
    assert "early writeback failed" in caplog.text
    files.error = None
    writeback.request(handle)
    assert writeback.wait_idle(10)
    assert writeback.started_total == 1


def test_writeback_drops_from_the_page_cache_what_the_previous_writeback_started_on() -> None:
    files = _gated()
    files.gate.set()
    handle = OpenFiles().open(files, ROOT / "a", APPEND)
    writeback = Writeback()
    sizes = [3 * PAGE_BYTES + 100, 7 * PAGE_BYTES + 5, 7 * PAGE_BYTES + 9]
    for size in sizes:
        write_all(files, handle.fd, [b"x" * (size - files.size(handle.fd))])
        writeback.request(handle)
        assert writeback.wait_idle(10)
    # Whole pages, each range once, and only what an earlier request started on.
    assert files.dropped == [
        (handle.fd, 0, 3 * PAGE_BYTES),
        (handle.fd, 3 * PAGE_BYTES, 4 * PAGE_BYTES),
    ]
    assert files.started == [handle.fd] * 3


def test_real_drop_cached_keeps_the_bytes_and_names_a_bad_fd(tmp_path: Path) -> None:
    path = tmp_path / "data"
    fd = os.open(path, APPEND, FILE_MODE)
    try:
        os.write(fd, b"y" * (4 * PAGE_BYTES))
        os.fdatasync(fd)
        REAL_FILES.drop_cached(fd, 0, 4 * PAGE_BYTES)  # Linux: POSIX_FADV_DONTNEED.
    finally:
        os.close(fd)
    assert path.read_bytes() == b"y" * (4 * PAGE_BYTES)
    if hasattr(os, "posix_fadvise"):
        with pytest.raises(OSError, match="Bad file descriptor"):
            REAL_FILES.drop_cached(fd, 0, PAGE_BYTES)


def test_real_preallocate_allocates_past_the_end_and_keeps_the_size(tmp_path: Path) -> None:
    path = tmp_path / "segment"
    fd = os.open(path, APPEND, FILE_MODE)
    try:
        os.write(fd, b"head")
        blocks_before = os.fstat(fd).st_blocks
        REAL_FILES.preallocate(fd, 4, 1024 * 1024)
        stat = os.fstat(fd)
        assert stat.st_size == 4  # an O_APPEND write still lands right after the head
        if sys.platform == "linux":
            assert stat.st_blocks * 512 >= blocks_before * 512 + 1024 * 1024
        write_all(REAL_FILES, fd, [b"x" * 100_000])
        os.fdatasync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"head" + b"x" * 100_000
    REAL_FILES.preallocate(fd, 0, 4096)  # a closed fd: advisory, nothing raised


@contextlib.contextmanager
def _small_ext4(directory: Path, size_bytes: int) -> Iterator[Path]:
    """An ext4 file system of `size_bytes` in an image file, loop-mounted (root only)."""
    image, mount = directory / "ext4.img", directory / "ext4"
    mount.mkdir()
    with image.open("wb") as file:
        file.truncate(size_bytes)
    for command in (
        ["mkfs.ext4", "-q", "-F", str(image)],
        ["mount", "-o", "loop", str(image), str(mount)],
    ):
        try:
            result = subprocess.run(command, capture_output=True, text=True, check=False)
        except FileNotFoundError:
            pytest.skip(f"{command[0]} is not installed")
        if result.returncode != 0:
            pytest.skip(f"cannot make a small ext4 ({' '.join(command)}): {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False, capture_output=True)


def test_a_preallocation_the_disk_cannot_hold_gives_back_what_it_took(tmp_path: Path) -> None:
    # ext4 keeps the blocks a failed fallocate found, past the end of the file.
    with _small_ext4(tmp_path, 8 * MIB) as disk:
        path = disk / "segment"
        fd = os.open(path, APPEND, FILE_MODE)
        try:
            write_all(REAL_FILES, fd, [b"h" * 100])
            os.fdatasync(fd)  # its block allocated: the free count below is settled
            free = free_bytes(disk)
            REAL_FILES.preallocate(fd, 100, 64 * MIB)  # ENOSPC, swallowed
            # Given back, but for a block of the file's extent tree that ext4 keeps (without
            # the truncate the disk stays full: free 0).
            assert free_bytes(disk) >= free - 64 * 1024, (free, free_bytes(disk))
            assert os.fstat(fd).st_size == 100
            write_all(REAL_FILES, fd, [b"y" * (free // 2)])  # what fits still fits
            with pytest.raises(OSError, match="No space left"):  # the append reports it
                write_all(REAL_FILES, fd, [b"z" * free])
        finally:
            os.close(fd)
        assert path.read_bytes()[:100] == b"h" * 100
