"""Logging in: a session with a user id logs in once and sends its token with every call.

`Login` keeps the user's credentials and the token the cluster issued (any node verifies
it, so one login serves every site). `TokenInterceptor` wraps each channel of the session:
it adds the token to the metadata of every call (unary and streaming alike, so publishers,
subscribers, readers and Spark all carry it without knowing), logging in first, over that
same channel, when there is no token yet or it is about to expire. A failed login is the
Login call's own error (Unauthenticated, NodeUnavailable...), so the caller sees the typed
cause and the session's retry policy applies to it as to any call.

The password stays in memory for the session's life (a token expires after hours and is
renewed without the application), as in DolphinDB's API; it is never logged.
Threads: one lock guards the token; a login is a network call made outside it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import grpc

from proto import hastream_pb2, hastream_pb2_grpc

TOKEN_METADATA_KEY: Final = "hastream-token"
LOGIN_TIMEOUT_S: Final = 10.0
# Log in again this long before the token expires (a call must not race the expiry).
RENEW_BEFORE_S: Final = 300.0
_LOGIN_METHOD: Final = "/hastream.v1.StreamTable/Login"


class Login:
    """A user's credentials and current token. Thread-safe."""

    def __init__(self, userid: str, password: str, clock: Callable[[], float] = time.time):
        self.userid = userid
        self._password = password
        self._clock = clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._expires_s = 0.0

    def token(self) -> str | None:
        """The current token, or None when a login is due."""
        with self._lock:
            if self._token is None or self._clock() >= self._expires_s - RENEW_BEFORE_S:
                return None
            return self._token

    def request(self) -> hastream_pb2.LoginRequest:
        return hastream_pb2.LoginRequest(userid=self.userid, password=self._password)

    def accept(self, reply: hastream_pb2.LoginResponse) -> str:
        """Keep the token of a successful login; returns it."""
        # authentication=off answers an empty token that never expires.
        expires_s = reply.expires_ms / 1000 if reply.token else float("inf")
        with self._lock:
            self._token = reply.token
            self._expires_s = expires_s
        return str(reply.token)

    def log_in(self, channel: grpc.Channel) -> str:
        """Log in over `channel` (one not wrapped by a TokenInterceptor). Raises the call's
        grpc.RpcError (typed by the caller's transport)."""
        stub = hastream_pb2_grpc.StreamTableStub(channel)
        return self.accept(stub.Login(self.request(), timeout=LOGIN_TIMEOUT_S))

    def forget(self) -> None:
        """Drop the token (after the cluster refused it), so the next call logs in."""
        with self._lock:
            self._token = None

    def __repr__(self) -> str:
        return f"Login(userid={self.userid!r})"


class _Details(  # grpc has no type stubs: its bases are Any
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,  # type: ignore[misc]
):
    """A call's details with the token added (gRPC's documented way to change them)."""


class TokenInterceptor(  # grpc has no type stubs: its bases are Any
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds the login token to every call on one channel (see the module docstring)."""

    def __init__(self, login: Login, raw_channel: grpc.Channel) -> None:
        self._login = login
        self._raw_channel = raw_channel

    def _with_token(self, details: Any) -> Any:
        if details.method == _LOGIN_METHOD:
            return details
        token = self._login.token()
        if token is None:
            token = self._login.log_in(self._raw_channel)
        if not token:  # authentication=off
            return details
        metadata = [*(details.metadata or ()), (TOKEN_METADATA_KEY, token)]
        return _Details(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)
