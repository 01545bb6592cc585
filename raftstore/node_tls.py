"""A node's TLS: the server credentials of its client port (and the same certificate as
an `ssl.SSLContext` for its publish port), and the channel credentials it calls its peers
with (the same certificate: with `tlsClientAuth=require` a node is a client its peers must
accept, so node certificates carry clientAuth as well)."""

from __future__ import annotations

import ssl

import grpc

from hastream.errors import ConfigError, InvalidArgument
from hastream.tls import PemFiles, read_pem
from raftstore.config import KEY_TLS_CA, KEY_TLS_CERT, KEY_TLS_KEY, NodeTls


def load(tls: NodeTls, where: str) -> PemFiles:
    """The node's PEM files. Raises ConfigError naming the key and the file."""
    files: dict[str, bytes] = {}
    for key, path in (
        (KEY_TLS_CERT, tls.cert_file),
        (KEY_TLS_KEY, tls.key_file),
        (KEY_TLS_CA, tls.ca_file),
    ):
        try:
            data = read_pem(key, path)
        except InvalidArgument as error:
            raise ConfigError(where, key, str(path), error.detail) from None
        assert data is not None
        files[key] = data
    return PemFiles(
        ca=files[KEY_TLS_CA], cert_chain=files[KEY_TLS_CERT], private_key=files[KEY_TLS_KEY]
    )


def server_credentials(pem: PemFiles, *, client_auth: bool) -> grpc.ServerCredentials:
    assert pem.private_key is not None
    assert pem.cert_chain is not None
    return grpc.ssl_server_credentials(
        [(pem.private_key, pem.cert_chain)],
        root_certificates=pem.ca if client_auth else None,
        require_client_auth=client_auth,
    )


def peer_credentials(pem: PemFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pem.ca, private_key=pem.private_key, certificate_chain=pem.cert_chain
    )


def server_ssl_context(tls: NodeTls, pem: PemFiles, where: str) -> ssl.SSLContext:
    """The publish port's TLS (publish_port.py): the client port's certificate, and with
    `client_auth` the client's certificate required and checked against the CA. Raises
    ConfigError naming the certificate when the files do not make a server identity."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.client_auth:
            assert pem.ca is not None
            context.load_verify_locations(cadata=pem.ca.decode("ascii", errors="replace"))
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ValueError) as error:  # ssl.SSLError is an OSError
        raise ConfigError(where, KEY_TLS_CERT, str(tls.cert_file), str(error)) from None
    return context
