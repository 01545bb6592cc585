"""Unary calls on the node's gRPC server: the request taken in by the serving thread, and
answers that may come later, from the thread that has them.

grpcio's sync server hands a unary-unary call to a pool worker as soon as the call arrives.
The worker starts receiving the request message, then waits on the call's condition until
the serving thread (the one polling the completion queue) delivers it: the serving thread
wakes the worker twice before the handler runs. With `install()`, the serving thread starts
the receive itself and submits the handler to the pool only once the message is in, so it
wakes the worker once; a worker is no longer held by a client slow to send its request.

A handler may also return `Deferred` (a future and a function that makes the answer from
it): the worker is done at once, and the answer leaves from the thread that completes the
future. The node's Publish does this: the Raft tick thread that applies the entry sends the
answer itself, instead of waking a worker that waits for the commit and then competes with
that thread for the GIL to send it.

Everything else is grpc's own code, called as grpc calls it: `_receive_message` keeps the
call's bookkeeping (the request, a client that closed, a request that does not
deserialize), `_call_behavior` runs the handler (its exceptions and `context.abort` become
statuses), `_serialize_response` and `_status` send the answer.

Measured here (2 cores, grpcio 1.85.3):
- an echo unary call of 1,400 bytes, server in its own process, 6 interleaved rounds of
  3,000 calls: p50 537 -> 448 us, server CPU per call 374 -> 323 us;
- a three-node cluster, waited one-row publishes (`bench.checkouts_ab`, 8 rounds each):
  the request on the serving thread, rows/s x1.03, node CPU per row x0.96, context switches
  per append x0.84; the deferred answer on top, x1.04, x0.98 and x0.90.

This replaces a private function of grpc's `_server` module, so it applies only to the
grpcio versions in SUPPORTED_VERSIONS and only when every private name it relies on is
there; otherwise grpc's own path stays (logged once), handlers are not offered deferral
(`defers()`), and nothing else changes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Final

import grpc
from grpc import _server
from grpc._cython import cygrpc

log = logging.getLogger(__name__)

# The grpcio versions whose _server this was read against (major.minor).
SUPPORTED_VERSIONS: Final = ("1.85",)
_PRIVATE_NAMES: Final = (
    "_handle_unary_unary",
    "_receive_message",
    "_call_behavior",
    "_serialize_response",
    "_status",
    "_select_thread_pool_for_behavior",
    "_is_rpc_state_active",
    "_abort",
    "_CLOSED",
    "_EMPTY_FLAGS",
    "_RECEIVE_MESSAGE_TOKEN",
)

_install_lock = threading.Lock()
_grpc_handle_unary_unary = getattr(_server, "_handle_unary_unary", None)


def supported(version: str = grpc.__version__) -> bool:
    """True if this grpcio's server code is the one `install` was written against."""
    major_minor = ".".join(version.split(".")[:2])
    return major_minor in SUPPORTED_VERSIONS and all(
        hasattr(_server, name) for name in _PRIVATE_NAMES
    )


def install(version: str = grpc.__version__) -> bool:
    """Take unary requests in on the serving thread (process-wide, idempotent). False, with
    grpc's own path kept, on a grpcio this was not written against."""
    with _install_lock:
        if _server._handle_unary_unary is _handle_unary_unary:
            return True
        if not supported(version):
            log.info("grpcio %s: unary requests are received by grpc's own path", version)
            return False
        _server._handle_unary_unary = _handle_unary_unary
        return True


def uninstall() -> None:
    """grpc's own path again (for tests that compare the two)."""
    with _install_lock:
        if _grpc_handle_unary_unary is not None:
            _server._handle_unary_unary = _grpc_handle_unary_unary


def defers() -> bool:
    """True if a unary handler may return `Deferred` (this module's path is installed)."""
    return _server._handle_unary_unary is _handle_unary_unary


@dataclass(frozen=True, slots=True)
class Deferred:
    """A unary handler's answer to come: once `future` is done, `answer()` runs on the
    thread that completed it (at once if it is done already) and returns the response, or
    raises as a handler does (`context.abort` included). The call's worker is free
    meanwhile, and the answer leaves without waking it. `future` must complete: the call
    counts as active (maximum_concurrent_rpcs) until it does."""

    future: futures.Future[Any]
    answer: Callable[[], Any]


def _handle_unary_unary(
    rpc_event: Any,
    state: Any,
    method_handler: grpc.RpcMethodHandler,
    default_thread_pool: futures.ThreadPoolExecutor,
) -> futures.Future[None]:
    """grpc's `_handle_unary_unary`, run by the serving thread with the call's condition
    held: returns a future that ends with the call's handling (the server counts the call
    active until then, for `maximum_concurrent_rpcs`)."""
    behavior = method_handler.unary_unary
    thread_pool = _server._select_thread_pool_for_behavior(behavior, default_thread_pool)
    handled: futures.Future[None] = futures.Future()
    handled.set_running_or_notify_cancel()
    keep_request = _server._receive_message(
        state, rpc_event.call, method_handler.request_deserializer
    )

    def take_request() -> Any:
        """What grpc's `unary_request` does once woken: the request, or None when the call
        ends without one (answered here when the client sent none)."""
        with state.condition:
            request, state.request = state.request, None
            if request is None and state.client is _server._CLOSED:
                _server._abort(
                    state,
                    rpc_event.call,
                    cygrpc.StatusCode.unimplemented,
                    b"a unary call requires exactly one request message",
                )
            return request if _server._is_rpc_state_active(state) else None

    def send(response: Any) -> None:
        serialized = _server._serialize_response(
            rpc_event, state, response, method_handler.response_serializer
        )
        if serialized is not None:
            _server._status(rpc_event, state, serialized)

    def complete(deferred: Deferred) -> None:
        """On the thread that completed `deferred.future`: answer the call as grpc answers
        a handler's return or exception."""
        try:
            response = deferred.answer()
        except Exception as exception:
            if not state.aborted:
                log.exception("deferred answer failed")
            with state.condition:
                details = (
                    b"RPC Aborted"
                    if state.aborted
                    else f"Exception calling application: {exception}".encode()
                )
                _server._abort(state, rpc_event.call, cygrpc.StatusCode.unknown, details)
        else:
            send(response)
        finally:
            handled.set_result(None)

    def respond() -> None:
        """grpc's `_unary_response_in_pool`, except that a handler may return `Deferred`."""
        deferred: Deferred | None = None
        cygrpc.install_context_from_request_call_event(rpc_event)
        try:
            request = take_request()
            if request is None:
                return
            response, proceed = _server._call_behavior(
                rpc_event, state, behavior, request, method_handler.request_deserializer
            )
            if not proceed:
                return
            if isinstance(response, Deferred):
                deferred = response
                return
            send(response)
        except Exception:
            log.exception("unary call failed")
        finally:
            cygrpc.uninstall_context()
            if deferred is None:
                handled.set_result(None)
            else:
                # At once if it is done already; else on the thread that completes it.
                deferred.future.add_done_callback(lambda _: complete(deferred))

    def received(event: Any) -> Any:
        # On the serving thread: grpc's bookkeeping first, then the handler on a worker.
        finished = keep_request(event)
        try:
            thread_pool.submit(state.context.run, respond)
        except RuntimeError:  # the pool is shut down: the server is stopping
            handled.set_result(None)
        return finished

    rpc_event.call.start_server_batch(
        (cygrpc.ReceiveMessageOperation(_server._EMPTY_FLAGS),), received
    )
    state.due.add(_server._RECEIVE_MESSAGE_TOKEN)
    return handled
