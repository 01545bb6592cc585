"""Cluster sessions for the Spark side, one per process and site list, created on first use.

Spark pickles data sources, readers, writers and partitions and runs them in other
processes (the planner, the streaming source runner, the executors' Python workers). A gRPC
channel cannot be pickled and must not cross a fork, so nothing here is ever stored on
those objects: `session()` is called inside `read()`/`write()`/`commit()` and returns the
process's cached `api_clients.Session`, keyed by `(pid, sites, timeout, tls)`. Python worker
reuse (Spark's default) makes the cache pay off: a worker keeps its channels across tasks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Final

from api_clients import Session
from api_clients.connection import ATTEMPT_TIMEOUT_S_DEFAULT
from hastream import wire
from hastream.tls import ClientTls

log = logging.getLogger(__name__)

_lock = threading.Lock()
_SessionKey = tuple[int, tuple[str, ...], float, ClientTls | None, tuple[str, str] | None]
_sessions: dict[_SessionKey, Session] = {}
# Sessions are cheap (no I/O until used) but hold channels: bound them per process.
SESSIONS_MAX: Final = 64


def session(
    sites: tuple[str, ...],
    timeout_s: float,
    tls: ClientTls | None = None,
    login: tuple[str, str] | None = None,
) -> Session:
    """The calling process's session over `sites` (over TLS with `tls`, logged in as
    `login`'s (userid, password)); a whole call with its retries is bounded by `timeout_s`.
    Thread-safe."""
    key = (os.getpid(), sites, timeout_s, tls, login)
    with _lock:
        cached = _sessions.get(key)
        if cached is not None:
            return cached
        if len(_sessions) >= SESSIONS_MAX:
            _close_oldest()
        created = Session(
            list(sites),
            timeout_s=min(ATTEMPT_TIMEOUT_S_DEFAULT, timeout_s),
            deadline_s=timeout_s,
            tls=tls,
            userid=None if login is None else login[0],
            password=None if login is None else login[1],
        )
        _sessions[key] = created
        log.debug("new session pid=%d sites=%s", key[0], ",".join(sites))
        return created


def _close_oldest() -> None:
    key = next(iter(_sessions))
    stale = _sessions.pop(key)
    if key[0] == os.getpid():
        stale.close()


def producer_id(*parts: object) -> bytes:
    """A deterministic 16-byte producer id for an idempotency token made of `parts` (for
    example a Spark query id, batch id and partition id): a retried task or a replayed
    micro-batch derives the same id, so the cluster answers its repeated sequences from its
    producer window instead of appending the rows again."""
    text = "\x1f".join(str(part) for part in parts)
    return hashlib.blake2b(text.encode(), digest_size=wire.PRODUCER_ID_BYTES).digest()
