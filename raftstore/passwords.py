"""Salted, slow password hashes (scrypt, from the standard library's OpenSSL binding).

A stored hash is ASCII: `scrypt:<n>:<r>:<p>:<salt hex>:<key hex>`. The parameters travel
with the hash, so a later node with stronger defaults still verifies older hashes; they are
bounded when read, so a malformed hash cannot make a login allocate gigabytes.
Pure apart from the salt's randomness; safe on any thread.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Final

from hastream.errors import InvalidArgument

# ~50 ms and 16 MiB per hash here: slow for a guesser, fine for a login.
SCRYPT_N: Final = 2**14
SCRYPT_R: Final = 8
SCRYPT_P: Final = 1
_SALT_BYTES: Final = 16
_KEY_BYTES: Final = 32
_N_MAX: Final = 2**17
_R_MAX: Final = 16
_P_MAX: Final = 4
_MAXMEM: Final = 256 * 1024 * 1024

PASSWORD_BYTES_MAX: Final = 256
HASH_BYTES_MAX: Final = 256


def check_password(password: str, *, field: str = "password", chars_min: int = 1) -> bytes:
    """The password's UTF-8 bytes. Raises InvalidArgument naming `field` (never echoing the
    password) when it is shorter than `chars_min` or longer than PASSWORD_BYTES_MAX."""
    data = password.encode("utf-8")
    if len(password) < chars_min or len(data) > PASSWORD_BYTES_MAX:
        reason = f"want {chars_min}..{PASSWORD_BYTES_MAX} bytes, got {len(data)}"
        raise InvalidArgument(field, reason)
    return data


def hash_password(password: str) -> bytes:
    """A fresh salted hash of `password` (raises what check_password raises)."""
    salt = os.urandom(_SALT_BYTES)
    key = _scrypt(check_password(password), salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    text = f"scrypt:{SCRYPT_N}:{SCRYPT_R}:{SCRYPT_P}:{salt.hex()}:{key.hex()}"
    return text.encode("ascii")


def verify_password(password: str, stored: bytes) -> bool:
    """Whether `password` matches `stored` (False for a malformed hash, never an error)."""
    try:
        data = check_password(password)
        _, n_text, r_text, p_text, salt_hex, key_hex = stored.decode("ascii").split(":")
        n, r, p = int(n_text), int(r_text), int(p_text)
        if not (1 < n <= _N_MAX and n & (n - 1) == 0 and 0 < r <= _R_MAX and 0 < p <= _P_MAX):
            return False
        expected = bytes.fromhex(key_hex)
        return hmac.compare_digest(_scrypt(data, bytes.fromhex(salt_hex), n, r, p), expected)
    except (InvalidArgument, ValueError, UnicodeDecodeError):
        return False


def well_formed(stored: bytes) -> bool:
    """Whether `stored` looks like a hash this module wrote (checked at apply)."""
    if len(stored) > HASH_BYTES_MAX:
        return False
    parts = stored.split(b":")
    return len(parts) == 6 and parts[0] == b"scrypt" and all(parts[1:])


def _scrypt(data: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(data, salt=salt, n=n, r=r, p=p, maxmem=_MAXMEM, dklen=_KEY_BYTES)
