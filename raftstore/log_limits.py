"""Rate-limited log lines: a flood of bad input (forged calls, oversized frames) must not
flood the log, yet the operator sees that it happens and how often."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class OncePerInterval:
    """`due()` is the number of events since the last line (this one included) when a
    line may be logged now, else None. Thread-safe."""

    def __init__(
        self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._logged_at = float("-inf")
        self._events = 0

    def due(self) -> int | None:
        with self._lock:
            self._events += 1
            now = self._clock()
            if now - self._logged_at < self._interval_s:
                return None
            events, self._events, self._logged_at = self._events, 0, now
            return events
