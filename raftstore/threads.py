"""The node's long-lived threads have one owner: `Threads` starts them and joins them.

A component that starts its own thread leaves the question "who joins it, and when?" to
whoever reads its close(); with one owner the node can say at stop which threads are still
running. Node builds one `Threads` and hands its `start` (a `Spawn`) to every component
that runs a loop (group commit, the local replica, repair jobs, slow consumers, the status
port, hand-over). Each component still stops its own loop (its stop event or close) and may
join the thread `Spawn` returned where its own resources depend on it (a journal closed
after its writer); Node joins them all, within one deadline, once it has told them to stop.

Request-scoped threads (gRPC's worker pool, the status port's per-request threads, a
PublishStream's reader) live and die with one request and are not registered here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# What a component is given instead of `threading.Thread`: start `target` as a daemon
# thread called `name` (thread names are what logs, py-spy and bench/profile.py show).
Spawn = Callable[[str, Callable[[], None]], threading.Thread]


class Threads:
    """Starts named daemon threads and joins them with a deadline. Thread-safe: repair jobs
    are started from the applier's thread while the node starts others."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, name: str, target: Callable[[], None]) -> threading.Thread:
        """Start `target` as daemon thread `name` (a `Spawn`). Daemon: a thread that
        misses the join deadline must not keep the process from exiting."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            # Threads started per job (a repair, a hand-over) come and go for the node's
            # whole life: forget the finished ones so the list stays as long as the live.
            self._threads = [known for known in self._threads if known.is_alive()]
            self._threads.append(thread)
            # Started under the lock, so a concurrent prune never sees it not yet alive.
            thread.start()
        return thread

    def alive(self) -> list[str]:
        """The names of the registered threads still running."""
        with self._lock:
            return [thread.name for thread in self._threads if thread.is_alive()]

    def join(self, timeout_s: float) -> list[str]:
        """Wait for every registered thread, `timeout_s` in all (not each); returns, and
        logs, the names of those still alive then. Call after telling them to stop."""
        deadline = time.monotonic() + timeout_s
        current = threading.current_thread()
        with self._lock:
            # A registered thread may call this too: it cannot join itself.
            threads = [thread for thread in self._threads if thread is not current]
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        left = [thread.name for thread in threads if thread.is_alive()]
        if left:
            log.warning("threads still running after %.1f s: %s", timeout_s, ", ".join(left))
        return left
