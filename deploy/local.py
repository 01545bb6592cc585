"""Local process deployment (the default): every node of cluster.cfg as a process here.

    python -m deploy.local up      [--config cluster.cfg] [--run-dir .run] [NODE]
    python -m deploy.local down    [...] [NODE]
    python -m deploy.local status  [...] [NODE]
    python -m deploy.local kill    [...] NODE     SIGKILL, for failure drills
    python -m deploy.local restart [...] NODE     stop (if running), start, wait until ready
    python -m deploy.local rolling-restart [...]  every node in turn, leadership moved first

Each node runs `python -m raftstore --config <cfg> --node <alias>` in its own session (so
it outlives this command), with stdout and stderr appended to `<run-dir>/<alias>.log` and
its pid in `<run-dir>/<alias>.pid`. A node is ready when it logs `NODE READY alias=<alias>`
after the latest start marker this tool writes to the log; `up` then waits until every Raft
group reports a leader. `up` is idempotent: running nodes are left alone.

The functions are importable (`start_node`, `stop_node`, `node_pids`, `wait_ready`,
`wait_leaders`, `wait_until`) so tests and tools drive clusters the same way.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import grpc

from api_clients import Session
from deploy import local_security, rolling
from hastream.errors import ConfigError, RaftStoreError
from proto import hastream_pb2, hastream_pb2_grpc
from raftstore import config
from raftstore.config import ClusterConfig, NodeConfig

log = logging.getLogger(__name__)

REPO_ROOT: Final = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 15.0
KILL_TIMEOUT_S: Final = 5.0
RPC_TIMEOUT_S: Final = 2.0
POLL_INTERVAL_S: Final = 0.1
LOG_SCAN_BYTES_MAX: Final = 4 * 1024 * 1024  # readiness looks at the log's tail only
LOG_TAIL_LINES: Final = 40
START_MARKER: Final = "=== deploy.local: starting node"
ACTIONS: Final = ("up", "down", "status", "kill", "restart", "rolling-restart")


class DeployError(Exception):
    """The deployment did not reach the state asked for (a timeout, a missing node)."""


class NodeExited(DeployError):
    """A node process exited before it was ready. `log_tail` holds its last log lines."""

    def __init__(self, alias: str, log_file: Path, log_tail: str) -> None:
        self.alias = alias
        self.log_file = log_file
        self.log_tail = log_tail
        super().__init__(f"node {alias} exited before it was ready (log: {log_file})")


# ---------------------------------------------------------------------------------------
# Polling, files and processes


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, interval_s: float = POLL_INTERVAL_S
) -> bool:
    """Poll `predicate` until it returns True (-> True) or `timeout_s` passes (-> False).
    Exceptions from `predicate` propagate, so a predicate can fail fast."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(interval_s, remaining))


def log_path(run_dir: Path, alias: str) -> Path:
    return run_dir / f"{alias}.log"


def pid_path(run_dir: Path, alias: str) -> Path:
    return run_dir / f"{alias}.pid"


def read_pid(run_dir: Path, alias: str) -> int | None:
    """The pid recorded for `alias`, alive or not; None without a readable pid file."""
    try:
        return int(pid_path(run_dir, alias).read_text().strip())
    except (OSError, ValueError):
        return None


def process_alive(pid: int) -> bool:
    """Whether `pid` is a running (not zombie) process. Reaps it if it is our dead child."""
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass  # not our child: ask the kernel instead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _proc_state(pid) != "Z"


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None  # no /proc (not Linux) or gone
    return stat.rsplit(")", 1)[-1].split()[0]


def _is_node_process(pid: int, alias: str) -> bool:
    """Guards against a recycled pid: the process must be `-m raftstore ... --node alias`.
    Without /proc (not Linux) the pid file is trusted."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except OSError:
        return False
    if argv == [b""]:
        # No command line yet: a process we just started can be caught inside its exec
        # (seen under load). It is alive (checked before), so trust the pid file.
        return True
    words = [word.decode(errors="replace") for word in argv]
    return "raftstore" in words and any(
        word == "--node" and index + 1 < len(words) and words[index + 1] == alias
        for index, word in enumerate(words)
    )


def node_pid(run_dir: Path, alias: str) -> int | None:
    """The pid of the running node `alias` started from `run_dir`; None if not running."""
    pid = read_pid(run_dir, alias)
    if pid is None or not process_alive(pid) or not _is_node_process(pid, alias):
        return None
    return pid


def node_pids(cluster: ClusterConfig, run_dir: Path) -> dict[str, int | None]:
    """alias -> pid of its running process, or None, for every node of `cluster`."""
    return {node.alias: node_pid(run_dir, node.alias) for node in cluster.nodes}


def node_command(cluster: ClusterConfig, alias: str) -> list[str]:
    return [sys.executable, "-m", "raftstore", "--config", str(cluster.path), "--node", alias]


def start_node(cluster: ClusterConfig, alias: str, run_dir: Path) -> int:
    """Start node `alias` detached (own session) and record its pid. Does not wait for it
    to be ready (see `wait_ready`); does not check whether it already runs (see `up`)."""
    cluster.node(alias)  # raises ConfigError for an unknown alias
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if part
    )
    env["PYTHONUNBUFFERED"] = "1"
    with log_path(run_dir, alias).open("ab") as log_file:
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        log_file.write(f"{START_MARKER} alias={alias} at {stamp}\n".encode())
        log_file.flush()
        process = subprocess.Popen(
            node_command(cluster, alias),
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _write_pid(run_dir, alias, process.pid)
    log.info("started node alias=%s pid=%d", alias, process.pid)
    return process.pid


def _write_pid(run_dir: Path, alias: str, pid: int) -> None:
    path = pid_path(run_dir, alias)
    temporary = path.with_suffix(".pid.tmp")
    temporary.write_text(f"{pid}\n")
    temporary.replace(path)


def _signal(pid: int, sig: signal.Signals) -> None:
    """Signal the node's whole process group (it leads its own session)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_node(run_dir: Path, alias: str, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """SIGTERM node `alias`, wait up to `timeout_s` for it to exit, then SIGKILL; remove
    its pid file. Returns whether a running process was stopped."""
    pid = node_pid(run_dir, alias)
    if pid is not None:
        _signal(pid, signal.SIGTERM)
        if not wait_until(lambda: not process_alive(pid), timeout_s):
            log.warning("node did not exit on SIGTERM alias=%s pid=%d; SIGKILL", alias, pid)
            _signal(pid, signal.SIGKILL)
            if not wait_until(lambda: not process_alive(pid), KILL_TIMEOUT_S):
                raise DeployError(f"node {alias} (pid {pid}) survived SIGKILL")
        log.info("stopped node alias=%s pid=%d", alias, pid)
    pid_path(run_dir, alias).unlink(missing_ok=True)
    return pid is not None


def kill_node(run_dir: Path, alias: str) -> int | None:
    """SIGKILL node `alias` (a crash, for drills) and wait until it is gone. The pid file
    stays, so `status` shows the node as dead. Returns the killed pid, None if not running."""
    pid = node_pid(run_dir, alias)
    if pid is None:
        return None
    _signal(pid, signal.SIGKILL)
    if not wait_until(lambda: not process_alive(pid), KILL_TIMEOUT_S):
        raise DeployError(f"node {alias} (pid {pid}) survived SIGKILL")
    log.info("killed node alias=%s pid=%d", alias, pid)
    return pid


# ---------------------------------------------------------------------------------------
# Readiness


def ready_in_log(text: str, alias: str) -> bool:
    """Whether `text` (a node log, or its tail) shows `NODE READY alias=<alias>` after the
    latest start marker, i.e. for the current run and not an earlier one."""
    marker = text.rfind(START_MARKER)
    current = text if marker < 0 else text[marker:]
    pattern = rf"NODE READY alias={re.escape(alias)}(?![A-Za-z0-9_-])"
    return re.search(pattern, current) is not None


def _read_log_tail(path: Path, size_max: int) -> str:
    try:
        with path.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - size_max))
            return file.read(size_max).decode(errors="replace")
    except FileNotFoundError:
        return ""


def log_shows_ready(run_dir: Path, alias: str) -> bool:
    # A tail without any marker lies wholly after the latest marker: still the current run.
    return ready_in_log(_read_log_tail(log_path(run_dir, alias), LOG_SCAN_BYTES_MAX), alias)


def log_tail(run_dir: Path, alias: str, lines: int = LOG_TAIL_LINES) -> str:
    text = _read_log_tail(log_path(run_dir, alias), 64 * 1024)
    return "\n".join(text.splitlines()[-lines:])


def wait_ready(
    cluster: ClusterConfig,
    run_dir: Path,
    aliases: Iterable[str] | None = None,
    timeout_s: float = READY_TIMEOUT_S,
) -> None:
    """Wait until every node in `aliases` (default: all) logged its ready line.
    Raises NodeExited as soon as one is not running, DeployError on timeout."""
    pending = {node.alias for node in cluster.nodes} if aliases is None else set(aliases)

    def all_ready() -> bool:
        for alias in sorted(pending):
            if log_shows_ready(run_dir, alias):
                pending.discard(alias)
            elif node_pid(run_dir, alias) is None:
                raise NodeExited(alias, log_path(run_dir, alias), log_tail(run_dir, alias))
        return not pending

    if not wait_until(all_ready, timeout_s):
        raise DeployError(f"not ready after {timeout_s:.0f}s: {', '.join(sorted(pending))}")


# ---------------------------------------------------------------------------------------
# gRPC probes


def _stub(channel: grpc.Channel) -> Any:
    return hastream_pb2_grpc.StreamTableStub(channel)


def query_leader(node: NodeConfig, group_id: int) -> str | None:
    """The leader (`host:port:alias`) of `group_id` as `node` sees it; None if it does
    not know one or cannot be reached within RPC_TIMEOUT_S."""
    with local_security.channel(node) as channel:
        try:
            request = hastream_pb2.GroupRequest(raft_group=group_id)
            reply = _stub(channel).GetStreamingLeader(request, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError:
            return None
    leader: str = reply.leader
    return leader or None


def group_leader(cluster: ClusterConfig, group_id: int) -> str | None:
    """The leader of `group_id`, confirmed by the leader itself: a member's answer alone
    can name a leader that has just died (followers keep it until an election)."""
    for alias in cluster.group(group_id).members:
        hint = query_leader(cluster.node(alias), group_id)
        if hint is None:
            continue
        leader_alias = hint.rsplit(":", 1)[-1]
        members = cluster.group(group_id).members
        if leader_alias in members and query_leader(cluster.node(leader_alias), group_id) == hint:
            return hint
    return None


def wait_leaders(cluster: ClusterConfig, timeout_s: float = READY_TIMEOUT_S) -> dict[int, str]:
    """Wait until every Raft group reports a leader; group id -> `host:port:alias`.
    Raises DeployError on timeout."""
    leaders: dict[int, str] = {}

    def all_led() -> bool:
        for group in cluster.groups:
            if group.group_id not in leaders:
                leader = group_leader(cluster, group.group_id)
                if leader is not None:
                    leaders[group.group_id] = leader
        return len(leaders) == len(cluster.groups)

    if not wait_until(all_led, timeout_s, interval_s=0.25):
        missing = [str(group.group_id) for group in cluster.groups if group.group_id not in leaders]
        raise DeployError(f"no leader after {timeout_s:.0f}s for group(s) {', '.join(missing)}")
    return leaders


def query_status(node: NodeConfig) -> dict[str, Any] | str:
    """The node's GetNodeStatus document, or a short reason why it could not be had."""
    with local_security.channel(node) as channel:
        try:
            reply = _stub(channel).GetNodeStatus(hastream_pb2.Empty(), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else None
            return f"unreachable ({code.name if code is not None else 'error'})"
    try:
        document = json.loads(reply.json)
    except ValueError:
        return "bad status document"
    return document if isinstance(document, dict) else "bad status document"


# ---------------------------------------------------------------------------------------
# Status rendering (pure)


@dataclass(frozen=True, slots=True)
class NodeState:
    alias: str
    pid: int | None  # from the pid file
    alive: bool
    status: dict[str, Any] | str  # GetNodeStatus document, or why it is missing


def format_status(cluster: ClusterConfig, states: Sequence[NodeState]) -> str:
    """A readable table: one row per node, then per group its leader and each member's
    role, term, commit index, last applied, log length and tables."""
    lines = [_row(_NODE_WIDTHS, "NODE", "PID", "PROCESS", "ADDRESS", "GRPC")]
    for state in states:
        address = str(cluster.node(state.alias).address)
        grpc_text = "ok" if isinstance(state.status, dict) else state.status
        process = "alive" if state.alive else ("dead" if state.pid is not None else "stopped")
        lines.append(_row(_NODE_WIDTHS, state.alias, _text(state.pid), process, address, grpc_text))
    for group in cluster.groups:
        rows = {state.alias: _group_entry(state.status, group.group_id) for state in states}
        lines += ["", f"GROUP {group.group_id}  leader: {_leader_text(cluster, rows)}"]
        header = ("  NODE", "ROLE", "TERM", "COMMIT", "APPLIED", "LOG", "TABLES")
        lines.append(_row(_GROUP_WIDTHS, *header))
        for alias in group.members:
            row = rows.get(alias)
            if not row:
                lines.append(_row(_GROUP_WIDTHS, f"  {alias}", *"-----", "unreachable"))
                continue
            tables = ",".join(str(table) for table in row.get("tables", [])) or "-"
            fields = ("role", "term", "commit_index", "last_applied", "log_len")
            values = (_text(row.get(field)) for field in fields)
            lines.append(_row(_GROUP_WIDTHS, f"  {alias}", *values, tables))
    return "\n".join(lines)


def _leader_text(cluster: ClusterConfig, rows: dict[str, dict[str, Any] | None]) -> str:
    """The members that say they lead; else the leader the others name, marked unconfirmed
    (it may have just died: followers keep naming it until an election)."""
    leading = [alias for alias, row in rows.items() if row and row.get("role") == "leader"]
    if leading:
        # As the nodes name each other (to clients): the advertised address.
        return " | ".join(str(cluster.node(alias).advertised_address) for alias in leading)
    named = sorted({str(row.get("leader") or "") for row in rows.values() if row} - {""})
    if named:
        return f"unconfirmed ({' | '.join(named)} is named but does not answer as leader)"
    return "none (election running or no quorum)"


def _group_entry(status: dict[str, Any] | str, group_id: int) -> dict[str, Any] | None:
    if not isinstance(status, dict):
        return None
    for entry in status.get("groups", []):
        if isinstance(entry, dict) and entry.get("raft_group") == group_id:
            return entry
    return None


def _text(value: object) -> str:
    return "-" if value is None else str(value)


_NODE_WIDTHS: Final = (12, 8, 8, 28)
_GROUP_WIDTHS: Final = (12, 10, 6, 8, 8, 8)


def _row(widths: tuple[int, ...], *cells: str) -> str:
    """Cells padded to `widths`; cells beyond them are appended as they are."""
    padded = [cell.ljust(width) for cell, width in zip(cells, widths, strict=False)]
    return " ".join(padded + list(cells[len(widths) :])).rstrip()


# ---------------------------------------------------------------------------------------
# Commands


def up(cluster: ClusterConfig, run_dir: Path, aliases: Sequence[str]) -> None:
    for alias in aliases:
        pid = node_pid(run_dir, alias)
        if pid is not None:
            print(f"{alias}: already running (pid {pid})")
            continue
        pid = start_node(cluster, alias, run_dir)
        print(f"{alias}: started (pid {pid}, log {log_path(run_dir, alias)})")
    wait_ready(cluster, run_dir, aliases)
    print(f"ready: {', '.join(aliases)}")
    if len(aliases) == len(cluster.nodes):
        for group_id, leader in sorted(wait_leaders(cluster).items()):
            print(f"group {group_id}: leader {leader}")


def down(run_dir: Path, aliases: Sequence[str], wipe: Sequence[NodeConfig] = ()) -> None:
    """Stop the nodes; with `wipe`, then delete those nodes' data and Raft directories (a
    fresh cluster at the next `up`: every table and row gone)."""
    for alias in aliases:
        stopped = stop_node(run_dir, alias)
        print(f"{alias}: {'stopped' if stopped else 'not running'}")
    for node in wipe:
        for directory in (node.persistence_dir, node.ha_dir):
            if directory.exists():
                shutil.rmtree(directory)
                print(f"{node.alias}: removed {directory}")


def status(cluster: ClusterConfig, run_dir: Path, aliases: Sequence[str]) -> bool:
    """Print the status table; returns whether every node answered."""
    states = [
        NodeState(
            alias=alias,
            pid=read_pid(run_dir, alias),
            alive=node_pid(run_dir, alias) is not None,
            status=query_status(cluster.node(alias)),
        )
        for alias in aliases
    ]
    print(format_status(cluster, states))
    return all(isinstance(state.status, dict) for state in states)


def kill(run_dir: Path, alias: str) -> None:
    pid = kill_node(run_dir, alias)
    print(f"{alias}: killed (pid {pid})" if pid is not None else f"{alias}: not running")


def restart(cluster: ClusterConfig, run_dir: Path, alias: str) -> None:
    stop_node(run_dir, alias)
    pid = start_node(cluster, alias, run_dir)
    wait_ready(cluster, run_dir, [alias])
    wait_caught_up(cluster, alias)
    print(f"{alias}: restarted and ready (pid {pid})")


@dataclass
class LocalNodes:
    """The processes `deploy.local` runs from `run_dir` for `cluster`."""

    cluster: ClusterConfig
    run_dir: Path
    timeout_s: float = READY_TIMEOUT_S

    def aliases(self) -> list[str]:
        return [node.alias for node in self.cluster.nodes]

    def site(self, alias: str) -> str:
        address = self.cluster.node(alias).advertised_address
        return f"{address.host}:{address.port}"

    def restart(self, alias: str) -> None:
        if node_pid(self.run_dir, alias) is None:
            raise rolling.RollingRestartError(f"{alias} is not running (from {self.run_dir})")
        try:
            stop_node(self.run_dir, alias)
            start_node(self.cluster, alias, self.run_dir)
            wait_ready(self.cluster, self.run_dir, [alias], self.timeout_s)
            wait_caught_up(self.cluster, alias, self.timeout_s)
        except DeployError as error:
            raise rolling.RollingRestartError(f"{alias}: {error}") from error


def local_nodes(config_path: str | Path, run_dir: Path) -> LocalNodes:
    """The deploy.local processes of the cluster.cfg at `config_path`. Raises ConfigError."""
    return LocalNodes(config.load(config_path), run_dir.absolute())


def rolling_restart(cluster: ClusterConfig, run_dir: Path) -> None:
    """Restart every node in turn, leadership handed over first (deploy/rolling.py)."""
    control = LocalNodes(cluster, run_dir)
    login = local_security.admin_login(cluster)
    with Session(
        rolling.sites_of(control),
        tls=local_security.client_tls(cluster),
        userid=None if login is None else login[0],
        password=None if login is None else login[1],
    ) as session:
        for step in rolling.rolling_restart(session, control):
            print(rolling.describe(step), flush=True)
    print("rolling restart done")


def caught_up(cluster: ClusterConfig, alias: str, targets: dict[int, int] | None = None) -> bool:
    """Every group of node `alias` has a leader, the node is healthy in it, and it has
    applied everything the leader had committed when first asked. `targets` (group ->
    that commit index) carries the first answer across polls: under a steady load the
    leader's commit index moves on, and a follower always just behind it is caught up."""
    targets = {} if targets is None else targets
    status = query_status(cluster.node(alias))
    for group in cluster.groups_of(alias):
        entry = _group_entry(status, group.group_id)
        if entry is None or not entry.get("leader"):
            return False
        if entry.get("health", {}).get("state", "healthy") != "healthy":
            return False
        if group.group_id not in targets:
            leader_alias = str(entry["leader"]).rsplit(":", 1)[-1]
            leader = _group_entry(query_status(cluster.node(leader_alias)), group.group_id)
            if leader is None or leader.get("role") != "leader":
                return False
            targets[group.group_id] = int(leader.get("commit_index", 0))
        if int(entry.get("last_applied", 0)) < targets[group.group_id]:
            return False
    return True


def wait_caught_up(cluster: ClusterConfig, alias: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until `caught_up`; raises DeployError on timeout."""
    targets: dict[int, int] = {}
    if not wait_until(lambda: caught_up(cluster, alias, targets), timeout_s, interval_s=0.2):
        raise DeployError(f"{alias} did not catch up with its groups' leaders in {timeout_s:.0f}s")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.local", description="Run a cluster.cfg cluster as local processes."
    )
    parser.add_argument("action", choices=ACTIONS)
    parser.add_argument("node", nargs="?", default=None, help="one node alias (default: all)")
    parser.add_argument("--config", type=Path, default=Path("cluster.cfg"))
    parser.add_argument("--run-dir", type=Path, default=Path(".run"), help="pid and log files")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="up: plaintext, logins as the cfg says (default: TLS and logins, generated)",
    )
    parser.add_argument(
        "--wipe",
        action="store_true",
        help="down: also delete the nodes' data and Raft directories (every table is gone)",
    )
    args = parser.parse_args(argv)
    if args.wipe and args.action != "down":
        parser.error("--wipe goes with down")
    if args.insecure and args.action != "up":
        parser.error("--insecure goes with up")
    if args.action in ("kill", "restart") and args.node is None:
        parser.error(f"{args.action} needs a NODE")
    args.run_dir = args.run_dir.absolute()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point. Exit codes: 0 ok, 1 deployment failed, 2 bad config or node."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        if args.action == "up":
            cluster = local_security.write_effective(
                args.config, args.run_dir, insecure=args.insecure
            )
            _describe_security(cluster)
        else:
            cluster = local_security.current_config(args.config, args.run_dir)
        aliases = [args.node] if args.node else [node.alias for node in cluster.nodes]
        for alias in aliases:
            cluster.node(alias)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        if args.wipe:
            down(args.run_dir, aliases, [cluster.node(alias) for alias in aliases])
            if len(aliases) == len(cluster.nodes):  # a fresh cluster: fresh secrets too
                local_security.forget(args.run_dir)
            return 0
        return _run(args.action, cluster, args.run_dir, aliases)
    except NodeExited as error:
        print(f"error: {error}; last lines:\n{error.log_tail}", file=sys.stderr)
        print("nodes that did start are left running; `down` stops them", file=sys.stderr)
    except (DeployError, RaftStoreError) as error:
        print(f"error: {error}", file=sys.stderr)
    return 1


def _describe_security(cluster: ClusterConfig) -> None:
    tls = local_security.client_tls(cluster)
    trust = "plaintext" if tls is None else f"TLS (CA {tls.ca_file})"
    logins = "logins off"
    if cluster.authentication:
        where = cluster.admin_password_file
        logins = f"logins on: user admin, password in {where}"
    print(f"security: {trust}, {logins}; cfg {cluster.path}")


def _run(action: str, cluster: ClusterConfig, run_dir: Path, aliases: list[str]) -> int:
    if action == "up":
        up(cluster, run_dir, aliases)
    elif action == "down":
        down(run_dir, aliases)
    elif action == "status":
        return 0 if status(cluster, run_dir, aliases) else 1
    elif action == "kill":
        kill(run_dir, aliases[0])
    elif action == "rolling-restart":
        rolling_restart(cluster, run_dir)
    else:
        assert action == "restart", action
        restart(cluster, run_dir, aliases[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
