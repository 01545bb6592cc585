"""commands.py: the versioned binary encoding of the Raft log entries."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hastream.errors import InvalidArgument
from raftstore import commands
from raftstore.commands import (
    APPEND_OVERHEAD_BYTES,
    Append,
    AppendItem,
    Command,
    CommitOffset,
    CreateTable,
    DropTable,
    Kind,
    Noop,
    RemoveOffset,
    decode,
    encode,
    encoded_item_bytes,
)
from raftstore.replica import join_command

PRODUCER = bytes(range(16))

EXAMPLES: list[Command] = [
    CreateTable("trades", b"\x01schema\x00", 1000, "id", 1440),
    CreateTable("quotes", b"", 1, None, 1),
    CreateTable("t\u00e9", b"s" * 300, -5, "", -(2**63)),
    DropTable("trades", force=False),
    DropTable("trades", force=True),
    Append(1_700_000_000_000, ()),
    Append(
        -1,
        (
            AppendItem("trades", PRODUCER, 7, b"payload-1"),
            AppendItem("quotes", b"", 0, b""),
            AppendItem("trades", PRODUCER, 2**64 - 1, bytes(range(256)) * 3),
        ),
    ),
    Append(
        5,
        (
            AppendItem("trades", PRODUCER, 8, b"pipelined", contiguous=True),
            AppendItem("quotes", b"", 0, b"unary"),
        ),
    ),
    CommitOffset("trades/action", 42),
    CommitOffset("trades/action", -1),
    RemoveOffset("trades/action"),
    Noop(),
]

texts = st.text(max_size=12)
i64 = st.integers(-(2**63), 2**63 - 1)
items = st.builds(
    AppendItem,
    table=texts,
    producer_id=st.one_of(st.just(b""), st.binary(min_size=16, max_size=16)),
    sequence=st.integers(0, 2**64 - 1),
    payload=st.binary(max_size=64),
    contiguous=st.booleans(),
)
command_strategy: st.SearchStrategy[Command] = st.one_of(
    st.builds(
        CreateTable,
        table=texts,
        schema_ipc=st.binary(max_size=64),
        cache_limit=i64,
        key_column=st.none() | texts,
        retention_minutes=i64,
    ),
    st.builds(DropTable, table=texts, force=st.booleans()),
    st.builds(Append, timestamp_ms=i64, items=st.lists(items, max_size=4).map(tuple)),
    st.builds(CommitOffset, topic=texts, offset=i64),
    st.builds(RemoveOffset, topic=texts),
    st.just(Noop()),
)


@pytest.mark.unit
@pytest.mark.parametrize("command", EXAMPLES, ids=lambda command: type(command).__name__)
def test_every_kind_round_trips(command: Command) -> None:
    data = encode(command)
    assert data[0] == commands.VERSION
    assert decode(data) == command
    assert encode(decode(data)) == data


@pytest.mark.unit
@pytest.mark.parametrize("command", EXAMPLES, ids=lambda command: type(command).__name__)
def test_is_append_reads_the_kind_byte_alone(command: Command) -> None:
    data = encode(command)
    assert commands.is_append(data) is isinstance(command, Append)
    tagged = b"\x00" + data  # as replication sees it: pysyncobj's entry type byte first
    assert commands.is_append(memoryview(tagged), start=1) is isinstance(command, Append)


@pytest.mark.unit
@pytest.mark.parametrize("data", [b"", bytes([commands.VERSION])])
def test_is_append_of_bytes_too_short_for_a_kind_is_false(data: bytes) -> None:
    assert not commands.is_append(data)


@pytest.mark.property
@given(command_strategy)
def test_generated_commands_round_trip(command: Command) -> None:
    data = encode(command)
    assert decode(data) == command
    assert decode(memoryview(data)) == command
    assert encode(decode(data)) == data


@pytest.mark.property
@given(command_strategy)
def test_append_parts_join_to_the_encoded_entry_with_any_replica_prefix(command: Command) -> None:
    # What a replica joins (replica.join_command) is the entry encode() makes, behind the
    # replica's own framing (pysyncobj's tag byte), the payloads passed through uncopied.
    if not isinstance(command, Append):
        return
    parts = commands.append_parts(command)
    assert b"".join(parts) == encode(command)
    assert join_command(parts, b"\x00") == b"\x00" + encode(command)
    assert join_command(encode(command)) == encode(command)
    assert all(any(part is item.payload for part in parts) for item in command.items)


@pytest.mark.unit
def test_decoded_payload_is_a_zero_copy_view_of_the_entry() -> None:
    data = encode(Append(5, (AppendItem("t", b"", 0, b"abcdef"),)))
    command = decode(data)
    assert isinstance(command, Append)
    payload = command.items[0].payload
    assert isinstance(payload, memoryview)
    assert payload.obj is data
    assert bytes(payload) == b"abcdef"


@pytest.mark.unit
def test_encode_accepts_memoryview_payloads() -> None:
    payload = memoryview(b"xxpayloadxx")[2:-2]
    data = encode(Append(5, (AppendItem("t", b"", 0, payload),)))
    assert decode(data) == Append(5, (AppendItem("t", b"", 0, b"payload"),))


@pytest.mark.unit
@pytest.mark.parametrize("command", EXAMPLES, ids=lambda command: type(command).__name__)
def test_every_truncation_raises_invalid_argument(command: Command) -> None:
    data = encode(command)
    for size in range(len(data)):
        with pytest.raises(InvalidArgument) as raised:
            decode(data[:size])
        assert raised.value.argument == "command"


@pytest.mark.unit
@pytest.mark.parametrize("command", EXAMPLES, ids=lambda command: type(command).__name__)
def test_trailing_bytes_raise_invalid_argument(command: Command) -> None:
    with pytest.raises(InvalidArgument, match="trailing"):
        decode(encode(command) + b"\x00")


@pytest.mark.unit
def test_unknown_version_raises_invalid_argument() -> None:
    data = bytearray(encode(Noop()))
    data[0] = 2
    with pytest.raises(InvalidArgument, match="version 2"):
        decode(bytes(data))


@pytest.mark.unit
def test_unknown_kind_raises_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="kind 99"):
        decode(bytes([commands.VERSION, 99]))


@pytest.mark.unit
def test_bad_utf8_raises_invalid_argument() -> None:
    data = bytes([commands.VERSION, Kind.REMOVE_OFFSET, 2, 0, 0xFF, 0xFE])
    with pytest.raises(InvalidArgument, match="UTF-8"):
        decode(data)


@pytest.mark.unit
def test_bad_producer_id_length_raises_invalid_argument() -> None:
    data = bytearray(encode(Append(0, (AppendItem("t", PRODUCER, 1, b"p"),))))
    position = APPEND_OVERHEAD_BYTES + 2 + 1  # table length + "t"
    assert data[position] == 16
    data[position] = 15
    with pytest.raises(InvalidArgument, match="producer_id"):
        decode(bytes(data))


@pytest.mark.unit
def test_non_canonical_flag_raises_invalid_argument() -> None:
    data = bytearray(encode(DropTable("t", force=True)))
    data[-1] = 2
    with pytest.raises(InvalidArgument, match="force"):
        decode(bytes(data))


@pytest.mark.property
@given(st.binary(max_size=200))
@example(b"")
@example(bytes([commands.VERSION]))
@example(bytes([commands.VERSION, Kind.APPEND]) + b"\x00" * 8 + b"\xff\xff\xff\xff")
def test_garbage_either_decodes_canonically_or_raises_invalid_argument(data: bytes) -> None:
    try:
        command = decode(data)
    except InvalidArgument as error:
        argument = error.argument
    else:
        argument = "command"
        assert encode(command) == data
    assert argument == "command"


@pytest.mark.property
@given(st.sampled_from(list(Kind)), st.binary(max_size=80))
def test_garbage_bodies_of_every_kind_raise_only_invalid_argument(kind: Kind, body: bytes) -> None:
    data = bytes([commands.VERSION, kind]) + body
    try:
        command = decode(data)
    except InvalidArgument:
        return
    assert encode(command) == data


@pytest.mark.unit
@pytest.mark.parametrize(
    "command",
    [
        RemoveOffset("x" * 70_000),
        Append(0, (AppendItem("t", b"short", 1, b""),)),
        Append(0, (AppendItem("t", b"", -1, b""),)),
        Append(2**63, ()),
        CommitOffset("t/a", -(2**63) - 1),
        RemoveOffset("\ud800"),
    ],
    ids=["long-string", "producer-id", "sequence", "timestamp", "offset", "surrogate"],
)
def test_encode_refuses_values_the_format_cannot_hold(command: Command) -> None:
    with pytest.raises(InvalidArgument):
        encode(command)


@pytest.mark.property
@given(items)
def test_encoded_item_bytes_is_the_exact_size_an_item_adds(item: AppendItem) -> None:
    assert len(encode(Append(0, (item,)))) == APPEND_OVERHEAD_BYTES + encoded_item_bytes(item)


@pytest.mark.property
@given(st.lists(items, min_size=1, max_size=4))
def test_encoded_item_bytes_of_a_mixed_entry(entry_items: list[AppendItem]) -> None:
    flagged = any(item.contiguous for item in entry_items)
    sizes = sum(encoded_item_bytes(item, flagged=flagged) for item in entry_items)
    assert len(encode(Append(0, tuple(entry_items)))) == APPEND_OVERHEAD_BYTES + sizes


# An Append entry as the encoder wrote it before items had flags (commit 6a3d7fd).
_APPEND_BEFORE_FLAGS = bytes.fromhex(
    "01030068e5cf8b0100000200000005007469636b7310000102030405060708090a0b0c0d0e0f07000000"
    "0000000002000000010201007400000000000000000000000000"
)


@pytest.mark.unit
def test_append_entries_written_before_flags_decode_and_encode_unchanged() -> None:
    command = decode(_APPEND_BEFORE_FLAGS)
    assert command == Append(
        1_700_000_000_000,
        (AppendItem("ticks", PRODUCER, 7, b"\x01\x02"), AppendItem("t", b"", 0, b"")),
    )
    assert isinstance(command, Append)
    assert not any(item.contiguous for item in command.items)
    assert encode(command) == _APPEND_BEFORE_FLAGS


@pytest.mark.unit
def test_only_an_entry_with_a_contiguous_item_uses_the_flagged_kind() -> None:
    unary = encode(Append(0, (AppendItem("t", PRODUCER, 1, b"p"),)))
    pipelined = encode(Append(0, (AppendItem("t", PRODUCER, 1, b"p", contiguous=True),)))
    assert unary[1] == Kind.APPEND
    assert pipelined[1] == Kind.APPEND_FLAGGED
    assert len(pipelined) == len(unary) + 1  # the flags byte


@pytest.mark.unit
def test_a_flagged_entry_without_a_flagged_item_is_refused_as_not_canonical() -> None:
    data = bytearray(encode(Append(0, (AppendItem("t", PRODUCER, 1, b"p", contiguous=True),))))
    flags_at = APPEND_OVERHEAD_BYTES + 2 + 1 + 1 + 16 + 8  # table, "t", id length, id, sequence
    assert data[flags_at] == 1
    data[flags_at] = 0
    with pytest.raises(InvalidArgument, match="canonical"):
        decode(bytes(data))


@pytest.mark.unit
def test_unknown_item_flag_bits_are_refused() -> None:
    data = bytearray(encode(Append(0, (AppendItem("t", PRODUCER, 1, b"p", contiguous=True),))))
    flags_at = APPEND_OVERHEAD_BYTES + 2 + 1 + 1 + 16 + 8
    data[flags_at] = 0b11
    with pytest.raises(InvalidArgument, match="unknown bits"):
        decode(bytes(data))


@pytest.mark.unit
def test_large_payloads_encode_and_decode() -> None:
    payload = bytes(range(256)) * 40_000  # ~10 MiB
    data = encode(Append(0, (AppendItem("t", PRODUCER, 1, payload), AppendItem("u", b"", 0, b""))))
    command = decode(data)
    assert isinstance(command, Append)
    assert command.items[0].payload == payload
