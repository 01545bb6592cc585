"""Who is calling, and may they: logins, session tokens and the check every RPC makes.

A client logs in once (`Login`: user name and password, checked against the salted scrypt
hash in the replicated access control, access.py) and gets a token that it sends in the
`hastream-token` metadata entry of every later call, to any node. A token is
`user:generation:expires_ms:tag`, the tag an HMAC-SHA256 keyed from the cluster secret
(derived apart from the Raft and peer keys): every node verifies it alone, without a round
trip. It ends at `expires_ms` (limits.TOKEN_TTL_S after the login), and at once when the
user is deleted or its password reset (the user's generation then differs).

Calls signed by a cluster node (peer_auth.py) act with admin rights: nodes forward
leadership transfers to each other.

With `authentication=off` in cluster.cfg every call acts as an admin (a loopback-only
development cluster); config.py refuses that setting on a node reachable off loopback
unless the operator says `authentication=off` explicitly.

Threads: any request thread; the login slots and the refusal log are thread-safe.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from hastream.errors import (
    ConfigError,
    NodeUnavailable,
    Overloaded,
    PermissionDenied,
    RaftStoreError,
    Unauthenticated,
)
from raftstore import limits, passwords
from raftstore.access import ADMIN, AccessControl, User
from raftstore.commands import Privilege
from raftstore.log_limits import OncePerInterval
from raftstore.peer_auth import METADATA_KEY as PEER_METADATA_KEY
from raftstore.peer_auth import PeerVerifier

log = logging.getLogger(__name__)

TOKEN_METADATA_KEY: Final = "hastream-token"
_KEY_SALT: Final = b"hastream-login-token-v1"


@functools.cache
def _dummy_hash() -> bytes:
    """Verified against when the user is unknown, so that a wrong name costs what a wrong
    password costs (neither the answer nor its timing tells which users exist)."""
    return passwords.hash_password("not a password of anyone")


def token_key(secret: str) -> bytes:
    """The HMAC key of login tokens, derived from the cluster secret (once per node)."""
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), _KEY_SALT, 100_000, dklen=32)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a call acts as: a user, or a cluster node ("node:<alias>", admin rights)."""

    user: str
    admin: bool


_ANONYMOUS_ADMIN: Final = Principal("", admin=True)


class Tokens:
    """Issues and verifies login tokens. Stateless apart from the key; thread-safe."""

    def __init__(self, key: bytes, clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self._clock = clock

    def _tag(self, user: str, generation: int, expires_ms: int) -> str:
        message = f"{user}:{generation}:{expires_ms}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def issue(self, user: User) -> tuple[str, int]:
        """(token, expires_ms) for `user`."""
        expires_ms = int((self._clock() + limits.TOKEN_TTL_S) * 1000)
        tag = self._tag(user.name, user.generation, expires_ms)
        return f"{user.name}:{user.generation}:{expires_ms}:{tag}", expires_ms

    def check(self, token: str) -> tuple[str, int]:
        """(user, generation) of a token this cluster issued that has not expired. Raises
        Unauthenticated."""
        parts = token.split(":") if len(token) <= limits.TOKEN_CHARS_MAX else []
        if len(parts) != 4 or not (parts[1].isdigit() and parts[2].isdigit()):
            raise Unauthenticated("malformed login token")
        user, generation, expires_ms = parts[0], int(parts[1]), int(parts[2])
        if not hmac.compare_digest(self._tag(user, generation, expires_ms), parts[3]):
            raise Unauthenticated("login token not issued by this cluster")
        if expires_ms <= self._clock() * 1000:
            raise Unauthenticated("login token expired: log in again")
        return user, generation


def _verified(access: AccessControl, user: str, password: str) -> User | None:
    """The user, if `password` is its password in `access` (costs one scrypt either way)."""
    record = access.user(user)
    stored = _dummy_hash() if record is None else record.password_hash
    matches = passwords.verify_password(password, stored)
    return record if record is not None and matches else None


ADMIN_PASSWORD_ENV: Final = "HASTREAM_ADMIN_PASSWORD"
ADMIN_PASSWORD_CHARS_MIN: Final = 8


def bootstrap_password(path: Path | None, environ: Mapping[str, str]) -> str | None:
    """The first admin's password: the environment variable HASTREAM_ADMIN_PASSWORD, else
    the file `path` (adminPasswordFile; one line), else None. Raises ConfigError for a file
    that cannot be read or a password shorter than ADMIN_PASSWORD_CHARS_MIN."""
    where = ADMIN_PASSWORD_ENV
    password = environ.get(ADMIN_PASSWORD_ENV)
    if password is None and path is not None:
        where = str(path)
        try:
            password = path.read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(where, "adminPasswordFile", str(path), str(error)) from None
    if password is None:
        return None
    if len(password) < ADMIN_PASSWORD_CHARS_MIN:
        reason = f"the admin password needs at least {ADMIN_PASSWORD_CHARS_MIN} characters"
        raise ConfigError(where, "adminPasswordFile", "<hidden>", reason)
    return password


class Authenticator:
    """The check in front of every client RPC (see the module docstring)."""

    def __init__(
        self,
        *,
        enabled: bool,
        tokens: Tokens,
        access: Callable[[], AccessControl],
        leader_access: Callable[[], AccessControl],
        peers: PeerVerifier,
    ) -> None:
        """`access`: the access control to decide with (the catalog group's, local or
        fetched); `leader_access`: the catalog leader's, asked before a login, a token or a
        call that `access` refuses is refused (the local copy may lag the leader by a
        moment: what the cluster acknowledged must count on every node at once).
        Both raise RaftStoreError when they cannot answer."""
        self.enabled = enabled
        self._tokens = tokens
        self._access = access
        self._leader_access = leader_access
        self._peers = peers
        self._logins = threading.BoundedSemaphore(limits.LOGINS_CONCURRENT_MAX)
        self._refusals = OncePerInterval()

    def login(self, user: str, password: str) -> tuple[str, int, bool]:
        """(token, expires_ms, whether the user is an admin). Raises Unauthenticated (the
        same answer for an unknown user and a wrong password), Overloaded (too many
        logins at once) or NodeUnavailable (the cluster has no user yet: retryable)."""
        if not self._logins.acquire(blocking=False):
            raise Overloaded("logins", limits.LOGINS_CONCURRENT_MAX)
        try:
            access = self._access()
            record = _verified(access, user, password)
            if record is None:
                access = self._leader_view(access)
                record = _verified(access, user, password)
        finally:
            self._logins.release()
        if record is None and not access.has_users():
            # Right after a first start the catalog leader is about to create the first
            # admin: a retryable answer, so clients wait for it instead of failing.
            raise NodeUnavailable(
                "no users yet: the catalog group's leader creates the first admin from "
                "adminPasswordFile (or HASTREAM_ADMIN_PASSWORD)"
            )
        if record is None:
            reason = "wrong user name or password"
            self._refuse(f"login of {user[:64]!r}", reason)
            raise Unauthenticated(reason)
        token, expires_ms = self._tokens.issue(record)
        return token, expires_ms, record.admin

    def _leader_view(self, local: AccessControl) -> AccessControl:
        """The leader's access control, or `local` when the leader cannot be asked."""
        try:
            return self._leader_access()
        except RaftStoreError as error:
            log.info("the catalog leader's users could not be read: %s", error)
            return local

    def principal(self, method: str, metadata: Iterable[tuple[str, str | bytes]]) -> Principal:
        """Who calls `method`. Raises Unauthenticated (no, bad, expired or revoked token)."""
        if not self.enabled:
            return _ANONYMOUS_ADMIN
        entries = list(metadata)
        token = next((value for key, value in entries if key == TOKEN_METADATA_KEY), None)
        if token is None and any(key == PEER_METADATA_KEY for key, _ in entries):
            return Principal(f"node:{self._peers.verify(method, entries)}", admin=True)
        if not isinstance(token, str):
            self._refuse(method, "no login token")
            raise Unauthenticated(f"{method} needs a login (connect with userid and password)")
        try:
            name, generation = self._tokens.check(token)
        except Unauthenticated as error:
            self._refuse(method, error.reason)
            raise
        user = self._access().user(name)
        if user is None or user.generation != generation:
            user = self._leader_view(self._access()).user(name)
        if user is None or user.generation != generation:
            self._refuse(method, f"token of {name!r} revoked")
            raise Unauthenticated("login token revoked (user deleted or password reset)")
        return Principal(name, user.admin)

    def require_admin(self, method: str, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        """Raises Unauthenticated or PermissionDenied unless an admin calls."""
        principal = self.principal(method, metadata)
        if not principal.admin:
            raise PermissionDenied(principal.user, ADMIN)

    def require(
        self,
        method: str,
        metadata: Iterable[tuple[str, str | bytes]],
        privilege: Privilege,
        table: str,
        *,
        or_also: Privilege | None = None,
    ) -> Principal:
        """Raises Unauthenticated or PermissionDenied unless the caller may use `privilege`
        (or `or_also`) on `table`."""
        principal = self.principal(method, metadata)
        if or_also is not None and self._allows(principal, or_also, table):
            return principal
        self.check(principal, privilege, table)
        return principal

    def check(self, principal: Principal, privilege: Privilege, table: str) -> None:
        """Raises PermissionDenied unless `principal` may use `privilege` on `table`."""
        if not self._allows(principal, privilege, table):
            raise PermissionDenied(principal.user, privilege.name, table)

    def _allows(self, principal: Principal, privilege: Privilege, table: str) -> bool:
        if principal.admin:
            return True
        access = self._access()
        if access.allows(principal.user, privilege, table):
            return True
        # Refused here: ask the leader before refusing (a grant acknowledged a moment ago
        # may not be applied on this replica yet).
        return self._leader_view(access).allows(principal.user, privilege, table)

    def _refuse(self, what: str, reason: str) -> None:
        events = self._refusals.due()
        if events is not None:
            log.warning("refused %s: %s (%d refusals since the last line)", what, reason, events)
