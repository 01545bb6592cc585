from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateTableRequest(_message.Message):
    __slots__ = ("raft_group", "table", "schema_ipc", "cache_limit", "key_column", "retention_minutes")
    RAFT_GROUP_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_IPC_FIELD_NUMBER: _ClassVar[int]
    CACHE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    KEY_COLUMN_FIELD_NUMBER: _ClassVar[int]
    RETENTION_MINUTES_FIELD_NUMBER: _ClassVar[int]
    raft_group: int
    table: str
    schema_ipc: bytes
    cache_limit: int
    key_column: str
    retention_minutes: int
    def __init__(self, raft_group: _Optional[int] = ..., table: _Optional[str] = ..., schema_ipc: _Optional[bytes] = ..., cache_limit: _Optional[int] = ..., key_column: _Optional[str] = ..., retention_minutes: _Optional[int] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("table", "raft_group", "schema_ipc", "cache_limit", "key_column", "retention_minutes", "row_count", "earliest_offset")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    RAFT_GROUP_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_IPC_FIELD_NUMBER: _ClassVar[int]
    CACHE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    KEY_COLUMN_FIELD_NUMBER: _ClassVar[int]
    RETENTION_MINUTES_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    EARLIEST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    table: str
    raft_group: int
    schema_ipc: bytes
    cache_limit: int
    key_column: str
    retention_minutes: int
    row_count: int
    earliest_offset: int
    def __init__(self, table: _Optional[str] = ..., raft_group: _Optional[int] = ..., schema_ipc: _Optional[bytes] = ..., cache_limit: _Optional[int] = ..., key_column: _Optional[str] = ..., retention_minutes: _Optional[int] = ..., row_count: _Optional[int] = ..., earliest_offset: _Optional[int] = ...) -> None: ...

class DropTableRequest(_message.Message):
    __slots__ = ("table", "force")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    table: str
    force: bool
    def __init__(self, table: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DropTableResponse(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class TableRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("table", "payload", "producer_id", "sequence")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    table: str
    payload: bytes
    producer_id: bytes
    sequence: int
    def __init__(self, table: _Optional[str] = ..., payload: _Optional[bytes] = ..., producer_id: _Optional[bytes] = ..., sequence: _Optional[int] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("first_offset", "row_count", "duplicates", "lsn", "duplicate_batch", "sequence", "publish_port")
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    LSN_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_BATCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_PORT_FIELD_NUMBER: _ClassVar[int]
    first_offset: int
    row_count: int
    duplicates: int
    lsn: int
    duplicate_batch: bool
    sequence: int
    publish_port: int
    def __init__(self, first_offset: _Optional[int] = ..., row_count: _Optional[int] = ..., duplicates: _Optional[int] = ..., lsn: _Optional[int] = ..., duplicate_batch: _Optional[bool] = ..., sequence: _Optional[int] = ..., publish_port: _Optional[int] = ...) -> None: ...

class PublishBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[PublishRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[PublishRequest, _Mapping]]] = ...) -> None: ...

class PublishAcks(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[PublishResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[PublishResponse, _Mapping]]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("table", "action_name", "offset", "batch_rows")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ACTION_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    table: str
    action_name: str
    offset: int
    batch_rows: int
    def __init__(self, table: _Optional[str] = ..., action_name: _Optional[str] = ..., offset: _Optional[int] = ..., batch_rows: _Optional[int] = ...) -> None: ...

class RowBatch(_message.Message):
    __slots__ = ("first_offset", "row_count", "payload", "table_row_count", "slice_offsets", "slice_timestamps_ms")
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TABLE_ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    SLICE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SLICE_TIMESTAMPS_MS_FIELD_NUMBER: _ClassVar[int]
    first_offset: int
    row_count: int
    payload: bytes
    table_row_count: int
    slice_offsets: _containers.RepeatedScalarFieldContainer[int]
    slice_timestamps_ms: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_offset: _Optional[int] = ..., row_count: _Optional[int] = ..., payload: _Optional[bytes] = ..., table_row_count: _Optional[int] = ..., slice_offsets: _Optional[_Iterable[int]] = ..., slice_timestamps_ms: _Optional[_Iterable[int]] = ...) -> None: ...

class OffsetForTimeRequest(_message.Message):
    __slots__ = ("table", "timestamp_ms")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    table: str
    timestamp_ms: int
    def __init__(self, table: _Optional[str] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class OffsetForTime(_message.Message):
    __slots__ = ("table", "found", "offset", "timestamp_ms")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    table: str
    found: bool
    offset: int
    timestamp_ms: int
    def __init__(self, table: _Optional[str] = ..., found: _Optional[bool] = ..., offset: _Optional[int] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("table", "offset_from", "offset_to", "batch_rows", "end_at_leader")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FROM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_TO_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    END_AT_LEADER_FIELD_NUMBER: _ClassVar[int]
    table: str
    offset_from: int
    offset_to: int
    batch_rows: int
    end_at_leader: bool
    def __init__(self, table: _Optional[str] = ..., offset_from: _Optional[int] = ..., offset_to: _Optional[int] = ..., batch_rows: _Optional[int] = ..., end_at_leader: _Optional[bool] = ...) -> None: ...

class FetchRecordsRequest(_message.Message):
    __slots__ = ("raft_group", "table", "offset_from", "offset_to", "created_lsn")
    RAFT_GROUP_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FROM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_TO_FIELD_NUMBER: _ClassVar[int]
    CREATED_LSN_FIELD_NUMBER: _ClassVar[int]
    raft_group: int
    table: str
    offset_from: int
    offset_to: int
    created_lsn: int
    def __init__(self, raft_group: _Optional[int] = ..., table: _Optional[str] = ..., offset_from: _Optional[int] = ..., offset_to: _Optional[int] = ..., created_lsn: _Optional[int] = ...) -> None: ...

class DataRecord(_message.Message):
    __slots__ = ("lsn", "first_offset", "row_count", "timestamp_ms", "payload")
    LSN_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    lsn: int
    first_offset: int
    row_count: int
    timestamp_ms: int
    payload: bytes
    def __init__(self, lsn: _Optional[int] = ..., first_offset: _Optional[int] = ..., row_count: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class DataRecords(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[DataRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[DataRecord, _Mapping]]] = ...) -> None: ...

class CommitOffsetRequest(_message.Message):
    __slots__ = ("table", "action_name", "offset")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ACTION_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    table: str
    action_name: str
    offset: int
    def __init__(self, table: _Optional[str] = ..., action_name: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class TopicRequest(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: str
    def __init__(self, topic: _Optional[str] = ...) -> None: ...

class TopicOffset(_message.Message):
    __slots__ = ("topic", "offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    offset: int
    def __init__(self, topic: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class GroupRequest(_message.Message):
    __slots__ = ("raft_group",)
    RAFT_GROUP_FIELD_NUMBER: _ClassVar[int]
    raft_group: int
    def __init__(self, raft_group: _Optional[int] = ...) -> None: ...

class LeaderInfo(_message.Message):
    __slots__ = ("raft_group", "leader")
    RAFT_GROUP_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    raft_group: int
    leader: str
    def __init__(self, raft_group: _Optional[int] = ..., leader: _Optional[str] = ...) -> None: ...

class TransferLeadershipRequest(_message.Message):
    __slots__ = ("raft_group", "to_node", "timeout_s")
    RAFT_GROUP_FIELD_NUMBER: _ClassVar[int]
    TO_NODE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    raft_group: int
    to_node: str
    timeout_s: float
    def __init__(self, raft_group: _Optional[int] = ..., to_node: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RaftGroupInfo(_message.Message):
    __slots__ = ("raft_group", "sites", "leader", "tables")
    RAFT_GROUP_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    raft_group: int
    sites: _containers.RepeatedScalarFieldContainer[str]
    leader: str
    tables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, raft_group: _Optional[int] = ..., sites: _Optional[_Iterable[str]] = ..., leader: _Optional[str] = ..., tables: _Optional[_Iterable[str]] = ...) -> None: ...

class RaftGroups(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[RaftGroupInfo]
    def __init__(self, groups: _Optional[_Iterable[_Union[RaftGroupInfo, _Mapping]]] = ...) -> None: ...

class NameClaim(_message.Message):
    __slots__ = ("table", "raft_group", "nonce")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    RAFT_GROUP_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    table: str
    raft_group: int
    nonce: bytes
    def __init__(self, table: _Optional[str] = ..., raft_group: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class NameClaims(_message.Message):
    __slots__ = ("claims",)
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    claims: _containers.RepeatedCompositeFieldContainer[NameClaim]
    def __init__(self, claims: _Optional[_Iterable[_Union[NameClaim, _Mapping]]] = ...) -> None: ...

class TableDigestRequest(_message.Message):
    __slots__ = ("raft_group", "table", "offset_from", "offset_to")
    RAFT_GROUP_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FROM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_TO_FIELD_NUMBER: _ClassVar[int]
    raft_group: int
    table: str
    offset_from: int
    offset_to: int
    def __init__(self, raft_group: _Optional[int] = ..., table: _Optional[str] = ..., offset_from: _Optional[int] = ..., offset_to: _Optional[int] = ...) -> None: ...

class TableDigest(_message.Message):
    __slots__ = ("offset_from", "offset_to", "records", "digest", "earliest_offset", "row_count")
    OFFSET_FROM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_TO_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    EARLIEST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    offset_from: int
    offset_to: int
    records: int
    digest: int
    earliest_offset: int
    row_count: int
    def __init__(self, offset_from: _Optional[int] = ..., offset_to: _Optional[int] = ..., records: _Optional[int] = ..., digest: _Optional[int] = ..., earliest_offset: _Optional[int] = ..., row_count: _Optional[int] = ...) -> None: ...

class RepairTableRequest(_message.Message):
    __slots__ = ("raft_group", "table", "reason")
    RAFT_GROUP_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    raft_group: int
    table: str
    reason: str
    def __init__(self, raft_group: _Optional[int] = ..., table: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LoginRequest(_message.Message):
    __slots__ = ("userid", "password")
    USERID_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    userid: str
    password: str
    def __init__(self, userid: _Optional[str] = ..., password: _Optional[str] = ...) -> None: ...

class LoginResponse(_message.Message):
    __slots__ = ("token", "expires_ms", "admin")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_ms: int
    admin: bool
    def __init__(self, token: _Optional[str] = ..., expires_ms: _Optional[int] = ..., admin: _Optional[bool] = ...) -> None: ...

class AccessRequest(_message.Message):
    __slots__ = ("operation", "userid", "password", "admin", "privilege", "table")
    class Operation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OPERATION_UNSPECIFIED: _ClassVar[AccessRequest.Operation]
        CREATE_USER: _ClassVar[AccessRequest.Operation]
        DELETE_USER: _ClassVar[AccessRequest.Operation]
        RESET_PASSWORD: _ClassVar[AccessRequest.Operation]
        GRANT: _ClassVar[AccessRequest.Operation]
        DENY: _ClassVar[AccessRequest.Operation]
        REVOKE: _ClassVar[AccessRequest.Operation]
    OPERATION_UNSPECIFIED: AccessRequest.Operation
    CREATE_USER: AccessRequest.Operation
    DELETE_USER: AccessRequest.Operation
    RESET_PASSWORD: AccessRequest.Operation
    GRANT: AccessRequest.Operation
    DENY: AccessRequest.Operation
    REVOKE: AccessRequest.Operation
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    USERID_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    PRIVILEGE_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    operation: AccessRequest.Operation
    userid: str
    password: str
    admin: bool
    privilege: str
    table: str
    def __init__(self, operation: _Optional[_Union[AccessRequest.Operation, str]] = ..., userid: _Optional[str] = ..., password: _Optional[str] = ..., admin: _Optional[bool] = ..., privilege: _Optional[str] = ..., table: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JsonDocument(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
