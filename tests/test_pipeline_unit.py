"""Pipelined publishing without a cluster: the SequenceGap error on the wire, the client's
refusals before any network call."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from api_clients import Publisher, PublishPipeline, Session
from raftstore import errors, limits
from raftstore.errors import InvalidArgument, SequenceGap

SCHEMA = pa.schema([("id", pa.int64())])


@pytest.mark.unit
def test_sequence_gap_round_trips_the_wire_with_its_fields() -> None:
    error = SequenceGap("ab" * 16, 7, 9)
    rebuilt = errors.from_wire(dict(errors.to_wire(error)))
    assert isinstance(rebuilt, SequenceGap)
    assert (rebuilt.producer, rebuilt.expected, rebuilt.got) == ("ab" * 16, 7, 9)
    assert str(rebuilt) == str(error)
    assert not rebuilt.retryable
    assert rebuilt.grpc_code == "FAILED_PRECONDITION"


@pytest.fixture
def session() -> Session:
    return Session(["127.0.0.1:1"])  # never dialled: everything here fails before


@pytest.mark.unit
def test_pipelining_is_refused_with_a_durable_buffer(session: Session, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="durable buffer"):
        Publisher(session, "t", durable_buffer_dir=tmp_path / "a", max_in_flight=8)
    publisher = Publisher(session, "t", durable_buffer_dir=tmp_path / "b", schema=SCHEMA)
    try:
        with pytest.raises(InvalidArgument, match="durable buffer"):
            publisher.append_async(pa.table({"id": [1]}, schema=SCHEMA))
    finally:
        publisher.close()


@pytest.mark.unit
@pytest.mark.parametrize("window", [0, limits.PIPELINE_IN_FLIGHT_MAX + 1])
def test_window_outside_the_servers_bound_is_refused(session: Session, window: int) -> None:
    with pytest.raises(InvalidArgument, match="max_in_flight"):
        PublishPipeline(session, "t", max_in_flight=window)


@pytest.mark.unit
def test_bad_rows_are_refused_by_append_async_before_anything_is_queued(
    session: Session,
) -> None:
    publisher = Publisher(session, "t", schema=SCHEMA)
    with pytest.raises(errors.SchemaMismatch):
        publisher.append_async(pa.table({"id": pa.array([1], pa.int32())}))
    with pytest.raises(errors.EmptyBatch):
        publisher.append_async(SCHEMA.empty_table())
    assert publisher.pipeline_stats() is None
