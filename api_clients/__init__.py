"""The Python client of the HA stream table cluster.

    from api_clients import connect, Publisher, MultithreadedTableWriter
    session = connect("127.0.0.1", 8901, highAvailabilitySites=["127.0.0.1:8902", "127.0.0.1:8903"])
    Publisher(session, "ticks").append(frame)
    writer = MultithreadedTableWriter(session, "ticks", batchSize=10_000, threadCount=2)
    writer.insert(1, ts, "AAPL", 10.5); writer.waitForThreadCompletion()
    session.subscribe("ticks", handler, offset=-2, actionName="spark")
    session.read("ticks", 0, 1000)  # rows [0, 1000) as one pyarrow Table

Errors are the classes the nodes raise (`hastream.errors`, shared by both sides), rebuilt
from the gRPC trailing metadata and re-exported here, plus the client's own: the transport
errors of `api_clients.transport` (a failure without a typed error from the node),
`PublishAborted`, `PipelineClosed` and `WriterStopped`.
See docs/client.md for the delivery guarantees and the durable buffer.
"""

# First, before any module of the client imports grpc: gRPC's polling engine (see there).
import hastream.grpc_engine  # noqa: F401

# isort: split
from api_clients.buffer import BufferStats, DurableBuffer
from api_clients.connection import Session, connect, parse_site
from api_clients.pipeline import PipelineClosed, PublishAborted, PublishPipeline
from api_clients.publisher import Publisher
from api_clients.retry import Backoff
from api_clients.subscriber import Subscription
from api_clients.transport import (
    DeadlineExceeded,
    RpcFailed,
    SiteUnavailable,
    StreamBroken,
    StreamIdle,
    TransportError,
)
from api_clients.types import AppendResult, OffsetForTime, TableInfo
from api_clients.writer import (
    MultithreadedTableWriter,
    ThreadStatus,
    WriterStatus,
    WriterStopped,
)
from hastream import __version__, errors
from hastream.errors import (
    BatchTooLarge,
    CorruptionError,
    EmptyBatch,
    InvalidArgument,
    LeadershipLost,
    NodeUnavailable,
    NotLeader,
    OffsetOutOfRange,
    Overloaded,
    PermissionDenied,
    ProposalTimeout,
    RaftStoreError,
    SchemaMismatch,
    SequenceGap,
    SlowConsumer,
    TableExists,
    TableNotFound,
    TableSubscribed,
    TopicNotFound,
    Unauthenticated,
    UnknownGroup,
    UserExists,
    UserNotFound,
)

__all__ = [
    "AppendResult",
    "Backoff",
    "BatchTooLarge",
    "BufferStats",
    "CorruptionError",
    "DeadlineExceeded",
    "DurableBuffer",
    "EmptyBatch",
    "InvalidArgument",
    "LeadershipLost",
    "MultithreadedTableWriter",
    "NodeUnavailable",
    "NotLeader",
    "OffsetForTime",
    "OffsetOutOfRange",
    "Overloaded",
    "PermissionDenied",
    "PipelineClosed",
    "ProposalTimeout",
    "PublishAborted",
    "PublishPipeline",
    "Publisher",
    "RaftStoreError",
    "RpcFailed",
    "SchemaMismatch",
    "SequenceGap",
    "Session",
    "SiteUnavailable",
    "SlowConsumer",
    "StreamBroken",
    "StreamIdle",
    "Subscription",
    "TableExists",
    "TableInfo",
    "TableNotFound",
    "TableSubscribed",
    "ThreadStatus",
    "TopicNotFound",
    "TransportError",
    "Unauthenticated",
    "UnknownGroup",
    "UserExists",
    "UserNotFound",
    "WriterStatus",
    "WriterStopped",
    "__version__",
    "connect",
    "errors",
    "parse_site",
]
