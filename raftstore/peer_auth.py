"""Who may call the peer-only RPCs: nodes that hold the cluster secret.

FetchRecords and FetchRecordBatches, the table-name catalog calls, GetTableDigest and
RepairTable serve other nodes, never clients: they hand out raw data-file records and change
the catalog. A node calling them signs each call with an HMAC-SHA256 keyed from
`streamingRaftSecret` (a key of its own, derived apart from the Raft payload key) over the
method, its alias, the time and a random nonce, in the `hastream-peer` metadata entry. The
receiver checks the tag, that the time is within `PEER_CLOCK_SKEW_S`, and that the nonce is
new (a bounded cache over the same window), so a recorded call cannot be replayed. Anything
else is `Unauthenticated`, and the RPC does nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Final

from hastream.errors import Overloaded, Unauthenticated
from raftstore import limits

METADATA_KEY: Final = "hastream-peer"
_KEY_SALT: Final = b"hastream-peer-rpc-v1"
_NONCE_BYTES: Final = 16
# alias (64) + time + nonce + tag and separators, with room to spare: longer is garbage.
_SIGNATURE_CHARS_MAX: Final = 256


def peer_key(secret: str) -> bytes:
    """The HMAC key of peer RPCs, derived from the cluster secret (slowly, once per node)."""
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), _KEY_SALT, 100_000, dklen=32)


def _tag(key: bytes, method: str, alias: str, time_ms: int, nonce: str) -> str:
    message = "\n".join((method, alias, str(time_ms), nonce)).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


class PeerSigner:
    """Signs this node's calls to its peers."""

    def __init__(self, key: bytes, alias: str, clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self._alias = alias
        self._clock = clock

    def metadata(self, method: str) -> tuple[tuple[str, str]]:
        time_ms = int(self._clock() * 1000)
        nonce = os.urandom(_NONCE_BYTES).hex()
        tag = _tag(self._key, method, self._alias, time_ms, nonce)
        return ((METADATA_KEY, f"{self._alias} {time_ms} {nonce} {tag}"),)


class PeerVerifier:
    """Checks a peer-only call's signature. Thread-safe."""

    def __init__(
        self,
        key: bytes,
        clock: Callable[[], float] = time.time,
        *,
        nonces_max: int = limits.PEER_NONCES_MAX,
    ) -> None:
        """`nonces_max`: the replay cache's bound (PEER_NONCES_MAX)."""
        self._key = key
        self._clock = clock
        self._nonces_max = nonces_max
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it expires

    def verify(self, method: str, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """The calling node's alias. Raises Unauthenticated (no, malformed, forged, stale
        or replayed signature) or Overloaded (the replay cache is full of live nonces)."""
        value = next((v for k, v in metadata if k == METADATA_KEY), None)
        if not isinstance(value, str):
            raise Unauthenticated(f"{method} is for cluster nodes only (no peer signature)")
        parts = value.split(" ", 4) if len(value) <= _SIGNATURE_CHARS_MAX else []
        if len(parts) != 4 or not (parts[1].isdigit() and len(parts[1]) <= 16):
            raise Unauthenticated(f"{method}: malformed peer signature")
        alias, time_text, nonce, tag = parts
        expected = _tag(self._key, method, alias, int(time_text), nonce)
        if not hmac.compare_digest(expected, tag):
            raise Unauthenticated(f"{method}: bad peer signature (another cluster secret?)")
        now = self._clock()
        if abs(now - int(time_text) / 1000) > limits.PEER_CLOCK_SKEW_S:
            raise Unauthenticated(
                f"{method}: peer signature of {alias} is stale or from the future "
                f"(clocks more than {limits.PEER_CLOCK_SKEW_S:.0f}s apart?)"
            )
        self._remember(nonce, now + 2 * limits.PEER_CLOCK_SKEW_S, method)
        return alias

    def _remember(self, nonce: str, expires: float, method: str) -> None:
        with self._lock:
            now = self._clock()
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise Unauthenticated(f"{method}: replayed peer call")
            if len(self._seen) >= self._nonces_max:
                raise Overloaded("peer calls", self._nonces_max)
            self._seen[nonce] = expires
