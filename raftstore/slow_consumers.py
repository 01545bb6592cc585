"""Slow consumers: a subscriber that stops taking messages is disconnected and told so.

gRPC sends one message of a server stream at a time and waits until the transport has
taken it, so what a subscriber that reads nothing costs the node is bounded: the HTTP/2
windows and one message. But it holds a stream slot and a worker thread for ever (its TCP
connection answers keepalive pings). As NATS does with a slow consumer, a send that has
waited `timeout_s` for the subscriber is ended with RESOURCE_EXHAUSTED and a message that
says why; the client resubscribes from its offset when it reads again.

Threads: each stream marks its sends from its own request thread; one thread, started by
`start` through the node's `spawn` (threads.py), checks them every `CHECK_S` and cancels the
overdue ones.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, TypeVar

import grpc

from hastream import wire
from raftstore.log_limits import OncePerInterval
from raftstore.threads import Spawn

log = logging.getLogger(__name__)

CHECK_S: Final = 0.5
T = TypeVar("T")


class _Watch:
    __slots__ = ("cancel", "cancelled", "peer", "sending_since")

    def __init__(self, peer: str, cancel: Callable[[str], None]) -> None:
        self.peer = peer
        self.cancel = cancel
        self.sending_since: float | None = None
        self.cancelled = False


class SlowConsumers:
    """Watches the sends of the streams it is given (see the module docstring)."""

    def __init__(
        self, timeout_s: float, *, spawn: Spawn, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.timeout_s = timeout_s
        self._spawn = spawn
        self._clock = clock
        self._lock = threading.Lock()
        self._watches: set[_Watch] = set()
        self.disconnected = 0
        self._log = OncePerInterval()

    def start(self, stopping: threading.Event) -> None:
        """Check every `CHECK_S` until `stopping` is set (the node joins the thread)."""

        def run() -> None:
            while not stopping.wait(CHECK_S):
                self.check()

        self._spawn("slow-consumers", run)

    def watched(self, context: grpc.ServicerContext, messages: Iterable[T]) -> Iterator[T]:
        """`messages`, each sent under watch: a send that waits past `timeout_s` ends the
        call (RESOURCE_EXHAUSTED, the reason in its details)."""
        watch = _Watch(context.peer(), lambda reason: _cancel_with_status(context, reason))
        with self._watching(watch):
            for message in messages:
                watch.sending_since = self._clock()
                yield message  # returns once the transport took it
                watch.sending_since = None

    @contextlib.contextmanager
    def _watching(self, watch: _Watch) -> Iterator[None]:
        with self._lock:
            self._watches.add(watch)
        try:
            yield
        finally:
            with self._lock:
                self._watches.discard(watch)

    def check(self) -> None:
        """Cancel every stream whose current send has waited past `timeout_s`."""
        now = self._clock()
        with self._lock:
            overdue = [
                watch
                for watch in self._watches
                if not watch.cancelled
                and watch.sending_since is not None
                and now - watch.sending_since > self.timeout_s
            ]
            for watch in overdue:
                watch.cancelled = True
            self.disconnected += len(overdue)
        for watch in overdue:
            reason = (
                f"{wire.SLOW_CONSUMER_DETAILS_PREFIX} the subscriber took no message for "
                f"{self.timeout_s:g} s; disconnected (resubscribe from the last processed offset)"
            )
            watch.cancel(reason)
            events = self._log.due()
            if events is not None:
                log.warning(
                    "disconnected a slow consumer peer=%r (%d since the last line)",
                    watch.peer,
                    events,
                )


def _cancel_with_status(context: Any, reason: str) -> None:
    """End the call with RESOURCE_EXHAUSTED and `reason`, from any thread. gRPC's public
    `context.cancel()` ends it as CANCELLED without a word, and `context.abort` works only
    on the handler's thread, which is the one stuck in the send: so the core call is
    cancelled with a status (grpc_call_cancel_with_status) when it can be reached."""
    call: Any = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        from grpc._cython import cygrpc

        call.cancel(cygrpc.StatusCode.resource_exhausted, reason)
    except Exception:  # another gRPC build: still end the stream, without the reason
        context.cancel()
