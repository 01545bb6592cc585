"""The Raft peer encryptor that replaces pysyncobj's Fernet encryptor."""

from __future__ import annotations

import pytest
from cryptography.exceptions import InvalidTag

from raftstore.pysyncobj_patches import AesGcmEncryptor

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
