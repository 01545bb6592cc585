"""A session's gRPC channels: one per site, dialled on first use, replaced when it cannot
connect, closed once nothing runs on it.

Twice in full test runs a channel made before a node was killed could not connect to the
node once restarted (connects timed out again and again, for 3 s and for 30 s, while the
node served) and a new session's channel connected at once: the stuck state belongs to the
old channel (its cause below gRPC is not known). So after an attempt on a site could not
connect at all, `retire` hands new calls a new channel. The old one is not closed then:
other threads may have calls on it (a pipelined publisher's), and closing a channel cancels
every call on it ("Channel closed"). It is closed when its last call ends. A channel left
as silent by the hedge is the other case: `drop` closes it at once, to end the calls that
wait on it.

Every call counts on the channel it runs on: unary calls for their duration (`call`), and
streams until gRPC says they ended (`hold`). A session keeps at most `RETIRED_MAX` retired
channels; past that the oldest is closed at once, its calls failing CANCELLED, so a site
that keeps failing cannot pile up channels behind long streams.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

from proto import hastream_pb2_grpc

log = logging.getLogger(__name__)

RETIRED_MAX: Final = 16


@dataclass(eq=False)
class Dial:
    """One channel to `site` and the stub over it (with the session's interceptors). The
    channel is a `grpc.Channel`, or a `grpc.aio.Channel` for the asyncio client."""

    site: str
    channel: Any
    stub: hastream_pb2_grpc.StreamTableStub
    calls: int = 0  # calls and streams on the channel (Dials' lock)


class SessionClosed(RuntimeError):
    """A call on a session after `close()`."""

    def __init__(self) -> None:
        super().__init__("session is closed")


def close_now(dial: Dial) -> None:
    dial.channel.close()


def close_aside(dial: Dial) -> None:
    """Closes the channel on a thread of its own. A stream's end is reported on the thread
    gRPC runs for the channel, and a channel closed there waits for that very thread: the
    last call's release must not close it in place (a publisher hung on it)."""
    threading.Thread(target=dial.channel.close, name="channel-close", daemon=True).start()


class Dials:
    """The channels of one session. `dial(site)` makes a new `Dial` (not yet counted).
    `close(dial)` closes a channel for `drop` and `close`, which run on the session's own
    threads; `close_off_thread(dial)` one retired, from a release or a retirement that may
    run on a thread of gRPC's (the asyncio client schedules both on its loop). At most
    `retired_max` retired channels stay open. Thread-safe; the lock is never held across a
    network call or a channel's close."""

    def __init__(
        self,
        dial: Callable[[str], Dial],
        close: Callable[[Dial], None] = close_now,
        close_off_thread: Callable[[Dial], None] = close_aside,
        retired_max: int = RETIRED_MAX,
    ) -> None:
        self._dial = dial
        self._close = close
        self._close_off_thread = close_off_thread
        self._retired_max = retired_max
        self._lock = threading.Lock()
        self._current: dict[str, Dial] = {}
        self._retired: list[Dial] = []  # oldest first, each with calls still on it
        self._closed = False

    def current(self, site: str) -> Dial:
        """`site`'s channel for new calls, dialled when it has none. Raises SessionClosed."""
        with self._lock:
            return self._current_locked(site)

    def _current_locked(self, site: str) -> Dial:
        if self._closed:
            raise SessionClosed()
        dial = self._current.get(site)
        if dial is None:
            dial = self._current[site] = self._dial(site)
        return dial

    @contextmanager
    def call(self, site: str) -> Iterator[Dial]:
        """Counts one call on `site`'s current channel while the block runs."""
        dial, release = self.hold(site)
        try:
            yield dial
        finally:
            release()

    def hold(self, site: str) -> tuple[Dial, Callable[[], None]]:
        """Counts one call on `site`'s current channel until the returned release is called
        (once: later calls do nothing). For a stream, release when gRPC says it ended."""
        with self._lock:
            dial = self._current_locked(site)
            dial.calls += 1
        released = [False]  # under the lock: two threads may end one stream at once

        def release() -> None:
            with self._lock:
                if released[0]:
                    return
                released[0] = True
                dial.calls -= 1
                # Retired and still open: a channel the bound closed is not closed again.
                done = dial.calls == 0 and dial in self._retired
                if done:
                    self._retired.remove(dial)
            if done:
                self._close_off_thread(dial)

        return dial, release

    def retire(self, dial: Dial) -> None:
        """New calls on `dial.site` go over a new channel; `dial`'s is closed when its last
        call ends. Nothing happens when another thread has retired it already."""
        with self._lock:
            if self._current.get(dial.site) is not dial:
                return
            del self._current[dial.site]
            closing = [dial] if dial.calls == 0 else []
            if not closing:
                self._retired.append(dial)
                while len(self._retired) > self._retired_max:
                    closing.append(self._retired.pop(0))
        log.info(
            "dialling a new channel to a site the old one could not connect to site=%s", dial.site
        )
        for old in closing:
            self._close_off_thread(old)

    def drop(self, site: str) -> bool:
        """Closes `site`'s current channel now (every call on it fails CANCELLED); the next
        use dials anew. False when it had none."""
        with self._lock:
            dial = self._current.pop(site, None)
        if dial is None:
            return False
        self._close(dial)
        return True

    def close(self) -> None:
        """Closes every channel, current and retired. Idempotent; later use raises."""
        with self._lock:
            self._closed = True
            dials = [*self._current.values(), *self._retired]
            self._current.clear()
            self._retired.clear()
        for dial in dials:
            self._close(dial)

    def counts(self) -> tuple[int, int]:
        """(current channels, retired channels still open): for tests and status."""
        with self._lock:
            return len(self._current), len(self._retired)
