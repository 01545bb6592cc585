"""Admission of long-lived streams (Subscribe, Read, PublishStream, FetchRecords and
FetchRecordBatches).

Each open stream holds one of the server's worker threads for as long as it lasts. Without
a bound, a few hundred idle subscriptions (or one client opening streams in a loop) take
every worker, and publishes and leader lookups wait behind them or fail with an untyped
RESOURCE_EXHAUSTED. So streams are counted apart: at most `STREAMS_MAX` per node and
`STREAMS_PER_CONNECTION_MAX` per client connection; the workers left over always serve
unary calls. A refused stream gets `Overloaded` (typed, retryable: the client backs off).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from hastream.errors import Overloaded
from raftstore import limits


class StreamSlots:
    """Thread-safe counters of open streams, in all and per connection (gRPC's peer
    string, `ipv4:host:port`: one per client connection)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._by_connection: dict[str, int] = {}

    @property
    def open(self) -> int:
        with self._lock:
            return self._open

    @contextlib.contextmanager
    def hold(self, connection: str) -> Iterator[None]:
        """One slot for the stream's lifetime. Raises Overloaded when none is free."""
        with self._lock:
            if self._open >= limits.STREAMS_MAX:
                raise Overloaded("streams", limits.STREAMS_MAX)
            held = self._by_connection.get(connection, 0)
            if held >= limits.STREAMS_PER_CONNECTION_MAX:
                raise Overloaded("streams of one connection", limits.STREAMS_PER_CONNECTION_MAX)
            self._open += 1
            self._by_connection[connection] = held + 1
        try:
            yield
        finally:
            with self._lock:
                self._open -= 1
                left = self._by_connection[connection] - 1
                if left:
                    self._by_connection[connection] = left
                else:
                    del self._by_connection[connection]
