"""Capped, jittered exponential backoff bounded by a deadline: the client's one retry helper.

Every retry loop in `api_clients/` draws its waits from a `Backoff`, so no loop can retry
forever: a `Backoff` runs out when its deadline passes or after `retries_max` waits
(retries), whichever comes first.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Final

log = logging.getLogger(__name__)

Clock = Callable[[], float]
# The return value is ignored, so `threading.Event.wait` works as an interruptible sleep.
Sleep = Callable[[float], object]

BACKOFF_INITIAL_S: Final = 0.05
# Short on purpose: a leader election ends within ~2 s (docs/benchmark.md, failover), and a
# client asleep in a long backoff when it ends adds its whole sleep to the outage. A retry is
# one cheap RPC, so 4 per second per client costs the cluster little during an outage.
BACKOFF_MAX_S: Final = 0.25
BACKOFF_MULTIPLIER: Final = 2.0
# Each delay is drawn from [base * (1 - JITTER), base], so concurrent clients spread out
# while every delay still grows with the attempt number.
BACKOFF_JITTER: Final = 0.5
BACKOFF_RETRIES_MAX: Final = 1_000


class Backoff:
    """One retry budget for one operation: waits grow as `initial_s * multiplier**n`, are
    capped at `max_s`, jittered down by up to `jitter` of their value, and end at the deadline.

    Not thread-safe: create one per operation, on the thread that retries.
    """

    def __init__(
        self,
        initial_s: float = BACKOFF_INITIAL_S,
        max_s: float = BACKOFF_MAX_S,
        deadline_s: float = 30.0,
        *,
        multiplier: float = BACKOFF_MULTIPLIER,
        jitter: float = BACKOFF_JITTER,
        retries_max: int = BACKOFF_RETRIES_MAX,
        clock: Clock = time.monotonic,
        sleep: Sleep = time.sleep,
        random_fraction: Callable[[], float] = random.random,
    ) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got {initial_s} and {max_s}")
        if deadline_s < 0:
            raise ValueError(f"deadline_s must be >= 0, got {deadline_s}")
        if multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {multiplier}")
        if not 0 <= jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {jitter}")
        if retries_max < 1:
            raise ValueError(f"retries_max must be >= 1, got {retries_max}")
        self._initial_s = initial_s
        self._max_s = max_s
        self._multiplier = multiplier
        self._jitter = jitter
        self._retries_max = retries_max
        self._clock = clock
        self._sleep = sleep
        self._random_fraction = random_fraction
        self._deadline = clock() + deadline_s
        self._waits = 0

    @property
    def waits(self) -> int:
        """How many waits this budget has handed out so far."""
        return self._waits

    def remaining_s(self) -> float:
        """Seconds left until the deadline; never negative."""
        return max(0.0, self._deadline - self._clock())

    def expired(self) -> bool:
        """True once the deadline has passed or every wait has been used."""
        return self.remaining_s() <= 0 or self._waits >= self._retries_max

    def next_delay_s(self) -> float:
        """The next delay, capped and jittered (not yet clipped to the deadline)."""
        exponent = min(self._waits, 64)  # Past 2**64 the cap applies anyway; avoid overflow.
        base_s = min(self._max_s, self._initial_s * self._multiplier**exponent)
        self._waits += 1
        return base_s * (1.0 - self._jitter * self._random_fraction())

    def wait(self) -> bool:
        """Sleep before the next attempt; True if the caller may try again. Returns False at
        once when the retries are used up, and after sleeping to the deadline when it passes."""
        delay_s = self._take_delay()
        if delay_s is None:
            return False
        self._sleep(delay_s)
        return self.remaining_s() > 0

    async def wait_async(self) -> bool:
        """`wait` for asyncio callers: the same budget, an `asyncio.sleep`."""
        delay_s = self._take_delay()
        if delay_s is None:
            return False
        await asyncio.sleep(delay_s)
        return self.remaining_s() > 0

    def _take_delay(self) -> float | None:
        if self.expired():
            return None
        delay_s = min(self.next_delay_s(), self.remaining_s())
        log.debug("backoff wait=%.3fs waits=%d", delay_s, self._waits)
        return delay_s
