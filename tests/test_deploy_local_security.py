"""`deploy.local` is secure by default: `up` generates a development CA, node certificates
and the first admin's password, and starts the nodes with TLS and logins; its own probes,
the `hastream` command and the tour find the CA and the login in the run directory's cfg;
a plaintext client is refused; `up --insecure` runs plaintext. Real processes, as an
operator runs them (`python -m deploy.local ...`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from api_clients import Session
from api_clients.transport import TransportError
from tests.harness import LocalCluster
from tests.ops_helpers import run_cli

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.cluster


def deploy_local(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.local", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_up_is_secure_by_default_and_insecure_on_request(tmp_path: Path) -> None:
    layout = LocalCluster(tmp_path / "cluster")  # a cfg with free ports; deploy.local runs it
    options = ("--config", str(layout.config_path), "--run-dir", str(tmp_path / "run"))
    effective = tmp_path / "run" / "cluster.cfg"
    sites = [node.site for node in layout.nodes.values()]
    try:
        up = deploy_local("up", *options, cwd=tmp_path)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "security: TLS (CA " in up.stdout
        password_file = tmp_path / "run" / "security" / "admin.password"
        assert f"logins on: user admin, password in {password_file}" in up.stdout
        assert password_file.stat().st_mode & 0o077 == 0
        assert password_file.read_text().strip() not in up.stdout
        status = deploy_local("status", *options, cwd=tmp_path)  # its probes speak TLS
        assert status.returncode == 0, status.stdout + status.stderr
        # The `hastream` command takes the CA and the admin login from the effective cfg.
        groups = run_cli("groups", "--config", str(effective))
        assert [group["id"] for group in groups] == [2]
        with Session(sites) as plaintext, pytest.raises(TransportError, match=r"(?i)tls"):
            plaintext.getStreamingRaftGroups()
        tour = subprocess.run(
            [sys.executable, str(REPO / "examples" / "tour.py"), "--config", str(effective)],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert tour.returncode == 0, tour.stdout + tour.stderr
        restart = deploy_local("restart", "node2", *options, cwd=tmp_path)
        assert restart.returncode == 0, restart.stdout + restart.stderr
        # A rolling restart moves leadership (admin only): the command logs in as the admin.
        steps = run_cli(
            "rolling-restart", "--config", str(effective), "--run-dir", str(tmp_path / "run")
        )
        assert sorted(step["node"] for step in steps) == ["node1", "node2", "node3"]
        down = deploy_local("down", "--wipe", *options, cwd=tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not (tmp_path / "run" / "security").exists()

        insecure = deploy_local("up", "--insecure", *options, cwd=tmp_path)
        assert insecure.returncode == 0, insecure.stdout + insecure.stderr
        assert "security: plaintext, logins off" in insecure.stdout
        with Session(sites) as plaintext:
            assert [group["id"] for group in plaintext.getStreamingRaftGroups()] == [2]
    finally:
        deploy_local("down", "--wipe", *options, cwd=tmp_path)
