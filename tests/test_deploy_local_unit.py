"""The pure parts of deploy/local.py: arguments, log readiness, polling, status table.

Starting and stopping real nodes is covered by the cluster tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deploy import local
from raftstore import config

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cluster() -> config.ClusterConfig:
    return config.load(REPO_ROOT / "cluster.cfg")


def test_parse_args_defaults() -> None:
    args = local.parse_args(["up"])
    assert (args.action, args.node, args.config) == ("up", None, Path("cluster.cfg"))
    assert args.run_dir == Path(".run").absolute()


def test_parse_args_node_and_options() -> None:
    args = local.parse_args(["restart", "node2", "--config", "x.cfg", "--run-dir", "/r"])
    assert (args.action, args.node, args.config, args.run_dir) == (
        "restart",
        "node2",
        Path("x.cfg"),
        Path("/r"),
    )


@pytest.mark.parametrize("action", ["kill", "restart"])
def test_kill_and_restart_need_a_node(action: str) -> None:
    with pytest.raises(SystemExit):
        local.parse_args([action])


def test_unknown_action_is_refused() -> None:
    with pytest.raises(SystemExit):
        local.parse_args(["explode"])


def test_main_refuses_unknown_node_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert local.main(["status", "nodeX", "--config", str(REPO_ROOT / "cluster.cfg")]) == 2
    assert "unknown node" in capsys.readouterr().err


def test_node_command_runs_raftstore_with_absolute_config(cluster: config.ClusterConfig) -> None:
    command = local.node_command(cluster, "node1")
    assert command[1:] == ["-m", "raftstore", "--config", str(cluster.path), "--node", "node1"]


def marker(alias: str) -> str:
    return f"{local.START_MARKER} alias={alias} at 2026-01-01T00:00:00+00:00\n"


def test_ready_line_after_the_latest_marker_counts() -> None:
    text = marker("node1") + "booting\nINFO NODE READY alias=node1 port=8901\n"
    assert local.ready_in_log(text, "node1")


def test_ready_line_of_an_earlier_run_does_not_count() -> None:
    text = marker("node1") + "NODE READY alias=node1\n" + marker("node1") + "booting\n"
    assert not local.ready_in_log(text, "node1")


def test_ready_line_of_another_alias_does_not_count() -> None:
    assert not local.ready_in_log(marker("node1") + "NODE READY alias=node10\n", "node1")
    assert not local.ready_in_log(marker("node1") + "NODE READY alias=node1-b\n", "node1")


def test_ready_line_without_marker_counts() -> None:
    assert local.ready_in_log("NODE READY alias=node1\n", "node1")


def test_log_shows_ready_reads_the_log_file(tmp_path: Path) -> None:
    assert not local.log_shows_ready(tmp_path, "node1")
    path = local.log_path(tmp_path, "node1")
    path.write_text(marker("node1") + "starting\n")
    assert not local.log_shows_ready(tmp_path, "node1")
    with path.open("a") as file:
        file.write("NODE READY alias=node1\n")
    assert local.log_shows_ready(tmp_path, "node1")


def test_log_shows_ready_in_a_long_log_past_the_scan_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "LOG_SCAN_BYTES_MAX", 100)
    text = marker("node1") + "x" * 500 + "\nNODE READY alias=node1\n"
    local.log_path(tmp_path, "node1").write_text(text)
    assert local.log_shows_ready(tmp_path, "node1")


def test_log_tail_keeps_the_last_lines(tmp_path: Path) -> None:
    local.log_path(tmp_path, "n").write_text("".join(f"line {i}\n" for i in range(100)))
    assert local.log_tail(tmp_path, "n", lines=2) == "line 98\nline 99"


def test_read_pid_ignores_missing_and_garbage_files(tmp_path: Path) -> None:
    assert local.read_pid(tmp_path, "n") is None
    local.pid_path(tmp_path, "n").write_text("not a pid\n")
    assert local.read_pid(tmp_path, "n") is None
    local.pid_path(tmp_path, "n").write_text("123\n")
    assert local.read_pid(tmp_path, "n") == 123


def test_a_pid_that_is_not_a_node_process_is_not_running(tmp_path: Path) -> None:
    # Our own pid is alive but is not `-m raftstore --node n`: a recycled pid is ignored.
    local.pid_path(tmp_path, "n").write_text(f"{os.getpid()}\n")
    assert local.node_pid(tmp_path, "n") is None


def test_wait_until_returns_true_once_the_condition_holds() -> None:
    calls = iter([False, False, True])
    assert local.wait_until(lambda: next(calls), timeout_s=5.0, interval_s=0.001)


def test_wait_until_returns_false_at_the_deadline() -> None:
    assert not local.wait_until(lambda: False, timeout_s=0.02, interval_s=0.005)


def test_wait_until_propagates_predicate_errors() -> None:
    def fail() -> bool:
        raise local.DeployError("boom")

    with pytest.raises(local.DeployError):
        local.wait_until(fail, timeout_s=1.0)


def group_status(group_id: int, role: str, leader: str, commit: int) -> dict[str, object]:
    return {
        "raft_group": group_id,
        "role": role,
        "leader": leader,
        "term": 4,
        "commit_index": commit,
        "last_applied": commit,
        "log_len": 7,
        "tables": ["ticks"],
    }


def test_format_status_shows_leaders_and_commit_indexes(cluster: config.ClusterConfig) -> None:
    leader = "127.0.0.1:8901:node1"
    states = [
        local.NodeState(
            alias="node1",
            pid=11,
            alive=True,
            status={
                "alias": "node1",
                "groups": [
                    group_status(2, "leader", leader, 120),
                    group_status(3, "follower", "", 5),
                ],
            },
        ),
        local.NodeState(alias="node2", pid=12, alive=False, status="unreachable (UNAVAILABLE)"),
        local.NodeState(alias="node3", pid=None, alive=False, status="unreachable (UNAVAILABLE)"),
    ]
    text = local.format_status(cluster, states)
    assert "GROUP 2  leader: 127.0.0.1:8901:node1" in text
    assert "GROUP 3  leader: none" in text
    assert "120" in text
    assert "ticks" in text
    lines = text.splitlines()
    assert any(line.startswith("node2") and "dead" in line for line in lines)
    assert any(line.startswith("node3") and "stopped" in line for line in lines)
    assert any(line.strip().startswith("node2") and "unreachable" in line for line in lines)


def test_format_status_marks_a_leader_no_one_confirms(cluster: config.ClusterConfig) -> None:
    gone = "127.0.0.1:8902:node2"
    status = {"alias": "node1", "groups": [group_status(2, "follower", gone, 3)]}
    states = [local.NodeState(alias="node1", pid=1, alive=True, status=status)]
    assert f"GROUP 2  leader: unconfirmed ({gone}" in local.format_status(cluster, states)


def test_down_wipe_removes_the_nodes_directories_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "cluster.cfg"
    cfg.write_text(
        (REPO_ROOT / "cluster.cfg")
        .read_text()
        .replace("data/<ALIAS>", str(tmp_path / "data/<ALIAS>"))
    )
    cluster = config.load(cfg)
    for node in cluster.nodes:
        for directory in (node.persistence_dir, node.ha_dir):
            directory.mkdir(parents=True)
            (directory / "file").write_text("x")
    (tmp_path / "keep").write_text("mine")
    run_dir = tmp_path / ".run"
    assert local.main(["down", "--wipe", "--config", str(cfg), "--run-dir", str(run_dir)]) == 0
    for node in cluster.nodes:
        assert not node.persistence_dir.exists()
        assert not node.ha_dir.exists()
    assert (tmp_path / "keep").read_text() == "mine"
    assert "removed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        local.parse_args(["up", "--wipe"])
