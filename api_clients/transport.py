"""The client's gRPC boundary: every failed call becomes a typed error here, once.

A failed RPC carries either the node's own typed error in its trailing metadata (rebuilt by
`hastream.errors.from_wire`: NotLeader, TableNotFound, ProposalTimeout...) or a bare gRPC
status from the transport or from gRPC itself. A bare status becomes one of the transport
errors below, with the site and what the status said:

| gRPC status (no typed error) | error | retryable |
|---|---|---|
| UNAVAILABLE, CANCELLED | `SiteUnavailable(site, code, details)` | yes: another site may answer |
| DEADLINE_EXCEEDED | `DeadlineExceeded(site, timeout_s)` | yes, and the outcome is unknown |
| RESOURCE_EXHAUSTED "slow consumer: ..." | `SlowConsumer(reason)` | yes: resubscribe |
| RESOURCE_EXHAUSTED, gRPC's refusal past `wire.NODE_CALLS_MAX` calls | `Overloaded` | yes: busy |
| any other | `RpcFailed(site, code, details)` | no: a bug or a refusal, shown as it is |

Streams add two failures of their own: `StreamBroken(site, detail)` (a stream that ended or
answered out of order before it delivered what was asked) and `StreamIdle(site, silent_s,
timeout_s)` (a subscription that heard nothing, not even the leader's heartbeat). The client
itself ends an attempt with `Unresponsive(site, waited_s, leader)` when it left a silent
site for the leader the other sites agree on (`call_policy.hedge`).

Nothing past this module looks at a gRPC status code or a status text: `Session.call`,
`Session.open_stream` and the `Stream`s it returns raise these types. `NodeUnavailable`
stays what the node says about itself (starting, catching up, shutting down).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from hastream import errors, wire
from hastream.errors import Overloaded, RaftStoreError, SlowConsumer

# Transport failures after which another site may answer.
_UNAVAILABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class TransportError(RaftStoreError):
    """A call to `site` ended without the node's answer or typed error."""

    def __init__(self, site: str, message: str) -> None:
        self.site = site
        super().__init__(f"{site}: {message}")


class SiteUnavailable(TransportError):
    """`site` could not be reached or dropped the call (connection refused or reset, an
    unanswered keepalive ping, the server cancelled the stream). `code` is the gRPC status
    name. Another site may answer."""

    retryable = True

    def __init__(self, site: str, code: str, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(site, f"unavailable ({code}): {details}")

    def fields(self) -> dict[str, Any]:
        return {"site": self.site, "code": self.code, "details": self.details}


def never_connected(error: SiteUnavailable) -> bool:
    """True when gRPC could not connect to the site at all (refused, timed out, a handshake
    that failed), rather than losing a call on a connection it had."""
    return error.code == "UNAVAILABLE" and "failed to connect" in error.details.lower()


def with_tls_hint(error: SiteUnavailable, tls: bool) -> SiteUnavailable:
    """`error` with what a failed connection most likely means for TLS, when its details
    show the handshake failed (gRPC only says "Socket closed" when a node refuses a
    plaintext client, or a TLS client without the certificate it requires)."""
    details = error.details
    if "WRONG_VERSION_NUMBER" in details:
        hint = "the node does not speak TLS: connect without tls/caFile"
    elif "handshake failed" in details.lower():
        hint = "the node's TLS certificate was refused: is caFile the CA that signed it?"
    elif "Socket closed" not in details:
        return error
    elif tls:
        hint = (
            "the node closed the TLS handshake: with tlsClientAuth=require it needs a client "
            "certificate signed by its CA (certFile/keyFile)"
        )
    else:
        hint = "the node closed the connection: if it has TLS on, connect with tls=True/caFile"
    return SiteUnavailable(error.site, error.code, f"{details} [{hint}]")


class DeadlineExceeded(TransportError):
    """One attempt on `site` got no answer within `timeout_s` (None: the stream had no
    deadline). The request may have been applied: its outcome is unknown."""

    retryable = True

    def __init__(self, site: str, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        limit = "its deadline" if timeout_s is None else f"{timeout_s:.3f}s"
        super().__init__(site, f"no answer within {limit}; outcome unknown")

    def fields(self) -> dict[str, Any]:
        return {"site": self.site, "timeout_s": self.timeout_s}


class RpcFailed(TransportError):
    """Any other gRPC status without a typed error from the node: an unimplemented method, a
    message over the size limit, a bug on either side. Not retried."""

    def __init__(self, site: str, code: str, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(site, f"call failed ({code}): {details}")

    def fields(self) -> dict[str, Any]:
        return {"site": self.site, "code": self.code, "details": self.details}


class StreamBroken(TransportError):
    """A stream from `site` ended, or answered out of order, before it delivered what was
    asked (a read short of its range, a publish stream with requests unanswered)."""

    retryable = True

    def __init__(self, site: str, detail: str) -> None:
        self.detail = detail
        super().__init__(site, f"stream broken: {detail}")

    def fields(self) -> dict[str, Any]:
        return {"site": self.site, "detail": self.detail}


class StreamIdle(TransportError):
    """A subscription stream from `site` carried no message, not even the leader's
    heartbeat, for `silent_s` > `timeout_s`: the node is frozen, cut off or overloaded."""

    retryable = True

    def __init__(self, site: str, silent_s: float, timeout_s: float) -> None:
        self.silent_s = silent_s
        self.timeout_s = timeout_s
        super().__init__(site, f"no message for {silent_s:.1f}s (> {timeout_s:.1f}s)")

    def fields(self) -> dict[str, Any]:
        return {"site": self.site, "silent_s": self.silent_s, "timeout_s": self.timeout_s}


class Unresponsive(TransportError):
    """An attempt (or stream) on `site` had no answer for `waited_s` while the other sites
    agreed that `leader` (host:port) leads: the client cancelled it to resend the request
    there. The node may still apply it: its outcome is unknown, so only idempotent requests
    are left this way (`call_policy.hedgeable`)."""

    retryable = True

    def __init__(self, site: str, waited_s: float, leader: str) -> None:
        self.waited_s = waited_s
        self.leader = leader
        super().__init__(site, f"no answer for {waited_s:.2f}s; the other sites name {leader}")

    def fields(self) -> dict[str, Any]:
        return {"site": self.site, "waited_s": self.waited_s, "leader": self.leader}


def typed_error(rpc_error: grpc.RpcError, site: str, timeout_s: float | None) -> RaftStoreError:
    """The node's typed error carried by `rpc_error`, else the transport error its status
    means (see the module docstring). `timeout_s` is the attempt's deadline."""
    call: Any = rpc_error  # A raised RpcError is also the grpc.Call.
    metadata = call.trailing_metadata() if hasattr(call, "trailing_metadata") else None
    typed = errors.from_wire(
        {key: value for key, value in metadata or () if isinstance(value, str)}
    )
    if typed is not None:
        return typed
    code = call.code() if hasattr(call, "code") else None
    details = str((call.details() if hasattr(call, "details") else None) or "")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(site, timeout_s)
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(
        wire.SLOW_CONSUMER_DETAILS_PREFIX
    ):
        return SlowConsumer(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details == wire.NODE_CALLS_REFUSED_DETAILS:
        # gRPC refused the call before the node saw it: the node runs NODE_CALLS_MAX calls
        # already. Busy, not gone, so the call policy retries the same site after a backoff.
        return Overloaded(f"gRPC calls at {site}", wire.NODE_CALLS_MAX)
    if code in _UNAVAILABLE_CODES:
        return SiteUnavailable(site, name, details)
    return RpcFailed(site, name, details)


def unary(stub: Any, method_name: str, request: Any, site: str, timeout_s: float) -> Any:
    """Calls the unary RPC `method_name` of `stub` (a channel to `site`); raises typed. A
    call on a channel closed meanwhile (the session left a silent site, or closed) fails
    `SiteUnavailable` with code CANCELLED, as a call in flight on it does."""
    try:
        method = getattr(stub, method_name)
        return method(request, timeout=timeout_s)
    except grpc.RpcError as rpc_error:
        raise typed_error(rpc_error, site, timeout_s) from None
    except ValueError as closed:  # grpc: "Cannot invoke RPC on closed channel!"
        raise SiteUnavailable(site, "CANCELLED", str(closed)) from None


def when_done(future: Any, callback: Callable[[Any], None]) -> None:
    """Runs `callback(answer or None)` once the unary future ends (None: it failed)."""

    def done(ended: Any) -> None:
        try:
            answer = ended.result()
        except (grpc.RpcError, grpc.FutureCancelledError):
            answer = None
        callback(answer)

    future.add_done_callback(done)


class Stream:
    """A streaming call on one site. Iterating it yields the responses and raises a failure
    typed; `cancel()` (from any thread) ends it."""

    def __init__(self, call: Any, site: str, timeout_s: float | None) -> None:
        self._call = call
        self.site = site
        self._timeout_s = timeout_s

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self._call
        except grpc.RpcError as rpc_error:
            raise typed_error(rpc_error, self.site, self._timeout_s) from None

    def cancel(self) -> None:
        self._call.cancel()

    def when_ended(self, callback: Callable[[], None]) -> None:
        """Runs `callback()` once the call has ended (at once if it has), on gRPC's thread."""
        if not self._call.add_callback(callback):
            callback()


def open_stream(
    stub: Any, method_name: str, request: Any, site: str, timeout_s: float | None
) -> Stream:
    """Starts the streaming RPC `method_name` of `stub` (a channel to `site`); `request` is
    one message, or an iterator of them for a bidirectional call."""
    try:
        call = getattr(stub, method_name)(request, timeout=timeout_s)
    except ValueError as closed:  # grpc: "Cannot invoke RPC on closed channel!"
        raise SiteUnavailable(site, "CANCELLED", str(closed)) from None
    return Stream(call, site, timeout_s)
