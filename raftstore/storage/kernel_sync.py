"""An fdatasync the kernel runs on its own, without a thread of ours: Linux AIO's
IOCB_CMD_FDSYNC (kernel 4.18 and later), its completion counted on an eventfd.

The leader's Raft journal starts an fdatasync after each add and goes on sending while it
runs (journal.py `sync_ahead`). On a helper thread that cost two thread wake-ups and two
GIL hand-overs per fdatasync, on two cores that the leader's tick thread and the followers
share: a measurement-only checkout whose leader neither ran nor waited for its fdatasync
published x1.11 rows/s at one waited row, with x0.61 the context switches (docs/benchmark.md).
Submitted here, the fdatasync runs on a kernel worker; whoever needs to know when it has
returned polls the eventfd (the Raft loop does, only while its commit waits for it).

One context holds at most one fdatasync: the journal starts the next only after it took
the last one's result. Used by one thread at a time (the journal's).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
from typing import Final

# The system call numbers of the two architectures this runs on; elsewhere `open` answers
# None and the journal keeps its helper thread.
_SYSCALLS: Final = {
    "x86_64": {"io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209},
    "aarch64": {"io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_getevents": 4},
}
_IOCB_CMD_FDSYNC: Final = 3
_IOCB_FLAG_RESFD: Final = 1


class _Iocb(ctypes.Structure):
    # struct iocb of <linux/aio_abi.h>, little-endian (aio_key before aio_rw_flags).
    _fields_ = (
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),
        ("aio_rw_flags", ctypes.c_int32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    )


class _IoEvent(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    )


class KernelSync:
    """One AIO context and its eventfd. `submit(fd)` starts an fdatasync of `fd`; `poll()`
    answers whether it returned (taking its result), `wait()` waits for it. A failed
    fdatasync is raised as OSError from whichever of the two takes its result."""

    def __init__(self, numbers: dict[str, int]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)  # a foreign call releases the GIL
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._numbers = numbers
        self._context = ctypes.c_ulong(0)
        self._iocb = _Iocb()
        self._iocb_pointers = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(self._iocb))
        self._event = _IoEvent()
        self._running = False
        self._call("io_setup", ctypes.c_long(1), ctypes.byref(self._context))
        try:
            self._eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError:
            self._call("io_destroy", self._context)
            raise
        self._iocb.aio_lio_opcode = _IOCB_CMD_FDSYNC
        self._iocb.aio_flags = _IOCB_FLAG_RESFD
        self._iocb.aio_resfd = self._eventfd

    def fileno(self) -> int:
        """The eventfd: readable once the running fdatasync has returned."""
        return self._eventfd

    @property
    def running(self) -> bool:
        """An fdatasync was submitted and its result not taken yet."""
        return self._running

    def submit(self, fd: int) -> None:
        """Start an fdatasync of `fd`. OSError when the kernel refused it (nothing runs, and
        nothing of the file's state was consumed: the caller may fdatasync it otherwise)."""
        assert not self._running, "one fdatasync at a time"
        self._iocb.aio_fildes = fd
        submitted = self._call("io_submit", self._context, ctypes.c_long(1), self._iocb_pointers)
        if submitted != 1:  # io_submit answers how many it queued: 0 or 1 here
            raise OSError(errno.EAGAIN, "io_submit queued no fdatasync")
        self._running = True

    def poll(self) -> bool:
        """True once the fdatasync submitted last has returned (its result taken: a failure
        raises OSError); False while it runs. One read of the eventfd while it runs."""
        assert self._running
        try:
            os.eventfd_read(self._eventfd)
        except BlockingIOError:
            return False
        self._take(block=False)
        return True

    def wait(self) -> None:
        """Wait for the fdatasync submitted last to return, and take its result."""
        assert self._running
        self._take(block=True)
        with contextlib.suppress(BlockingIOError):  # leave it unreadable for the next
            os.eventfd_read(self._eventfd)

    def _take(self, *, block: bool) -> None:
        timeout = None if block else ctypes.byref(_ZERO_TIMESPEC)
        got = 0
        while got == 0:  # the eventfd counted it, or `block` waits: it is there
            got = self._call(
                "io_getevents",
                self._context,
                ctypes.c_long(1),
                ctypes.c_long(1),
                ctypes.byref(self._event),
                timeout,
            )
        self._running = False
        if self._event.res < 0:
            code = -self._event.res
            raise OSError(code, f"fdatasync: {os.strerror(code)}")

    def close(self) -> None:
        """Destroy the context (the kernel waits for a running fdatasync) and the eventfd."""
        self._call("io_destroy", self._context)
        os.close(self._eventfd)
        self._running = False

    def _call(self, name: str, *args: object) -> int:
        while True:
            result: int = self._syscall(ctypes.c_long(self._numbers[name]), *args)
            if result >= 0:
                return result
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, f"{name}: {os.strerror(code)}")


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


_ZERO_TIMESPEC: Final = _Timespec(0, 0)


def open_kernel_sync() -> KernelSync | None:
    """A KernelSync, or None where this process cannot have one (another architecture, a
    seccomp policy without the AIO calls, the system's AIO contexts used up). A kernel or a
    file system that refuses IOCB_CMD_FDSYNC itself (before Linux 4.18) is found by the
    first `submit`, which then raises OSError having started nothing."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    try:
        return KernelSync(numbers)
    except OSError:
        return None
