"""`api_clients.transport`: a failed gRPC call becomes one typed error, with its fields."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from api_clients.transport import (
    DeadlineExceeded,
    RpcFailed,
    SiteUnavailable,
    Stream,
    open_stream,
    typed_error,
    unary,
)
from hastream import errors
from proto import hastream_pb2, hastream_pb2_grpc

pytestmark = pytest.mark.unit

SITE = "10.0.0.1:8901"


class FailedCall(grpc.RpcError):
    """What grpc raises: an RpcError that is also the call, with status and metadata."""

    def __init__(self, code: grpc.StatusCode, details: str | None = "", metadata: Any = ()) -> None:
        self._code = code
        self._details = details
        self._metadata = metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._metadata


@pytest.mark.parametrize(
    ("code", "expected", "retryable"),
    [
        (grpc.StatusCode.UNAVAILABLE, SiteUnavailable, True),
        (grpc.StatusCode.CANCELLED, SiteUnavailable, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded, True),
        (grpc.StatusCode.INTERNAL, RpcFailed, False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, RpcFailed, False),
        (grpc.StatusCode.UNIMPLEMENTED, RpcFailed, False),
    ],
)
def test_a_bare_status_becomes_a_transport_error(
    code: grpc.StatusCode, expected: type[errors.RaftStoreError], retryable: bool
) -> None:
    error = typed_error(FailedCall(code, "details here"), SITE, 2.5)
    assert type(error) is expected
    assert error.retryable is retryable
    assert error.fields()["site"] == SITE


def test_transport_errors_carry_what_the_status_said() -> None:
    unavailable = typed_error(FailedCall(grpc.StatusCode.UNAVAILABLE, "refused"), SITE, 1.0)
    assert isinstance(unavailable, SiteUnavailable)
    assert (unavailable.site, unavailable.code, unavailable.details) == (
        SITE,
        "UNAVAILABLE",
        "refused",
    )
    late = typed_error(FailedCall(grpc.StatusCode.DEADLINE_EXCEEDED, None), SITE, 2.5)
    assert isinstance(late, DeadlineExceeded)
    assert (late.site, late.timeout_s) == (SITE, 2.5)
    failed = typed_error(FailedCall(grpc.StatusCode.INTERNAL, None), SITE, 1.0)
    assert isinstance(failed, RpcFailed)
    assert (failed.code, failed.details) == ("INTERNAL", "")


def test_the_nodes_typed_error_wins_over_its_status() -> None:
    metadata = errors.to_wire(errors.ProposalTimeout(10.0))
    error = typed_error(FailedCall(grpc.StatusCode.DEADLINE_EXCEEDED, "", metadata), SITE, 15.0)
    assert isinstance(error, errors.ProposalTimeout)
    assert error.timeout_s == 10.0
    leader = "10.0.0.2:8902:node2"
    metadata = errors.to_wire(errors.NotLeader(leader, 2))
    error = typed_error(FailedCall(grpc.StatusCode.FAILED_PRECONDITION, "", metadata), SITE, 1.0)
    assert isinstance(error, errors.NotLeader)
    assert (error.leader, error.group_id) == (leader, 2)


def test_unary_and_stream_raise_typed() -> None:
    class Stub:
        def Fails(self, request: object, timeout: float | None) -> object:
            raise FailedCall(grpc.StatusCode.UNAVAILABLE, "reset")

    with pytest.raises(SiteUnavailable):
        unary(Stub(), "Fails", object(), SITE, 1.0)

    class Call:
        cancelled = False

        def __iter__(self) -> Iterator[int]:
            yield 1
            raise FailedCall(grpc.StatusCode.DEADLINE_EXCEEDED)

        def cancel(self) -> None:
            self.cancelled = True

    call = Call()
    stream = Stream(call, SITE, 3.0)
    received: list[int] = []
    with pytest.raises(DeadlineExceeded) as raised:
        received.extend(stream)
    assert received == [1]
    assert raised.value.timeout_s == 3.0
    stream.cancel()
    assert call.cancelled


def test_a_call_on_a_closed_channel_is_a_cancelled_site_not_a_value_error() -> None:
    """The session closes a silent site's channel; a call that took its stub just before
    fails like one in flight on it did."""
    channel = grpc.insecure_channel(SITE)
    stub = hastream_pb2_grpc.StreamTableStub(channel)
    channel.close()
    for call in (
        lambda: unary(stub, "Publish", hastream_pb2.PublishRequest(), SITE, 1.0),
        lambda: open_stream(stub, "Subscribe", hastream_pb2.SubscribeRequest(), SITE, 1.0),
    ):
        with pytest.raises(SiteUnavailable) as failure:
            call()
        assert failure.value.code == "CANCELLED"
        assert failure.value.retryable
