"""The Raft peer encryptor that replaces pysyncobj's Fernet encryptor, and its split tokens
(append_entries whose big commands are sealed once for every link)."""

from __future__ import annotations

import pickle
import struct

import pysyncobj.tcp_connection as pysyncobj_tcp_connection
import pytest
from cryptography.exceptions import InvalidTag
from hypothesis import given, settings
from hypothesis import strategies as st

from raftstore import limits, pysyncobj_patches
from raftstore.pysyncobj_patches import AesGcmEncryptor
from tests.harness import wait_until

pytestmark = pytest.mark.unit


def test_round_trip_between_two_nodes_sharing_the_secret() -> None:
    sender, receiver = AesGcmEncryptor("secret"), AesGcmEncryptor("secret")
    token = sender.encrypt_at_time(b"payload" * 1000, 1234)
    assert receiver.extract_timestamp(token) == 1234
    assert receiver.decrypt(token) == b"payload" * 1000


@pytest.mark.parametrize("position", [0, 7, 8, 19, 20, 35, 36, 100, -1])
def test_any_flipped_byte_is_rejected(position: int) -> None:
    sender, receiver = AesGcmEncryptor("secret"), AesGcmEncryptor("secret")
    token = bytearray(sender.encrypt_at_time(b"x" * 200, 99))
    token[position] ^= 0x01
    with pytest.raises(InvalidTag):
        receiver.extract_timestamp(bytes(token))


def test_other_secret_and_short_tokens_are_rejected() -> None:
    token = AesGcmEncryptor("one").encrypt_at_time(b"data", 1)
    with pytest.raises(InvalidTag):
        AesGcmEncryptor("two").extract_timestamp(token)
    with pytest.raises(ValueError, match="too short"):
        AesGcmEncryptor("one").extract_timestamp(b"short")


def test_nonces_never_repeat_within_a_process() -> None:
    sender = AesGcmEncryptor("secret")
    nonces = {sender.encrypt_at_time(b"", 0)[8:20] for _ in range(1000)}
    assert len(nonces) == 1000


def test_the_payload_does_not_travel_in_the_clear() -> None:
    secret_rows = b"account=4711;balance=1000000;" * 100
    token = AesGcmEncryptor("secret").encrypt_at_time(secret_rows, 5)
    assert b"account=4711" not in token
    assert len(token) == len(secret_rows) + 8 + 12 + 16


def test_sealed_pieces_are_the_token_pysyncobj_would_send() -> None:
    sender, receiver = AesGcmEncryptor("secret"), AesGcmEncryptor("secret")
    token = b"".join(sender.seal(b"rows" * 500, 42))
    assert receiver.extract_timestamp(token) == 42
    assert receiver.decrypt(token) == b"rows" * 500
    assert receiver.open(memoryview(sender.encrypt_at_time(b"abc", 43))) == (43, b"abc")


# --- split tokens: big commands sealed once, shared by every link of a tick ---------------

BIG = limits.RAFT_SHARED_PIECE_BYTES_MIN


def _append_entries(*sizes: int) -> dict[str, object]:
    return {
        "type": "append_entries",
        "term": 3,
        "commit_index": 7,
        "entries": [(bytes([n % 251]) * size, n + 8, 3) for n, size in enumerate(sizes)],
        "prevLogIdx": 7,
        "prevLogTerm": 3,
    }


def _opened(receiver: AesGcmEncryptor, token: bytes) -> tuple[int, object]:
    """What pysyncobj_patches._connection_parse does with a token: open, then unpickle."""
    if receiver.is_split(token):
        timestamp, head, pieces = receiver.open_split(token)
        return timestamp, pickle.loads(head, buffers=pieces)
    timestamp, data = receiver.open(token)
    return timestamp, pickle.loads(data)


def _token(sender: AesGcmEncryptor, message: object, now: int = 11) -> bytes:
    return b"".join(pysyncobj_patches._sealed(sender, message, now))


def test_an_append_entries_with_big_commands_travels_split_and_comes_back_whole() -> None:
    sender, receiver = AesGcmEncryptor("secret"), AesGcmEncryptor("secret")
    message = (b"link-key", _append_entries(10, BIG, 3, 5 * BIG, 0))
    token = _token(sender, message, now=42)
    assert receiver.is_split(token)
    timestamp, opened = _opened(receiver, token)
    assert (timestamp, opened) == (42, message)
    big = opened[1]["entries"][1][0]  # type: ignore[index]
    assert type(big) is bytes  # the journal and the applier get bytes, as before


def test_messages_without_big_commands_are_one_token_as_before() -> None:
    sender, receiver = AesGcmEncryptor("secret"), AesGcmEncryptor("secret")
    for message in (_append_entries(10, BIG - 1), {"type": "request_vote", "term": 2}, b"key"):
        token = _token(sender, message)
        assert not receiver.is_split(token)
        assert _opened(receiver, token) == (11, message)


def test_a_command_sent_on_two_links_in_one_tick_is_encrypted_once() -> None:
    sender = AesGcmEncryptor("secret")
    message = _append_entries(2 * BIG)
    first = pysyncobj_patches._sealed(sender, (b"link-1", message), 5)
    second = pysyncobj_patches._sealed(sender, (b"link-2", message), 5)
    assert first[-1] is second[-1]  # the piece: one ciphertext for both links
    assert first[0] != second[0]  # each link's head is its own (its key, its nonce)
    sender.forget_pieces()
    third = pysyncobj_patches._sealed(sender, (b"link-1", message), 6)
    assert third[-1] != first[-1]  # sealed anew under a fresh nonce
    receiver = AesGcmEncryptor("secret")
    for body in (first, second, third):
        assert _opened(receiver, b"".join(body))[1][1] == message  # type: ignore[index]


def test_pieces_sealed_since_a_time_are_kept_for_a_held_back_follower() -> None:
    sender = AesGcmEncryptor("secret")
    older, newer = _append_entries(2 * BIG), _append_entries(3 * BIG)
    older_sealed = pysyncobj_patches._sealed(sender, (b"link-1", older), 5)
    clock = pysyncobj_tcp_connection.monotonicTime  # the clock seal_piece reads
    between = clock()
    wait_until(lambda: clock() > between, timeout_s=1, message="the clock moves")
    newer_sealed = pysyncobj_patches._sealed(sender, (b"link-1", newer), 5)
    sender.forget_pieces(sealed_before=between)  # a tick's end, a follower held back
    again_older = pysyncobj_patches._sealed(sender, (b"link-2", older), 6)
    again_newer = pysyncobj_patches._sealed(sender, (b"link-2", newer), 6)
    assert again_newer[-1] is newer_sealed[-1]  # kept: one encryption for both links
    assert again_older[-1] != older_sealed[-1]  # let go: sealed anew under a fresh nonce
    sender.forget_pieces()
    assert pysyncobj_patches._sealed(sender, (b"link-1", newer), 7)[-1] != newer_sealed[-1]
    receiver = AesGcmEncryptor("secret")
    for body, message in ((again_older, older), (again_newer, newer)):
        assert _opened(receiver, b"".join(body))[1][1] == message  # type: ignore[index]


def test_pieces_past_the_bound_are_sealed_per_link(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "RAFT_SHARED_PIECES_BYTES_MAX", 3 * BIG)
    sender = AesGcmEncryptor("secret")
    message = _append_entries(2 * BIG, 2 * BIG)
    first = pysyncobj_patches._sealed(sender, message, 5)
    second = pysyncobj_patches._sealed(sender, message, 5)
    assert first[-2] is second[-2]  # the first piece fit the bound
    assert first[-1] != second[-1]  # the second did not: sealed again, a fresh nonce
    receiver = AesGcmEncryptor("secret")
    assert _opened(receiver, b"".join(second))[1] == message


def _split_token() -> bytes:
    return _token(AesGcmEncryptor("secret"), _append_entries(BIG, 100, BIG + 1))


@pytest.mark.parametrize(
    "position",
    [0, 7, 8, 11, 12, 15, 16, 20, 28, 40, 44, 60, 72, 80, 100, 200, 1000, BIG + 300, -17, -1],
)
def test_any_flipped_byte_of_a_split_token_is_rejected(position: int) -> None:
    token = bytearray(_split_token())
    token[position] ^= 0x01
    receiver = AesGcmEncryptor("secret")
    with pytest.raises((InvalidTag, ValueError, struct.error)):
        _opened(receiver, bytes(token))


def test_a_piece_of_another_frame_is_rejected() -> None:
    sender = AesGcmEncryptor("secret")
    one = pysyncobj_patches._sealed(sender, _append_entries(BIG), 1)
    two = pysyncobj_patches._sealed(sender, _append_entries(BIG + 0), 1)
    assert len(one[-1]) == len(two[-1])
    assert one[-1] != two[-1]
    swapped = b"".join([*one[:-1], two[-1]])
    with pytest.raises(InvalidTag):
        _opened(AesGcmEncryptor("secret"), swapped)


@pytest.mark.parametrize("cut", [1, 16, BIG // 2])
def test_a_split_token_cut_short_or_with_bytes_appended_is_rejected(cut: int) -> None:
    token = _split_token()
    receiver = AesGcmEncryptor("secret")
    with pytest.raises((InvalidTag, ValueError)):
        receiver.open_split(token[:-cut])
    with pytest.raises(ValueError, match="layout"):
        receiver.open_split(token + b"\0" * cut)


def test_a_split_token_whose_table_claims_more_than_the_frame_is_rejected() -> None:
    token = bytearray(_split_token())
    struct.pack_into("<I", token, 12, 1_000_000)  # piece count
    with pytest.raises(ValueError, match="layout"):
        AesGcmEncryptor("secret").open_split(bytes(token))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(
        st.sampled_from([0, 1, 100, BIG - 1, BIG, BIG + 1, 3 * BIG]), min_size=0, max_size=6
    ),
    keyed=st.booleans(),
    links=st.integers(min_value=1, max_value=3),
)
def test_any_append_entries_comes_back_equal_on_every_link(
    sizes: list[int], keyed: bool, links: int
) -> None:
    sender, receiver = AesGcmEncryptor("secret"), AesGcmEncryptor("secret")
    body = _append_entries(*sizes)
    for link in range(links):
        message = (b"key-%d" % link, body) if keyed else body
        token = _token(sender, message, now=link)
        assert receiver.is_split(token) == any(size >= BIG for size in sizes)
        assert _opened(receiver, token) == (link, message)
    sender.forget_pieces()
