"""The import layers, read from the source with `ast` (every import: module level, inside
functions and under TYPE_CHECKING alike):

    hastream (leaf)  <-  api_clients  <-  spark_publisher  <-  pyspark_hastream
    hastream (leaf)  <-  raftstore
    api_clients, deploy (the tools)  <-  hastream_cli (the `hastream` command)

The client side never imports the node, nor the node the client. Protocol buffers stay at
the edges: the client's `api_clients/` and the node's gRPC servicer and peer client.
pysyncobj stays in raftstore/replication.py (ruff's banned-api cannot say so for raftstore/,
which it exempts as a whole from the `raftstore` ban). Inside the shared and client packages
modules import each other without cycles, and never from inside a function (a lazy import
would only hide a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("hastream", "api_clients", "spark_publisher", "raftstore", "hastream_cli")
PROJECT = {*PACKAGES, "proto", "deploy", "bench", "tests", "pyspark_hastream"}

# What each layer may import of the project (besides itself).
ALLOWED: dict[str, set[str]] = {
    "hastream": set(),
    "api_clients": {"hastream", "proto"},
    "spark_publisher": {"hastream", "api_clients"},
    "raftstore": {"hastream", "proto"},
    "pyspark_hastream": {"spark_publisher"},
    # The operator's command: the client for everything it asks the cluster, deploy for
    # restarting local processes or containers (and reading cluster.cfg).
    "hastream_cli": {"hastream", "api_clients", "deploy"},
}
# The node's modules that meet protocol buffers: the servicer and the peer client.
SERVER_PROTO = {"raftstore/service.py", "raftstore/peers.py"}
# Node modules that still import proto outside the servicer, until the node's rewrite moves
# that into the servicer. Kept exact: the test fails when one of them no longer needs it.
SERVER_PROTO_PENDING: set[str] = set()
PYSYNCOBJ = {"raftstore/replication.py", "raftstore/pysyncobj_patches.py"}
ACYCLIC = ("hastream", "api_clients", "spark_publisher", "hastream_cli")
# Function-level imports of the project that are not about cycles: local.py sets the Spark
# workers' environment up before anything imports pyspark.
LAZY_OK = {("spark_publisher/local.py", "spark_publisher")}


def sources() -> list[Path]:
    files = [REPO / "pyspark_hastream.py"]
    for package in PACKAGES:
        files.extend(sorted((REPO / package).rglob("*.py")))
    return files


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name `path` imports, anywhere in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            assert node.module is not None
            names.add(node.module)
    return names


def layer_of(path: Path) -> str:
    relative = path.relative_to(REPO)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def test_every_layer_imports_only_the_layers_below_it() -> None:
    wrong: list[str] = []
    for path in sources():
        layer = layer_of(path)
        for module in sorted(imported_modules(path)):
            top = module.split(".")[0]
            if top in PROJECT and top != layer and top not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(REPO)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_protocol_buffers_are_imported_only_at_the_edges() -> None:
    importers = {
        str(path.relative_to(REPO))
        for path in sources()
        if any(module.split(".")[0] == "proto" for module in imported_modules(path))
    }
    server = {name for name in importers if name.startswith("raftstore/")}
    assert server - SERVER_PROTO - SERVER_PROTO_PENDING == set()
    assert server >= SERVER_PROTO_PENDING, "no longer imports proto: drop it from the list"
    others = {name for name in importers if not name.startswith(("raftstore/", "api_clients/"))}
    assert others == set()


def test_pysyncobj_is_imported_only_by_the_replication_adapter() -> None:
    importers = {
        str(path.relative_to(REPO))
        for path in sources()
        if any(module.split(".")[0] == "pysyncobj" for module in imported_modules(path))
    }
    assert importers == PYSYNCOBJ


def module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name: str, modules: set[str]) -> str | None:
    """The project module `name` (or its package) names, if it is one of `modules`."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    paths = {
        module_of(path): path for package in packages for path in (REPO / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {module: set() for module in paths}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                target = resolve(name, set(paths))
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def test_the_client_and_shared_packages_have_no_import_cycles() -> None:
    graph = import_graph(ACYCLIC)
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append([*path[path.index(module) :], module])
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_client_and_shared_packages_import_the_project_at_module_level_only() -> None:
    lazy: set[tuple[str, str]] = set()
    for package in ACYCLIC:
        for path in (REPO / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for function in ast.walk(tree):
                if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, ast.Import):
                        names = [alias.name for alias in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.module is not None:
                        names = [node.module]
                    else:
                        continue
                    lazy.update(
                        (str(path.relative_to(REPO)), name)
                        for name in names
                        if name.split(".")[0] in PROJECT
                    )
    assert lazy == LAZY_OK


# The node's own layers, from the leaves up: a module imports only from its layer or below.
# Leaves (bounds, values), the pure core (commands, state machine, formats: no I/O), storage
# (files), the shell pieces, the shell (applier, replicas, group), coordination over groups,
# the RPC servicer, the node (composition root).
NODE_LAYERS: dict[str, int] = {
    **dict.fromkeys(("limits", "health", "config", "stats", "log_limits", "passwords"), 0),
    **dict.fromkeys(("tuning", "trace", "cache_budget", "pre_vote", "append_rule", "pacing"), 0),
    **dict.fromkeys(("threads", "allocator", "key_table", "check_memo", "batch_memory"), 0),
    **dict.fromkeys(("values", "checked_payload"), 0),
    **dict.fromkeys(
        ("commands", "dedup", "state_machine", "storage/format", "storage/group_checkpoint"), 1
    ),
    **dict.fromkeys(("access", "publish_wire"), 1),
    **dict.fromkeys(
        ("storage/files", "storage/checkpoint", "storage/journal", "storage/segments"), 2
    ),
    **dict.fromkeys(("storage/raft_checkpoint", "storage/kernel_sync"), 2),
    **dict.fromkeys(("tables", "replica", "retention", "batcher", "peers", "catch_up"), 3),
    **dict.fromkeys(("pysyncobj_patches", "peer_frames", "peer_auth", "node_tls", "transfer"), 3),
    **dict.fromkeys(("grpc_unary",), 3),
    **dict.fromkeys(("apply", "identity", "local_replica", "replication", "group"), 4),
    **dict.fromkeys(("subscriptions", "pipeline", "routing", "catalog", "scrub", "digest"), 5),
    **dict.fromkeys(("admission", "auth", "slow_consumers"), 5),
    **dict.fromkeys(("leadership", "metrics", "status_page"), 5),
    **dict.fromkeys(("service", "status_http", "publish_port", "port_loop"), 6),
    **dict.fromkeys(("node", "__main__"), 7),
}
CORE = {name for name, layer in NODE_LAYERS.items() if layer == 1}
CORE_FORBIDDEN = {"os", "time", "random", "socket", "grpc", "pysyncobj", "threading"}


def _node_module(path: Path) -> str:
    return path.relative_to(REPO / "raftstore").with_suffix("").as_posix()


def _node_imports(path: Path) -> set[str]:
    """The node modules `path` imports, `from raftstore import x` counted as raftstore.x."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module in ("raftstore", "raftstore.storage"):
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("raftstore.")}


def test_the_node_modules_import_only_their_layer_or_below() -> None:
    wrong: list[str] = []
    for path in sorted((REPO / "raftstore").rglob("*.py")):
        name = _node_module(path)
        if name.endswith("__init__"):
            continue
        assert name in NODE_LAYERS, f"raftstore/{name}.py has no layer in NODE_LAYERS"
        for module in sorted(_node_imports(path)):
            target = module.removeprefix("raftstore.").replace(".", "/")
            if target in NODE_LAYERS and NODE_LAYERS[target] > NODE_LAYERS[name]:
                wrong.append(f"raftstore/{name}.py (layer {NODE_LAYERS[name]}) imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_core_does_no_io() -> None:
    wrong = []
    for name in sorted(CORE):
        for module in imported_modules(REPO / "raftstore" / f"{name}.py"):
            if module.split(".")[0] in CORE_FORBIDDEN:
                wrong.append(f"raftstore/{name}.py imports {module}")
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_command_line() -> None:
    """The `hastream` command sits on top: no package, tool or benchmark imports it."""
    importers = [
        str(path.relative_to(REPO))
        for top in (*PACKAGES, "deploy", "bench", "proto")
        for path in sorted((REPO / top).rglob("*.py"))
        if path.relative_to(REPO).parts[0] != "hastream_cli"
        and any(module.split(".")[0] == "hastream_cli" for module in imported_modules(path))
    ]
    assert importers == []


def test_the_console_script_is_the_module_entry_point() -> None:
    """`hastream` (pyproject [project.scripts]) and `python -m hastream_cli` run one main."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"hastream": "hastream_cli.main:main"}
    entry = (REPO / "hastream_cli" / "__main__.py").read_text()
    assert "from hastream_cli.main import main" in entry
