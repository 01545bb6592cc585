"""A Future that costs one object until something waits on it.

`Publisher.append_async` returns a `concurrent.futures.Future` per append, and a pipelined
row-by-row publisher keeps tens of thousands of them in flight. A plain Future builds a
`threading.Condition` at once: about eleven objects the cyclic garbage collector tracks
(the Condition, its deque and five bound methods, two lists). Alive across a few
collections, they are promoted to the oldest generation and set off a full collection
every ~0.1 s, ~90 ms each, in a process that imported pyarrow and gRPC: more than half of a
one-row publisher's time (measured with `gc.callbacks` in a throwaway client).

`AppendFuture` is a Future whose Condition and waiter lists are made on first use, by
whoever first waits, adds a callback or cancels; one that is settled before anyone did is
settled without them. Everything else is Future's own code, so `result`, `exception`,
`add_done_callback`, `concurrent.futures.wait` and `as_completed` behave as for any
Future.

The race it must not lose: a thread that starts waiting (making the Condition) while
another settles (finding none). Both steps run under one module lock, so either the
settle sees the Condition and notifies through it, or the waiter sees the settled state
before it waits.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError
from concurrent.futures._base import FINISHED, PENDING
from typing import Any, Final, TypeVar

T = TypeVar("T")

_LAZY: Final = threading.Lock()
_LAZY_NAMES: Final = frozenset(("_condition", "_waiters", "_done_callbacks"))


class AppendFuture(Future[T]):
    def __init__(self) -> None:  # Future.__init__ without the Condition and the lists
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._observed = False  # the Condition and the lists exist

    def __getattr__(self, name: str) -> Any:
        # Called only for attributes not set yet: the lazy ones are made together, once.
        if name not in _LAZY_NAMES:
            raise AttributeError(name)
        with _LAZY:
            if not self._observed:
                self._condition = threading.Condition()
                self._waiters: list[Any] = []
                self._done_callbacks: list[Any] = []
                self._observed = True
        return object.__getattribute__(self, name)

    def set_result(self, result: T) -> None:
        if not self._settle_unobserved(result, None):
            super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        if not self._settle_unobserved(None, exception):
            super().set_exception(exception)

    def _settle_unobserved(self, result: Any, exception: BaseException | None) -> bool:
        """Settle here if nobody has waited, added a callback or cancelled yet (so nobody
        needs waking); False: Future's own code must."""
        with _LAZY:
            if self._observed:
                return False
            if self._state != PENDING:  # (no repr here: it would take _LAZY again)
                raise InvalidStateError(f"future already {self._state}")
            self._result = result
            self._exception = exception
            self._state = FINISHED
            return True
