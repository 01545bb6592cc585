"""cluster.cfg -> frozen, validated dataclasses.

The file is DolphinDB style: one `key=value` per line; lines starting with `#` and blank
lines are ignored; whitespace around key and value is stripped; the value runs to the end
of the line (there are no trailing comments, so a secret may contain `#`). Keys:

    streamingHAMode=raft                              required; only "raft"
    streamingRaftGroups=2:node1:node2:node3,3:...     required; groupId (>= 2) then >= 3 aliases
    streamingRaftSecret=...                           required; encrypts Raft traffic and
                                                      signs the nodes' calls to each other
    persistenceDir=data/<ALIAS>/persistence           data files; global or per node
    streamingHADir=data/<ALIAS>/raftlog               Raft log; global or per node
    streamingHAPurgeInterval=300                      seconds between checkpoints (> 0)
    streamingRaftElectionTimeout=1.5                  min election timeout s (max is 2x)
    node1.host=127.0.0.1                              a node is declared by `<alias>.port`
    node1.port=8901                                   client gRPC port
    node1.raftPorts=2:9201,3:9301                     one Raft port per group of the node
    node1.advertisedHost=db1.example.com              optional; default: node1.host
    node1.advertisedPort=18901                        optional; default: node1.port
    node1.persistenceDir=... / node1.streamingHADir=...   per-node overrides
    node1.metricsPort=9101                            optional: Prometheus /metrics and the
                                                      status page, bound on node1.host
    node1.publishPort=8911                            optional: publishes over framed TCP
                                                      (raftstore/publish_port.py), bound on
                                                      node1.host; clients reach it on the
                                                      host they dial. TLS as the client port
    streamingPreferredLeaders=2:node1,3:node2         optional: a group's leader moves back
                                                      to its preferred node when that is healthy
    tlsCertFile=... tlsKeyFile=... tlsCAFile=...      optional, global or per node (`<ALIAS>`
                                                      allowed), all three on every node or on
                                                      none: TLS on the client port; peers
                                                      verify each other with the CA
    tlsClientAuth=none                                or `require`: clients and peers present a
                                                      certificate signed by tlsCAFile (mTLS)
    authentication=on                                 `on`: every client call needs a login
                                                      (users and grants, access.py); `off`:
                                                      anyone reaching the port is admin.
                                                      Default: on when a node binds a
                                                      non-loopback host, else off
    streamingSlowConsumerTimeout=30                   a subscriber that takes no message
                                                      for this long is disconnected
    adminPasswordFile=admin.password                  the first admin's password (user
                                                      `admin`), read at start when the cluster
                                                      has no user yet; or the environment
                                                      variable HASTREAM_ADMIN_PASSWORD

A node binds its gRPC and Raft ports on `host`, and its peers dial `host:port` (catch-up)
and `host:<raft port>`. `advertisedHost:advertisedPort` is what the node is called when
the cluster names it to a CLIENT (NotLeader hints, getStreamingLeader, getStreamingRaftGroups,
GetNodeStatus): the address a client reaches it on, when that differs from the one inside
the cluster (Docker's published ports, NAT), as Kafka's `advertised.listeners`.

`<ALIAS>` in a directory is replaced by the node's alias; relative directories resolve
against the directory holding the cfg file. Every refusal raises `ConfigError(path, key,
value, reason)`. Validation happens once, in `parse`; the dataclasses it returns are
trusted everywhere else. Pure: nothing here reads the environment; only `load` reads a file.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from hastream.errors import ConfigError, UnknownGroup
from hastream.model import NodeAddress
from raftstore import limits

# Global keys and their defaults (None = required).
KEY_MODE: Final = "streamingHAMode"
KEY_GROUPS: Final = "streamingRaftGroups"
KEY_PERSISTENCE_DIR: Final = "persistenceDir"
KEY_HA_DIR: Final = "streamingHADir"
KEY_PURGE_INTERVAL: Final = "streamingHAPurgeInterval"
KEY_SECRET: Final = "streamingRaftSecret"
KEY_ELECTION_TIMEOUT: Final = "streamingRaftElectionTimeout"
KEY_SCRUB_RATE: Final = "streamingScrubRate"
KEY_DIGEST_INTERVAL: Final = "streamingDigestInterval"
KEY_AUTO_REJOIN: Final = "streamingAutoRejoin"
KEY_PREFERRED_LEADERS: Final = "streamingPreferredLeaders"
KEY_TABLES_MAX: Final = "streamingTablesMax"
KEY_AUTHENTICATION: Final = "authentication"  # on | off
KEY_SLOW_CONSUMER_TIMEOUT: Final = "streamingSlowConsumerTimeout"
KEY_ADMIN_PASSWORD_FILE: Final = "adminPasswordFile"
# TLS on the client port (global or per node; all nodes or none): the node's certificate
# and key, and the CA that signed every node's certificate (peers verify each other).
KEY_TLS_CERT: Final = "tlsCertFile"
KEY_TLS_KEY: Final = "tlsKeyFile"
KEY_TLS_CA: Final = "tlsCAFile"
KEY_TLS_CLIENT_AUTH: Final = "tlsClientAuth"  # global: none | require
TLS_FILE_KEYS: Final = (KEY_TLS_CERT, KEY_TLS_KEY, KEY_TLS_CA)
TLS_CLIENT_AUTH_VALUES: Final = ("none", "require")
GLOBAL_KEYS: Final = (
    KEY_MODE,
    KEY_GROUPS,
    KEY_PERSISTENCE_DIR,
    KEY_HA_DIR,
    KEY_PURGE_INTERVAL,
    KEY_SECRET,
    KEY_ELECTION_TIMEOUT,
    KEY_SCRUB_RATE,
    KEY_DIGEST_INTERVAL,
    KEY_AUTO_REJOIN,
    KEY_PREFERRED_LEADERS,
    KEY_TABLES_MAX,
    KEY_AUTHENTICATION,
    KEY_ADMIN_PASSWORD_FILE,
    KEY_SLOW_CONSUMER_TIMEOUT,
    *TLS_FILE_KEYS,
    KEY_TLS_CLIENT_AUTH,
)
# Per-node keys: `<alias>.<field>`.
FIELD_HOST: Final = "host"
FIELD_PORT: Final = "port"
FIELD_RAFT_PORTS: Final = "raftPorts"
FIELD_ADVERTISED_HOST: Final = "advertisedHost"
FIELD_ADVERTISED_PORT: Final = "advertisedPort"
FIELD_METRICS_PORT: Final = "metricsPort"
FIELD_PUBLISH_PORT: Final = "publishPort"
NODE_FIELDS: Final = (
    FIELD_HOST,
    FIELD_PORT,
    FIELD_RAFT_PORTS,
    FIELD_ADVERTISED_HOST,
    FIELD_ADVERTISED_PORT,
    KEY_PERSISTENCE_DIR,
    KEY_HA_DIR,
    FIELD_METRICS_PORT,
    FIELD_PUBLISH_PORT,
    *TLS_FILE_KEYS,
)

HA_MODE_RAFT: Final = "raft"
ALIAS_PLACEHOLDER: Final = "<ALIAS>"
PURGE_INTERVAL_S_DEFAULT: Final = 300.0
ELECTION_TIMEOUT_S_DEFAULT: Final = 1.5
ELECTION_TIMEOUT_S_MIN: Final = 0.2
ELECTION_TIMEOUT_S_MAX: Final = 60.0
# The online scrub re-reads data files at this many MB/s (0 turns it off).
SCRUB_RATE_MB_S_DEFAULT: Final = 8.0
SCRUB_RATE_MB_S_MAX: Final = 10_000.0
# Replicas compare table digests this often (seconds; 0 turns it off).
DIGEST_INTERVAL_S_DEFAULT: Final = 300.0
GROUP_MEMBERS_MIN: Final = 3  # a majority must survive one failure
GROUP_ID_MIN: Final = 2  # as in DolphinDB; 0 is the node-local (non-HA) group
GROUP_ID_MAX: Final = 2**31 - 1  # the proto carries it as int32
PORT_MIN: Final = 1
PORT_MAX: Final = 65535
CONFIG_BYTES_MAX: Final = 1024 * 1024
SECRET_CHARS_MIN_OFF_LOOPBACK: Final = 16  # a cfg file is small; refuse anything absurd

ALIAS_PATTERN: Final = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
HOST_PATTERN: Final = re.compile(r"[A-Za-z0-9._-]{1,253}")  # no ':' (the address separator)
_INTEGER_PATTERN: Final = re.compile(r"[0-9]{1,10}")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    alias: str
    host: str  # binds here; peers dial it
    port: int  # client gRPC port, bound on `host`
    raft_ports: tuple[tuple[int, int], ...]  # (group_id, port), sorted by group
    # What clients are told (NotLeader hints, leader and site answers); default host/port.
    advertised_host: str
    advertised_port: int
    persistence_dir: Path  # absolute, <ALIAS> substituted
    ha_dir: Path  # absolute, <ALIAS> substituted
    # Prometheus metrics and the status page (HTTP, on `host`); None: not served.
    metrics_port: int | None = None
    # The publish port (publish_port.py, on `host`); None: not served.
    publish_port: int | None = None
    # TLS on the client port (and on the calls to its peers); None: plaintext.
    tls: NodeTls | None = None

    def raft_port(self, group_id: int) -> int:
        """This node's Raft port for `group_id`. Asking for a group the node is not in is a
        programmer error (config validation guarantees the ports of its groups)."""
        for group, port in self.raft_ports:
            if group == group_id:
                return port
        raise AssertionError(f"node {self.alias} is not in raft group {group_id}")

    @property
    def group_ids(self) -> tuple[int, ...]:
        return tuple(group for group, _ in self.raft_ports)

    @property
    def address(self) -> NodeAddress:
        """The gRPC endpoint inside the cluster, `host:port:alias`: where the node binds
        and where its peers dial it. Never handed to clients (see `advertised_address`)."""
        return NodeAddress(host=self.host, port=self.port, alias=self.alias)

    @property
    def advertised_address(self) -> NodeAddress:
        """The gRPC endpoint clients are told, `advertisedHost:advertisedPort:alias`."""
        return NodeAddress(host=self.advertised_host, port=self.advertised_port, alias=self.alias)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeTls:
    """A node's TLS files (absolute). `client_auth`: clients and peers must present a
    certificate signed by `ca_file` (mutual TLS)."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    client_auth: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class RaftGroupConfig:
    group_id: int
    members: tuple[str, ...]  # aliases, in cfg order
    # Where leadership goes back to when that node is healthy (streamingPreferredLeaders).
    preferred_leader: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    path: Path  # absolute path of the cfg file (for messages; not rendered)
    ha_mode: str
    groups: tuple[RaftGroupConfig, ...]  # in cfg order
    nodes: tuple[NodeConfig, ...]  # in the order of their `<alias>.port` lines
    purge_interval_s: float
    raft_secret: str = field(repr=False)  # never printed or logged
    election_timeout_s: float  # min election timeout; the max is twice it
    scrub_rate_mb_s: float = SCRUB_RATE_MB_S_DEFAULT
    digest_interval_s: float = DIGEST_INTERVAL_S_DEFAULT
    # A group whose Raft log is damaged rejoins as an empty replica that only catches up
    # (instead of refusing to start until an operator passes --rejoin).
    auto_rejoin: bool = False
    # Tables per node, all groups together: one more is refused (TooManyTables).
    tables_max: int = limits.TABLES_PER_NODE_MAX
    # Every client call needs a login token (auth.py).
    authentication: bool = False
    # The first admin's password (read by the node when the cluster has no user yet).
    admin_password_file: Path | None = None
    # A subscriber that takes no message for this long is disconnected (slow_consumers.py).
    slow_consumer_timeout_s: float = limits.SLOW_CONSUMER_S

    def node(self, alias: str) -> NodeConfig:
        """The node named `alias`; raises ConfigError if the cfg does not declare it."""
        for node in self.nodes:
            if node.alias == alias:
                return node
        raise ConfigError(str(self.path), "node", alias, "unknown node")

    def group(self, group_id: int) -> RaftGroupConfig:
        """The Raft group `group_id`; raises UnknownGroup if the cfg does not declare it."""
        for group in self.groups:
            if group.group_id == group_id:
                return group
        raise UnknownGroup(group_id)

    def groups_of(self, alias: str) -> tuple[RaftGroupConfig, ...]:
        """The groups `alias` is a member of, in cfg order."""
        return tuple(group for group in self.groups if alias in group.members)

    def raft_address(self, alias: str, group_id: int) -> str:
        """`host:port` of the Raft endpoint of `alias` in `group_id` (pysyncobj's address)."""
        node = self.node(alias)
        return f"{node.host}:{node.raft_port(group_id)}"

    def raft_peers(self, alias: str, group_id: int) -> tuple[str, ...]:
        """`host:port` Raft endpoints of the other members of `group_id`, in cfg order."""
        members = self.group(group_id).members
        assert alias in members, f"node {alias} is not in raft group {group_id}"
        return tuple(self.raft_address(peer, group_id) for peer in members if peer != alias)


def load(path: str | Path) -> ClusterConfig:
    """Read and validate the cfg file at `path`. Raises ConfigError (also for I/O errors)."""
    absolute = Path(os.path.abspath(path))
    try:
        with absolute.open("rb") as file:
            data = file.read(CONFIG_BYTES_MAX + 1)
    except OSError as error:
        raise ConfigError(str(absolute), "file", str(path), error.strerror or str(error)) from None
    if len(data) > CONFIG_BYTES_MAX:
        reason = f"larger than {CONFIG_BYTES_MAX} bytes"
        raise ConfigError(str(absolute), "file", str(path), reason)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(str(absolute), "file", str(path), f"not UTF-8: {error}") from None
    return parse(text, absolute)


def parse(text: str, path: Path) -> ClusterConfig:
    """Validate cfg `text`. `path` names the file in errors and anchors relative dirs."""
    path = Path(os.path.abspath(path))
    where = str(path)
    entries = _read_entries(text, where)
    global_values, node_values = _split_keys(entries, where)
    ha_mode = _parse_mode(where, global_values)
    groups = _parse_groups(where, global_values.get(KEY_GROUPS))
    groups = _with_preferred_leaders(where, groups, global_values.get(KEY_PREFERRED_LEADERS))
    _check_members_declared(where, global_values[KEY_GROUPS], groups, node_values)
    nodes = tuple(
        _parse_node(where, path.parent, alias, fields, global_values, groups)
        for alias, fields in node_values.items()
    )
    _check_tls_everywhere_or_nowhere(where, nodes)
    _check_secret_strength(where, global_values.get(KEY_SECRET, ""), nodes)
    _check_ports_unique(where, nodes)
    _check_advertised_unique(where, nodes)
    _check_dirs_disjoint(where, nodes)
    return ClusterConfig(
        path=path,
        ha_mode=ha_mode,
        groups=groups,
        nodes=nodes,
        purge_interval_s=_parse_purge_interval(where, global_values),
        raft_secret=_parse_secret(where, global_values),
        election_timeout_s=_parse_election_timeout(where, global_values),
        scrub_rate_mb_s=_parse_scrub_rate(where, global_values),
        digest_interval_s=_parse_digest_interval(where, global_values),
        auto_rejoin=_parse_bool(where, KEY_AUTO_REJOIN, global_values, default=False),
        tables_max=_parse_tables_max(where, global_values),
        authentication=_parse_authentication(where, global_values, nodes),
        admin_password_file=_parse_admin_password_file(where, path.parent, global_values),
        slow_consumer_timeout_s=_parse_slow_consumer_timeout(where, global_values),
    )


def render(cluster: ClusterConfig) -> str:
    """A cfg text that `parse(text, cluster.path)` reads back to a config equal to `cluster`.

    Directories are written absolute: as one global `<ALIAS>` template when every node
    follows it, else per node. `cluster` must be valid (as `parse` returns them)."""
    lines = [
        "# Generated by raftstore.config.render",
        f"{KEY_MODE}={cluster.ha_mode}",
        f"{KEY_GROUPS}=" + ",".join(_render_group(group) for group in cluster.groups),
        f"{KEY_SECRET}={_renderable(cluster.raft_secret)}",
        f"{KEY_PURGE_INTERVAL}={cluster.purge_interval_s!r}",
        f"{KEY_ELECTION_TIMEOUT}={cluster.election_timeout_s!r}",
        f"{KEY_SCRUB_RATE}={cluster.scrub_rate_mb_s!r}",
        f"{KEY_DIGEST_INTERVAL}={cluster.digest_interval_s!r}",
        f"{KEY_AUTO_REJOIN}={'true' if cluster.auto_rejoin else 'false'}",
        f"{KEY_TABLES_MAX}={cluster.tables_max}",
        f"{KEY_AUTHENTICATION}={'on' if cluster.authentication else 'off'}",
        f"{KEY_SLOW_CONSUMER_TIMEOUT}={cluster.slow_consumer_timeout_s!r}",
    ]
    if cluster.admin_password_file is not None:
        path = _renderable(str(cluster.admin_password_file))
        lines.append(f"{KEY_ADMIN_PASSWORD_FILE}={path}")
    preferred = [g for g in cluster.groups if g.preferred_leader is not None]
    if preferred:
        items = ",".join(f"{g.group_id}:{g.preferred_leader}" for g in preferred)
        lines.append(f"{KEY_PREFERRED_LEADERS}={items}")
    persistence_template = _alias_template([(n.alias, n.persistence_dir) for n in cluster.nodes])
    ha_template = _alias_template([(n.alias, n.ha_dir) for n in cluster.nodes])
    if persistence_template is not None:
        lines.append(f"{KEY_PERSISTENCE_DIR}={_renderable(persistence_template)}")
    if ha_template is not None:
        lines.append(f"{KEY_HA_DIR}={_renderable(ha_template)}")
    for node in cluster.nodes:
        lines.append("")
        lines.append(f"{node.alias}.{FIELD_HOST}={node.host}")
        lines.append(f"{node.alias}.{FIELD_PORT}={node.port}")
        raft_ports = ",".join(f"{group}:{port}" for group, port in node.raft_ports)
        lines.append(f"{node.alias}.{FIELD_RAFT_PORTS}={raft_ports}")
        if node.advertised_host != node.host:
            lines.append(f"{node.alias}.{FIELD_ADVERTISED_HOST}={node.advertised_host}")
        if node.advertised_port != node.port:
            lines.append(f"{node.alias}.{FIELD_ADVERTISED_PORT}={node.advertised_port}")
        if persistence_template is None:
            lines.append(
                f"{node.alias}.{KEY_PERSISTENCE_DIR}={_renderable(str(node.persistence_dir))}"
            )
        if ha_template is None:
            lines.append(f"{node.alias}.{KEY_HA_DIR}={_renderable(str(node.ha_dir))}")
        if node.metrics_port is not None:
            lines.append(f"{node.alias}.{FIELD_METRICS_PORT}={node.metrics_port}")
        if node.publish_port is not None:
            lines.append(f"{node.alias}.{FIELD_PUBLISH_PORT}={node.publish_port}")
        if node.tls is not None:
            lines.append(f"{node.alias}.{KEY_TLS_CERT}={_renderable(str(node.tls.cert_file))}")
            lines.append(f"{node.alias}.{KEY_TLS_KEY}={_renderable(str(node.tls.key_file))}")
            lines.append(f"{node.alias}.{KEY_TLS_CA}={_renderable(str(node.tls.ca_file))}")
    if any(node.tls is not None and node.tls.client_auth for node in cluster.nodes):
        lines.insert(1, f"{KEY_TLS_CLIENT_AUTH}=require")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# Lines and keys


@dataclass(frozen=True, slots=True)
class _Entry:
    value: str
    line: int


_BLANKS: Final = " \t\r\f\v"


def _read_entries(text: str, where: str) -> dict[str, _Entry]:
    """`key -> (value, line number)`; refuses lines without `=`, empty keys, duplicates."""
    entries: dict[str, _Entry] = {}
    # Only "\n" ends a line and only ASCII blanks are stripped (str.splitlines/strip
    # would also cut at Unicode separators, which may appear inside a secret).
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip(_BLANKS)
        if not line or line.startswith("#"):
            continue
        key, separator, value = line.partition("=")
        key, value = key.strip(_BLANKS), value.strip(_BLANKS)
        if not separator or not key:
            raise ConfigError(where, f"line {number}", line, "malformed line; expected key=value")
        if key in entries:
            reason = f"duplicate key (first set on line {entries[key].line})"
            raise ConfigError(where, key, value, reason)
        entries[key] = _Entry(value, number)
    return entries


def _split_keys(
    entries: dict[str, _Entry], where: str
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """Global `key -> value`, and per declared node `alias -> {field -> value}` in the
    order of the nodes' `<alias>.port` lines. Refuses unknown keys and undeclared nodes."""
    global_values: dict[str, str] = {}
    fields_by_alias: dict[str, dict[str, str]] = {}
    port_lines: dict[str, int] = {}
    for key, entry in entries.items():
        if key in GLOBAL_KEYS:
            global_values[key] = entry.value
            continue
        alias, dot, field = key.partition(".")
        if not dot:
            raise ConfigError(where, key, entry.value, _unknown_key_reason(key, GLOBAL_KEYS))
        if ALIAS_PATTERN.fullmatch(alias) is None:
            reason = f"bad node alias {alias!r}; expected {ALIAS_PATTERN.pattern}"
            raise ConfigError(where, key, entry.value, reason)
        if field not in NODE_FIELDS:
            reason = _unknown_key_reason(field, NODE_FIELDS, prefix=f"{alias}.")
            raise ConfigError(where, key, entry.value, reason)
        fields_by_alias.setdefault(alias, {})[field] = entry.value
        if field == FIELD_PORT:
            port_lines[alias] = entry.line
    for alias, fields in fields_by_alias.items():
        if alias not in port_lines:
            key = f"{alias}.{FIELD_PORT}"
            some_key, some_value = next(iter(fields.items()))
            reason = f"missing {key}: {alias}.{some_key}={some_value} names an undeclared node"
            raise ConfigError(where, key, "", reason)
    declared = sorted(port_lines, key=port_lines.__getitem__)
    return global_values, {alias: fields_by_alias[alias] for alias in declared}


def _unknown_key_reason(name: str, known: Iterable[str], prefix: str = "") -> str:
    for candidate in known:
        if candidate.lower() == name.lower():
            return f"unknown key; did you mean {prefix}{candidate}?"
    return "unknown key; expected one of " + ", ".join(prefix + k for k in known)


# ---------------------------------------------------------------------------------------
# Global values


def _required(where: str, key: str, value: str | None) -> str:
    if value is None or value == "":
        raise ConfigError(where, key, value or "", "required key is missing or empty")
    return value


def _parse_mode(where: str, global_values: dict[str, str]) -> str:
    mode = _required(where, KEY_MODE, global_values.get(KEY_MODE))
    if mode != HA_MODE_RAFT:
        raise ConfigError(where, KEY_MODE, mode, f"only {HA_MODE_RAFT!r} is supported")
    return mode


def _parse_secret(where: str, global_values: dict[str, str]) -> str:
    return _required(where, KEY_SECRET, global_values.get(KEY_SECRET))


def _parse_seconds(where: str, key: str, global_values: dict[str, str], default: float) -> float:
    """A finite float of seconds, or `default` when the key is absent."""
    text = global_values.get(key)
    if text is None:
        return default
    try:
        seconds = float(text)
    except ValueError:
        raise ConfigError(where, key, text, "not a number of seconds") from None
    if not math.isfinite(seconds):
        raise ConfigError(where, key, text, "must be a finite number of seconds")
    return seconds


def _parse_purge_interval(where: str, global_values: dict[str, str]) -> float:
    key = KEY_PURGE_INTERVAL
    seconds = _parse_seconds(where, key, global_values, PURGE_INTERVAL_S_DEFAULT)
    if seconds <= 0.0:
        raise ConfigError(where, key, global_values[key], "must be > 0 seconds")
    return seconds


def _parse_election_timeout(where: str, global_values: dict[str, str]) -> float:
    key = KEY_ELECTION_TIMEOUT
    seconds = _parse_seconds(where, key, global_values, ELECTION_TIMEOUT_S_DEFAULT)
    if not ELECTION_TIMEOUT_S_MIN <= seconds <= ELECTION_TIMEOUT_S_MAX:
        reason = f"must be >= {ELECTION_TIMEOUT_S_MIN} and <= {ELECTION_TIMEOUT_S_MAX} seconds"
        raise ConfigError(where, key, global_values[key], reason)
    return seconds


def _parse_scrub_rate(where: str, global_values: dict[str, str]) -> float:
    key = KEY_SCRUB_RATE
    text = global_values.get(key)
    if text is None:
        return SCRUB_RATE_MB_S_DEFAULT
    try:
        rate = float(text)
    except ValueError:
        raise ConfigError(where, key, text, "not a number of MB/s") from None
    if not 0.0 <= rate <= SCRUB_RATE_MB_S_MAX:
        raise ConfigError(where, key, text, f"must be >= 0 and <= {SCRUB_RATE_MB_S_MAX} MB/s")
    return rate


def _parse_digest_interval(where: str, global_values: dict[str, str]) -> float:
    key = KEY_DIGEST_INTERVAL
    seconds = _parse_seconds(where, key, global_values, DIGEST_INTERVAL_S_DEFAULT)
    if seconds < 0.0:
        raise ConfigError(where, key, global_values[key], "must be >= 0 seconds (0: off)")
    return seconds


def _parse_slow_consumer_timeout(where: str, global_values: dict[str, str]) -> float:
    key = KEY_SLOW_CONSUMER_TIMEOUT
    seconds = _parse_seconds(where, key, global_values, limits.SLOW_CONSUMER_S)
    if not 0.0 < seconds <= 3600.0:
        raise ConfigError(where, key, global_values[key], "must be > 0 and <= 3600 seconds")
    return seconds


def _parse_tables_max(where: str, global_values: dict[str, str]) -> int:
    text = global_values.get(KEY_TABLES_MAX)
    if text is None:
        return limits.TABLES_PER_NODE_MAX
    value = _parse_int(where, KEY_TABLES_MAX, text, text, "a number of tables")
    if not 1 <= value <= limits.TABLES_PER_NODE_MAX:
        raise ConfigError(
            where, KEY_TABLES_MAX, text, f"must be >= 1 and <= {limits.TABLES_PER_NODE_MAX}"
        )
    return value


def _parse_authentication(
    where: str, global_values: dict[str, str], nodes: tuple[NodeConfig, ...]
) -> bool:
    """On unless set `off`; by default off only when every node binds loopback (a
    development cluster nobody else can reach)."""
    text = global_values.get(KEY_AUTHENTICATION)
    if text is None:
        return any(not _is_loopback(node.host) for node in nodes)
    if text not in ("on", "off"):
        raise ConfigError(where, KEY_AUTHENTICATION, text, "must be on or off")
    return text == "on"


def _parse_admin_password_file(
    where: str, base: Path, global_values: dict[str, str]
) -> Path | None:
    text = global_values.get(KEY_ADMIN_PASSWORD_FILE)
    if text is None:
        return None
    if not text:
        raise ConfigError(where, KEY_ADMIN_PASSWORD_FILE, text, "must name a file")
    return Path(os.path.abspath(base / text))


def _parse_bool(where: str, key: str, global_values: dict[str, str], *, default: bool) -> bool:
    text = global_values.get(key)
    if text is None:
        return default
    if text.lower() not in ("true", "false"):
        raise ConfigError(where, key, text, "must be true or false")
    return text.lower() == "true"


def _parse_int(where: str, key: str, value: str, text: str, what: str) -> int:
    """A plain decimal integer (no sign, no `_`); `value` is the whole value for messages."""
    if _INTEGER_PATTERN.fullmatch(text) is None:
        raise ConfigError(where, key, value, f"{what} {text!r} is not a decimal integer")
    return int(text)


def _parse_port(where: str, key: str, value: str, text: str) -> int:
    port = _parse_int(where, key, value, text, "port")
    if not PORT_MIN <= port <= PORT_MAX:
        reason = f"port {port} is out of range {PORT_MIN}..{PORT_MAX}"
        raise ConfigError(where, key, value, reason)
    return port


def _parse_group_id(where: str, key: str, value: str, text: str) -> int:
    group_id = _parse_int(where, key, value, text, "group id")
    if not GROUP_ID_MIN <= group_id <= GROUP_ID_MAX:
        reason = f"group id {group_id} must be >= {GROUP_ID_MIN} (and <= {GROUP_ID_MAX})"
        raise ConfigError(where, key, value, reason)
    return group_id


def _parse_groups(where: str, value: str | None) -> tuple[RaftGroupConfig, ...]:
    text = _required(where, KEY_GROUPS, value)
    groups: list[RaftGroupConfig] = []
    for item in text.split(","):
        group = _parse_group(where, text, item.strip())
        if any(seen.group_id == group.group_id for seen in groups):
            reason = f"duplicate group id {group.group_id}"
            raise ConfigError(where, KEY_GROUPS, text, reason)
        groups.append(group)
    return tuple(groups)


def _parse_group(where: str, value: str, item: str) -> RaftGroupConfig:
    """One `groupId:alias:alias:...` item of streamingRaftGroups."""
    if not item:
        raise ConfigError(where, KEY_GROUPS, value, "empty group (stray comma?)")
    group_text, *members = (part.strip() for part in item.split(":"))
    group_id = _parse_group_id(where, KEY_GROUPS, value, group_text)
    for alias in members:
        if ALIAS_PATTERN.fullmatch(alias) is None:
            reason = f"group {group_id}: bad node alias {alias!r}"
            raise ConfigError(where, KEY_GROUPS, value, reason)
    duplicates = sorted({alias for alias in members if members.count(alias) > 1})
    if duplicates:
        reason = f"group {group_id} lists {', '.join(duplicates)} more than once"
        raise ConfigError(where, KEY_GROUPS, value, reason)
    if len(members) < GROUP_MEMBERS_MIN:
        reason = f"group {group_id} has {len(members)} nodes; at least {GROUP_MEMBERS_MIN}"
        raise ConfigError(where, KEY_GROUPS, value, reason)
    return RaftGroupConfig(group_id=group_id, members=tuple(members))


def _with_preferred_leaders(
    where: str, groups: tuple[RaftGroupConfig, ...], value: str | None
) -> tuple[RaftGroupConfig, ...]:
    """`groupId:alias,...`: each named group's preferred leader, a member of it."""
    if value is None:
        return groups
    key = KEY_PREFERRED_LEADERS
    preferred: dict[int, str] = {}
    for item in value.split(","):
        group_text, separator, alias = (part.strip() for part in item.partition(":"))
        if not separator:
            raise ConfigError(where, key, value, f"item {item.strip()!r} is not groupId:alias")
        group_id = _parse_group_id(where, key, value, group_text)
        if group_id in preferred:
            raise ConfigError(where, key, value, f"group {group_id} is listed more than once")
        members = next((g.members for g in groups if g.group_id == group_id), None)
        if members is None:
            raise ConfigError(where, key, value, f"group {group_id} is not in {KEY_GROUPS}")
        if alias not in members:
            reason = f"{alias!r} is not a member of group {group_id} ({', '.join(members)})"
            raise ConfigError(where, key, value, reason)
        preferred[group_id] = alias
    return tuple(
        RaftGroupConfig(
            group_id=g.group_id, members=g.members, preferred_leader=preferred.get(g.group_id)
        )
        for g in groups
    )


def _check_members_declared(
    where: str,
    groups_text: str,
    groups: tuple[RaftGroupConfig, ...],
    node_values: dict[str, dict[str, str]],
) -> None:
    members = {alias for group in groups for alias in group.members}
    for group in groups:
        for alias in group.members:
            if alias not in node_values:
                reason = f"group {group.group_id} member {alias} is not declared ({alias}.port)"
                raise ConfigError(where, KEY_GROUPS, groups_text, reason)
    for alias, fields in node_values.items():
        if alias not in members:
            key = f"{alias}.{FIELD_PORT}"
            raise ConfigError(where, key, fields[FIELD_PORT], f"node {alias} is in no raft group")


# ---------------------------------------------------------------------------------------
# Nodes


def _parse_node(
    where: str,
    base_dir: Path,
    alias: str,
    fields: dict[str, str],
    global_values: dict[str, str],
    groups: tuple[RaftGroupConfig, ...],
) -> NodeConfig:
    host_key = f"{alias}.{FIELD_HOST}"
    host = _parse_host(where, host_key, _required(where, host_key, fields.get(FIELD_HOST)))
    port_key = f"{alias}.{FIELD_PORT}"
    port = _parse_port(where, port_key, fields[FIELD_PORT], fields[FIELD_PORT])
    member_of = tuple(group.group_id for group in groups if alias in group.members)
    raft_ports = _parse_raft_ports(where, alias, fields.get(FIELD_RAFT_PORTS), member_of)
    advertised_host, advertised_port = _parse_advertised(where, alias, fields, host, port)
    persistence_dir = _node_dir(where, base_dir, alias, KEY_PERSISTENCE_DIR, fields, global_values)
    ha_dir = _node_dir(where, base_dir, alias, KEY_HA_DIR, fields, global_values)
    metrics_port = _optional_port(where, alias, FIELD_METRICS_PORT, fields)
    publish_port = _optional_port(where, alias, FIELD_PUBLISH_PORT, fields)
    tls = _parse_tls(where, base_dir, alias, fields, global_values)
    return NodeConfig(
        alias=alias,
        host=host,
        port=port,
        raft_ports=raft_ports,
        advertised_host=advertised_host,
        advertised_port=advertised_port,
        persistence_dir=persistence_dir,
        ha_dir=ha_dir,
        metrics_port=metrics_port,
        publish_port=publish_port,
        tls=tls,
    )


def _optional_port(where: str, alias: str, field_name: str, fields: dict[str, str]) -> int | None:
    text = fields.get(field_name)
    return None if text is None else _parse_port(where, f"{alias}.{field_name}", text, text)


def _parse_tls(
    where: str, base_dir: Path, alias: str, fields: dict[str, str], global_values: dict[str, str]
) -> NodeTls | None:
    """The node's TLS files (each its own override, else the global value; `<ALIAS>`
    substituted): all three, or none. The files are read when the node starts."""
    paths: dict[str, Path] = {}
    for key in TLS_FILE_KEYS:
        value = fields.get(key, global_values.get(key))
        if value is not None and value != "":
            paths[key] = Path(os.path.normpath(base_dir / value.replace(ALIAS_PLACEHOLDER, alias)))
    auth = global_values.get(KEY_TLS_CLIENT_AUTH, "none")
    if auth not in TLS_CLIENT_AUTH_VALUES:
        reason = "expected " + " or ".join(TLS_CLIENT_AUTH_VALUES)
        raise ConfigError(where, KEY_TLS_CLIENT_AUTH, auth, reason)
    if not paths:
        if auth != "none":
            reason = f"needs TLS: set {', '.join(TLS_FILE_KEYS)}"
            raise ConfigError(where, KEY_TLS_CLIENT_AUTH, auth, reason)
        return None
    missing = [key for key in TLS_FILE_KEYS if key not in paths]
    if missing:
        key = f"{alias}.{missing[0]}"
        reason = f"TLS needs {', '.join(TLS_FILE_KEYS)} (global or per node); missing here"
        raise ConfigError(where, key, "", reason)
    return NodeTls(
        cert_file=paths[KEY_TLS_CERT],
        key_file=paths[KEY_TLS_KEY],
        ca_file=paths[KEY_TLS_CA],
        client_auth=auth == "require",
    )


def _check_secret_strength(where: str, secret: str, nodes: tuple[NodeConfig, ...]) -> None:
    """A node reachable from other machines needs a secret that cannot be guessed: the
    secret is all that stands between its Raft port and remote code execution."""
    exposed = [node.alias for node in nodes if not _is_loopback(node.host)]
    if exposed and len(secret) < SECRET_CHARS_MIN_OFF_LOOPBACK:
        reason = (
            f"shorter than {SECRET_CHARS_MIN_OFF_LOOPBACK} characters while {exposed[0]} binds "
            "a non-loopback host; use a long random secret (python -c 'import secrets; "
            "print(secrets.token_urlsafe(24))')"
        )
        raise ConfigError(where, KEY_SECRET, "<hidden>", reason)


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.")


def _check_tls_everywhere_or_nowhere(where: str, nodes: tuple[NodeConfig, ...]) -> None:
    """Peers call each other's client port: a plaintext node could not reach a TLS one."""
    plain = [node.alias for node in nodes if node.tls is None]
    if plain and len(plain) < len(nodes):
        key = f"{plain[0]}.{KEY_TLS_CERT}"
        reason = "TLS is set for some nodes only: set it for all (or none)"
        raise ConfigError(where, key, "", reason)


def _parse_host(where: str, key: str, host: str) -> str:
    if HOST_PATTERN.fullmatch(host) is None:
        reason = "bad host; expected a name or IPv4 address (letters, digits, '.', '-', '_')"
        raise ConfigError(where, key, host, reason)
    return host


def _parse_advertised(
    where: str, alias: str, fields: dict[str, str], host: str, port: int
) -> tuple[str, int]:
    """`(advertisedHost, advertisedPort)`; each defaults to the node's `host`/`port`. Set
    but empty is refused: a key that says nothing is more likely a mistake than a default."""
    advertised_host, advertised_port = host, port
    host_text = fields.get(FIELD_ADVERTISED_HOST)
    if host_text is not None:
        key = f"{alias}.{FIELD_ADVERTISED_HOST}"
        if host_text == "":
            reason = f"empty; remove the key to advertise {alias}.{FIELD_HOST}"
            raise ConfigError(where, key, host_text, reason)
        advertised_host = _parse_host(where, key, host_text)
    port_text = fields.get(FIELD_ADVERTISED_PORT)
    if port_text is not None:
        key = f"{alias}.{FIELD_ADVERTISED_PORT}"
        if port_text == "":
            reason = f"empty; remove the key to advertise {alias}.{FIELD_PORT}"
            raise ConfigError(where, key, port_text, reason)
        advertised_port = _parse_port(where, key, port_text, port_text)
    return advertised_host, advertised_port


def _parse_raft_ports(
    where: str, alias: str, value: str | None, member_of: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
    """`groupId:port,...` -> sorted (group, port) pairs, exactly one per group of the node."""
    key = f"{alias}.{FIELD_RAFT_PORTS}"
    text = _required(where, key, value)
    ports: dict[int, int] = {}
    for item in text.split(","):
        group_text, separator, port_text = item.strip().partition(":")
        if not separator:
            raise ConfigError(where, key, text, f"item {item.strip()!r} is not groupId:port")
        group_id = _parse_group_id(where, key, text, group_text.strip())
        if group_id in ports:
            raise ConfigError(where, key, text, f"group {group_id} is listed more than once")
        if group_id not in member_of:
            reason = f"node {alias} is not a member of group {group_id} ({KEY_GROUPS})"
            raise ConfigError(where, key, text, reason)
        ports[group_id] = _parse_port(where, key, text, port_text.strip())
    missing = [group_id for group_id in member_of if group_id not in ports]
    if missing:
        reason = f"no Raft port for group(s) {', '.join(map(str, missing))} of node {alias}"
        raise ConfigError(where, key, text, reason)
    return tuple(sorted(ports.items()))


def _node_dir(
    where: str,
    base_dir: Path,
    alias: str,
    dir_key: str,
    fields: dict[str, str],
    global_values: dict[str, str],
) -> Path:
    """The node's `dir_key` directory: its own override, else the global value; `<ALIAS>`
    substituted, relative paths resolved against the cfg file's directory (lexically)."""
    node_key = f"{alias}.{dir_key}"
    if dir_key in fields:
        key, value = node_key, fields[dir_key]
    elif dir_key in global_values:
        key, value = dir_key, global_values[dir_key]
    else:
        key, value = node_key, ""
    if value == "":
        reason = f"required: set {dir_key} (may use {ALIAS_PLACEHOLDER}) or {node_key}"
        raise ConfigError(where, key, value, reason)
    substituted = value.replace(ALIAS_PLACEHOLDER, alias)
    return Path(os.path.normpath(base_dir / substituted))


def _check_ports_unique(where: str, nodes: tuple[NodeConfig, ...]) -> None:
    """No two endpoints (client, Raft, metrics or publish, any node) on one host share a
    port."""
    owners: dict[tuple[str, int], str] = {}
    for node in nodes:
        endpoints = [(f"{node.alias}.{FIELD_PORT}", node.port, str(node.port))]
        raft_text = ",".join(f"{group}:{port}" for group, port in node.raft_ports)
        raft_key = f"{node.alias}.{FIELD_RAFT_PORTS}"
        endpoints += [(raft_key, port, raft_text) for _, port in node.raft_ports]
        for field_name, optional in (
            (FIELD_METRICS_PORT, node.metrics_port),
            (FIELD_PUBLISH_PORT, node.publish_port),
        ):
            if optional is not None:
                endpoints.append((f"{node.alias}.{field_name}", optional, str(optional)))
        for key, port, value in endpoints:
            slot = (node.host.lower(), port)
            if slot in owners:
                reason = f"port {port} on host {node.host} is already used by {owners[slot]}"
                raise ConfigError(where, key, value, reason)
            owners[slot] = key


def _advertised_key(node: NodeConfig) -> tuple[str, str]:
    """The key (and its value) that sets the node's advertised address: the most specific
    one that differs from the default, for messages."""
    if node.advertised_port != node.port:
        return f"{node.alias}.{FIELD_ADVERTISED_PORT}", str(node.advertised_port)
    if node.advertised_host != node.host:
        return f"{node.alias}.{FIELD_ADVERTISED_HOST}", node.advertised_host
    return f"{node.alias}.{FIELD_PORT}", str(node.port)


def _check_advertised_unique(where: str, nodes: tuple[NodeConfig, ...]) -> None:
    """No two nodes advertise one `host:port`: a client told to go to the leader would
    reach whichever node holds that address, and could never reach the other."""
    owners: dict[tuple[str, int], NodeConfig] = {}
    for node in nodes:
        slot = (node.advertised_host.lower(), node.advertised_port)
        other = owners.get(slot)
        if other is not None:
            key, value = _advertised_key(node)
            other_key, other_value = _advertised_key(other)
            endpoint = f"{node.advertised_host}:{node.advertised_port}"
            reason = (
                f"client address {endpoint} is also advertised by {other.alias} "
                f"({other_key}={other_value})"
            )
            raise ConfigError(where, key, value, reason)
        owners[slot] = node


def _check_dirs_disjoint(where: str, nodes: tuple[NodeConfig, ...]) -> None:
    """No two directories (data or Raft log, any nodes) are equal or nested in each other:
    a node owns its directories alone, and its data files never mix with a Raft log."""
    seen: list[tuple[str, Path]] = []
    for node in nodes:
        for dir_key, directory in (
            (KEY_PERSISTENCE_DIR, node.persistence_dir),
            (KEY_HA_DIR, node.ha_dir),
        ):
            key = f"{node.alias}.{dir_key}"
            for other_key, other in seen:
                if directory == other:
                    reason = f"directory is also {other_key}"
                elif directory.is_relative_to(other) or other.is_relative_to(directory):
                    reason = f"directory is nested with {other_key}={other}"
                else:
                    continue
                raise ConfigError(where, key, str(directory), reason)
            seen.append((key, directory))


# ---------------------------------------------------------------------------------------
# Rendering


def _render_group(group: RaftGroupConfig) -> str:
    return ":".join([str(group.group_id), *group.members])


def _renderable(value: str) -> str:
    assert value == value.strip(_BLANKS), f"value {value!r} has surrounding blanks"
    assert "\n" not in value, "a cfg value cannot span lines"
    return value


def _alias_template(dirs: list[tuple[str, Path]]) -> str | None:
    """One `<ALIAS>` template that yields every node's directory, if there is one."""
    templates = {str(directory).replace(alias, ALIAS_PLACEHOLDER) for alias, directory in dirs}
    if len(templates) != 1:
        return None
    template = templates.pop()
    if ALIAS_PLACEHOLDER not in template and len(dirs) > 1:
        return None
    for alias, directory in dirs:
        if template.replace(ALIAS_PLACEHOLDER, alias) != str(directory):
            return None
    return template
