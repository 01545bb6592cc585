"""Secure by default for `deploy.local`: TLS and logins unless the operator said otherwise.

`up` runs the nodes from an *effective* cluster.cfg it writes into the run directory
(`<run-dir>/cluster.cfg`, 0600): the operator's cfg rendered with absolute directories
and, when the operator's cfg sets neither TLS nor `authentication`, with
- TLS on every client port: a development CA and one certificate per node, generated on
  first use under `<run-dir>/security/` (deploy/dev_tls.py);
- `authentication=on` and the first admin's password generated into
  `<run-dir>/security/admin.password` (0600; its path is printed, never the password).
`up --insecure` writes the operator's cfg as it is (plaintext; logins as its hosts imply).
Every later command (status, down, restart, rolling-restart, the `hastream` command) reads
the effective cfg, so it speaks to the nodes the way they were started, and clients take
their trust (the CA) and the admin login from it (`client_tls`, `admin_login`).
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from typing import Final

import grpc

from deploy.dev_tls import DevCA
from hastream.files import write_atomic
from hastream.tls import ClientTls
from raftstore import config
from raftstore.access import BOOTSTRAP_ADMIN
from raftstore.config import ClusterConfig, NodeConfig

EFFECTIVE_CONFIG: Final = "cluster.cfg"
SECURITY_DIR: Final = "security"
ADMIN_PASSWORD_FILE: Final = "admin.password"


def effective_config_path(run_dir: Path) -> Path:
    return run_dir / EFFECTIVE_CONFIG


def operator_chose(text: str) -> bool:
    """Whether the operator's cfg text sets TLS or logins itself (then it is kept as is)."""
    keys = {line.partition("=")[0].strip().rsplit(".", 1)[-1] for line in text.splitlines()}
    return bool(keys & {config.KEY_TLS_CERT, config.KEY_AUTHENTICATION})


def write_effective(operator_path: Path, run_dir: Path, *, insecure: bool) -> ClusterConfig:
    """Write and load `<run-dir>/cluster.cfg` for `up` (see the module docstring). Raises
    ConfigError for a bad operator cfg."""
    cluster = config.load(operator_path)
    text = config.render(cluster)
    if not insecure and not operator_chose(operator_path.read_text(encoding="utf-8")):
        rendered = [
            line
            for line in text.splitlines()
            if not line.startswith(f"{config.KEY_AUTHENTICATION}=")  # set below
        ]
        secure = _secure_lines(cluster, run_dir / SECURITY_DIR)
        text = "\n".join([*rendered, "", *secure]) + "\n"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = effective_config_path(run_dir)
    write_atomic(path, text.encode("utf-8"), mode=0o600)
    return config.load(path)


def _secure_lines(cluster: ClusterConfig, directory: Path) -> list[str]:
    ca = DevCA.create(directory)
    lines = []
    for node in cluster.nodes:
        issued = ca.issue(node.alias, tuple(dict.fromkeys((node.host, node.advertised_host))))
        lines += [
            f"{node.alias}.{config.KEY_TLS_CERT}={issued.cert_file}",
            f"{node.alias}.{config.KEY_TLS_KEY}={issued.key_file}",
        ]
    password_file = directory / ADMIN_PASSWORD_FILE
    ensure_password_file(password_file)
    return [
        *lines,
        f"{config.KEY_TLS_CA}={ca.ca_file}",
        f"{config.KEY_AUTHENTICATION}=on",
        f"{config.KEY_ADMIN_PASSWORD_FILE}={password_file}",
    ]


def forget(run_dir: Path) -> None:
    """Remove the effective cfg and the generated CA, certificates and password."""
    effective_config_path(run_dir).unlink(missing_ok=True)
    shutil.rmtree(run_dir / SECURITY_DIR, ignore_errors=True)


def ensure_password_file(path: Path, *, mode: int = 0o600) -> str:
    """The password in `path`, generated there (random, `mode`) on first use."""
    if not path.exists():
        write_atomic(path, (secrets.token_urlsafe(18) + "\n").encode(), mode=mode)
    return path.read_text(encoding="utf-8").strip()


def current_config(operator_path: Path, run_dir: Path) -> ClusterConfig:
    """The cfg the nodes were started with: the run directory's, else the operator's."""
    path = effective_config_path(run_dir)
    return config.load(path if path.exists() else operator_path)


def client_settings(config_path: str | Path) -> tuple[ClientTls | None, tuple[str, str] | None]:
    """(TLS trust, admin login) a client of the cluster.cfg at `config_path` takes from it.
    Raises ConfigError."""
    cluster = config.load(config_path)
    return client_tls(cluster), admin_login(cluster)


def client_tls(cluster: ClusterConfig) -> ClientTls | None:
    """What a client of `cluster` trusts: the nodes' CA (and, with tlsClientAuth=require,
    the first node's certificate as its own: a development convenience)."""
    tls = cluster.nodes[0].tls
    if tls is None:
        return None
    if not tls.client_auth:
        return ClientTls(ca_file=str(tls.ca_file))
    return ClientTls(str(tls.ca_file), str(tls.cert_file), str(tls.key_file))


def admin_login(cluster: ClusterConfig) -> tuple[str, str] | None:
    """The first admin's login, when logins are on and its password file is readable."""
    path = cluster.admin_password_file
    if not cluster.authentication or path is None:
        return None
    try:
        return BOOTSTRAP_ADMIN, path.read_text(encoding="utf-8").strip()
    except OSError:
        return None


def channel(node: NodeConfig) -> grpc.Channel:
    """A channel to `node`'s client port, over TLS when the node serves it."""
    address = f"{node.host}:{node.port}"
    if node.tls is None:
        return grpc.insecure_channel(address)
    ca = node.tls.ca_file.read_bytes()
    if node.tls.client_auth:
        credentials = grpc.ssl_channel_credentials(
            ca, node.tls.key_file.read_bytes(), node.tls.cert_file.read_bytes()
        )
    else:
        credentials = grpc.ssl_channel_credentials(ca)
    return grpc.secure_channel(address, credentials)
