"""raftstore/grpc_unary.py: a unary call answers as with grpc's own path, on a real server.

Each behaviour runs on both paths (grpc's own, and with the request taken in by the serving
thread) against a real in-process gRPC server on a free loopback port, called through a
real channel: same answers, same status codes, and the server's count of active calls
(maximum_concurrent_rpcs) goes back down when a call ends, however it ends.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc import _server

from raftstore import grpc_unary

SERVICE = "test.Unary"


def _deserialize(data: bytes) -> bytes:
    if data.startswith(b"garbage"):
        raise ValueError("not a request")
    return data


class _Handlers:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.pending: list[futures.Future[bytes]] = []
        self.answered_on: list[str] = []

    def echo(self, request: bytes, context: Any) -> bytes:
        return request

    def fail(self, request: bytes, context: Any) -> bytes:
        raise RuntimeError("handler failed")

    def abort(self, request: bytes, context: Any) -> bytes:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused: " + request.decode())
        raise AssertionError("abort returns by raising")

    def block(self, request: bytes, context: Any) -> bytes:
        self.entered.set()
        assert self.release.wait(30), "the test never released the handler"
        return request

    def later(self, request: bytes, context: Any) -> grpc_unary.Deferred:
        """Answered by whoever completes the handler's future (the test), as the node's
        Publish is by the Raft thread that applies its entry."""
        future: futures.Future[bytes] = futures.Future()
        self.pending.append(future)
        self.entered.set()

        def answer() -> bytes:
            self.answered_on.append(threading.current_thread().name)
            outcome = future.result()
            if outcome == b"abort":
                context.set_trailing_metadata((("why", "deferred"),))
                context.abort(grpc.StatusCode.ABORTED, "deferred refusal")
            if outcome == b"raise":
                raise RuntimeError("answer failed")
            return outcome

        if request == b"done":
            future.set_result(b"at once")
        return grpc_unary.Deferred(future, answer)


@pytest.fixture(params=["grpc", "serving-thread"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "grpc":
        grpc_unary.uninstall()
    else:
        assert grpc_unary.install()
    try:
        yield request.param
    finally:
        assert grpc_unary.install()  # the node's path for the tests that follow


@contextlib.contextmanager
def _serving() -> Iterator[tuple[_Handlers, grpc.Channel]]:
    handlers = _Handlers()
    methods = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(handlers, name), request_deserializer=_deserialize
        )
        for name in ("echo", "fail", "abort", "block", "later")
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), maximum_concurrent_rpcs=1)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield handlers, channel
    finally:
        handlers.release.set()
        channel.close()
        server.stop(None).wait(10)


@pytest.fixture
def served(path: str) -> Iterator[tuple[_Handlers, grpc.Channel]]:
    with _serving() as serving:
        yield serving


@pytest.fixture
def deferring() -> Iterator[tuple[_Handlers, grpc.Channel]]:
    """A server on the serving-thread path, the one that takes Deferred answers."""
    assert grpc_unary.install()
    assert grpc_unary.defers()
    with _serving() as serving:
        yield serving


def _call(channel: grpc.Channel, method: str, payload: bytes, timeout: float = 10.0) -> bytes:
    answer: bytes = channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=timeout)
    return answer


def _code(channel: grpc.Channel, method: str, payload: bytes, timeout: float = 10.0) -> Any:
    with pytest.raises(grpc.RpcError) as raised:
        _call(channel, method, payload, timeout)
    return raised.value.code(), raised.value.details()


def test_a_request_is_answered(served: tuple[_Handlers, grpc.Channel]) -> None:
    _, channel = served
    for size in (0, 1, 100_000):
        assert _once_accepted(channel, "echo", b"r" * size) == b"r" * size


def test_errors_keep_their_status(served: tuple[_Handlers, grpc.Channel]) -> None:
    _, channel = served
    # maximum_concurrent_rpcs=1: each call waits until the server counts the last one ended
    assert _once_accepted(channel, "fail", b"x")[0] == grpc.StatusCode.UNKNOWN
    assert _once_accepted(channel, "abort", b"x") == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "refused: x",
    )
    assert _once_accepted(channel, "echo", b"garbage")[0] == grpc.StatusCode.INTERNAL
    assert _once_accepted(channel, "echo", b"after") == b"after"  # the server still serves


def _once_accepted(
    channel: grpc.Channel, method: str, payload: bytes, timeout: float = 10.0
) -> Any:
    """The answer (bytes) or (code, details), once the server accepts the call: a call that
    just ended counts as active until its handler's future is done, a moment after the
    client has the answer. Polls until a deadline."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return _call(channel, method, payload, timeout)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                return error.code(), error.details()
            assert time.monotonic() < deadline, "the server never took a call again"


def test_the_active_call_count_goes_down_however_a_call_ends(
    served: tuple[_Handlers, grpc.Channel],
) -> None:
    """maximum_concurrent_rpcs=1: a call is refused while another is active, and accepted
    again once it ended (answered, failed, aborted, refused as garbage, past its deadline)."""
    handlers, channel = served
    blocked = channel.unary_unary(f"/{SERVICE}/block").future(b"held", timeout=30)
    assert handlers.entered.wait(10)
    assert _code(channel, "echo", b"x")[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    handlers.release.set()
    assert blocked.result() == b"held"
    assert _once_accepted(channel, "fail", b"x")[0] == grpc.StatusCode.UNKNOWN
    assert _once_accepted(channel, "echo", b"garbage")[0] == grpc.StatusCode.INTERNAL
    assert _once_accepted(channel, "abort", b"x")[0] == grpc.StatusCode.FAILED_PRECONDITION
    handlers.release.clear()
    late = _once_accepted(channel, "block", b"late", timeout=0.5)
    assert late[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    handlers.release.set()  # the handler returns into a call that has ended
    assert _once_accepted(channel, "echo", b"again") == b"again"


def _complete_later(handlers: _Handlers, outcome: bytes) -> threading.Thread:
    """Completes the next deferred call's future from a thread of its own."""

    def complete() -> None:
        assert handlers.entered.wait(10)
        handlers.pending[-1].set_result(outcome)

    thread = threading.Thread(target=complete, name="completer")
    thread.start()
    return thread


def test_a_deferred_answer_leaves_from_the_thread_that_completes_it(
    deferring: tuple[_Handlers, grpc.Channel],
) -> None:
    handlers, channel = deferring
    completer = _complete_later(handlers, b"committed")
    assert _call(channel, "later", b"x") == b"committed"
    completer.join()
    assert handlers.answered_on == ["completer"]
    assert _once_accepted(channel, "later", b"done") == b"at once"  # done before returned


def test_a_deferred_answer_keeps_statuses(deferring: tuple[_Handlers, grpc.Channel]) -> None:
    handlers, channel = deferring
    _complete_later(handlers, b"abort")
    with pytest.raises(grpc.RpcError) as raised:
        _call(channel, "later", b"x")
    assert raised.value.code() == grpc.StatusCode.ABORTED
    assert raised.value.details() == "deferred refusal"
    assert ("why", "deferred") in tuple(raised.value.trailing_metadata())
    handlers.entered.clear()
    _complete_later(handlers, b"raise")
    assert _once_accepted(channel, "later", b"x")[0] == grpc.StatusCode.UNKNOWN


def test_a_deferred_call_counts_as_active_until_its_future_completes(
    deferring: tuple[_Handlers, grpc.Channel],
) -> None:
    """The client gives up first (its deadline); the call stays active (the server's count
    for maximum_concurrent_rpcs=1) until the future completes, and its answer is dropped."""
    handlers, channel = deferring
    late = _once_accepted(channel, "later", b"x", timeout=0.5)
    assert late[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _code(channel, "echo", b"x")[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    handlers.pending[-1].set_result(b"too late")
    assert _once_accepted(channel, "echo", b"again") == b"again"


def test_install_takes_only_the_grpc_it_was_written_for() -> None:
    grpc_unary.uninstall()
    try:
        assert not grpc_unary.supported("1.99.0")
        assert not grpc_unary.install("1.99.0")
        assert _server._handle_unary_unary is not grpc_unary._handle_unary_unary
    finally:
        assert grpc_unary.install()
    assert grpc_unary.supported()
    assert _server._handle_unary_unary is grpc_unary._handle_unary_unary
    assert grpc_unary.install()  # idempotent
