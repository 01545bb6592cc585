"""TLS settings shared by the client and the nodes (which are clients of each other).

Only files and their checks live here (stdlib); each side turns the bytes into gRPC
credentials itself. A file that cannot be read is an `InvalidArgument` naming the option
and the path, at the moment the settings are read, never at the first call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from hastream.errors import InvalidArgument

# PEM files are small; a larger one is a wrong path (a data file, a device).
PEM_BYTES_MAX: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class PemFiles:
    """The bytes of a TLS identity and trust anchor, as gRPC takes them."""

    ca: bytes | None  # trusted roots; None: the system's
    cert_chain: bytes | None  # this side's certificate (mutual TLS); None: none presented
    private_key: bytes | None


@dataclass(frozen=True, slots=True)
class ClientTls:
    """How a client (or a node calling a peer) opens TLS connections. `ca_file`: the CA
    that signed the nodes' certificates (None: the system's roots). `cert_file` and
    `key_file`: this client's certificate, for nodes that require one (mutual TLS); both
    or neither. `server_name`: the name to verify in the node's certificate when it is not
    the host dialled (an IP address or a proxy)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidArgument("certFile/keyFile", "give both (mutual TLS) or neither")

    def read(self) -> PemFiles:
        return PemFiles(
            ca=read_pem("caFile", self.ca_file),
            cert_chain=read_pem("certFile", self.cert_file),
            private_key=read_pem("keyFile", self.key_file),
        )


def read_pem(option: str, path: str | Path | None) -> bytes | None:
    """The contents of PEM file `path` (None: None). Raises InvalidArgument naming
    `option` when it cannot be read or holds no PEM block."""
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            data = file.read(PEM_BYTES_MAX + 1)
    except OSError as error:
        raise InvalidArgument(option, f"cannot read {path}: {error.strerror or error}") from None
    if len(data) > PEM_BYTES_MAX:
        raise InvalidArgument(option, f"{path} is larger than {PEM_BYTES_MAX} bytes")
    if b"-----BEGIN " not in data:
        raise InvalidArgument(option, f"{path} holds no PEM block")
    return data
