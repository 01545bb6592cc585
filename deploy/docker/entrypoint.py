"""The node container's entrypoint: run one node of the mounted cluster.cfg.

    python -m deploy.docker.entrypoint [--node ALIAS] [--config PATH] [--log-level LEVEL]

The alias comes from `--node`, else `$HASTREAM_NODE`; the config from `--config`, else
`$HASTREAM_CONFIG`, else /etc/hastream/cluster.cfg. Started as root (the default), it
creates the node's persistenceDir and streamingHADir (fresh named volumes are mounted
root-owned), gives them to the `hastream` user (uid 10001, or `$HASTREAM_UID`), drops to
that user and execs `python -m raftstore`, which keeps the container's pid and signals
(`docker stop` is SIGTERM: the node stops cleanly). Started as any other user (`--user`),
it execs the node at once; the directories must then be writable by that user.

A bad config is refused here with raftstore's own message (exit code 2), before any
directory is touched.
"""

from __future__ import annotations

import argparse
import os
import pwd
import sys
from pathlib import Path
from typing import Final

from hastream.errors import ConfigError
from raftstore import config

CONFIG_DEFAULT: Final = "/etc/hastream/cluster.cfg"
NODE_USER: Final = "hastream"
NODE_UID_DEFAULT: Final = 10001
EXIT_CONFIG: Final = 2  # as `python -m raftstore`


def node_user() -> tuple[int, int, str]:
    """(uid, gid, home) the node runs as when started as root."""
    override = os.environ.get("HASTREAM_UID")
    if override:
        uid = int(override)
        return uid, uid, "/var/lib/hastream"
    try:
        entry = pwd.getpwnam(NODE_USER)
    except KeyError:  # an image without the user (e.g. python:3.11-slim): numeric ids work
        return NODE_UID_DEFAULT, NODE_UID_DEFAULT, "/var/lib/hastream"
    return entry.pw_uid, entry.pw_gid, entry.pw_dir


def give_directory(directory: Path, uid: int, gid: int) -> None:
    """Create `directory` and make the tree owned by uid:gid. The walk only happens when
    the top is not owned yet (a fresh volume), so restarts stay fast on big data dirs."""
    directory.mkdir(parents=True, exist_ok=True)
    stat = directory.stat()
    if (stat.st_uid, stat.st_gid) == (uid, gid):
        return
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, gid)
    os.chown(directory, uid, gid)


def drop_privileges(uid: int, gid: int, home: str) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    os.environ["HOME"] = home
    os.environ["USER"] = NODE_USER


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.docker.entrypoint")
    parser.add_argument("--node", default=os.environ.get("HASTREAM_NODE"))
    parser.add_argument("--config", default=os.environ.get("HASTREAM_CONFIG", CONFIG_DEFAULT))
    parser.add_argument("--log-level", default=os.environ.get("HASTREAM_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    if not args.node:
        parser.error("set the node alias: --node ALIAS or HASTREAM_NODE=ALIAS")
    try:
        node = config.load(args.config).node(args.node)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    if os.geteuid() == 0:
        uid, gid, home = node_user()
        for directory in (node.persistence_dir, node.ha_dir):
            give_directory(directory, uid, gid)
        drop_privileges(uid, gid, home)
    command = [sys.executable, "-m", "raftstore", "--config", args.config, "--node", args.node]
    command += ["--log-level", args.log_level]
    sys.stdout.flush()
    os.execv(sys.executable, command)
    raise AssertionError("execv returned")  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
