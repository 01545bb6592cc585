"""The Raft peer authenticator that replaces pysyncobj's Fernet encryptor."""

from __future__ import annotations

import pytest
from cryptography.exceptions import InvalidTag

from raftstore.pysyncobj_patches import GmacAuthenticator as _GmacAuthenticator

pytestmark = pytest.mark.unit


def test_round_trip_between_two_nodes_sharing_the_secret() -> None:
    sender, receiver = _GmacAuthenticator("secret"), _GmacAuthenticator("secret")
    token = sender.encrypt_at_time(b"payload" * 1000, 1234)
    assert receiver.extract_timestamp(token) == 1234
    assert receiver.decrypt(token) == b"payload" * 1000


@pytest.mark.parametrize("position", [0, 7, 8, 19, 20, 35, 36, 100, -1])
def test_any_flipped_byte_is_rejected(position: int) -> None:
    sender, receiver = _GmacAuthenticator("secret"), _GmacAuthenticator("secret")
    token = bytearray(sender.encrypt_at_time(b"x" * 200, 99))
    token[position] ^= 0x01
    with pytest.raises(InvalidTag):
        receiver.extract_timestamp(bytes(token))


def test_other_secret_and_short_tokens_are_rejected() -> None:
    token = _GmacAuthenticator("one").encrypt_at_time(b"data", 1)
    with pytest.raises(InvalidTag):
        _GmacAuthenticator("two").extract_timestamp(token)
    with pytest.raises(ValueError, match="too short"):
        _GmacAuthenticator("one").extract_timestamp(b"short")


def test_nonces_never_repeat_within_a_process() -> None:
    sender = _GmacAuthenticator("secret")
    nonces = {sender.encrypt_at_time(b"", 0)[8:20] for _ in range(1000)}
    assert len(nonces) == 1000
