"""`python -m raftstore --config cluster.cfg --node node1`: run one node."""

from __future__ import annotations

import argparse
import logging
import sys

from raftstore import config
from raftstore.errors import ConfigError
from raftstore.node import DirectoryLocked, Node


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raftstore", description=__doc__)
    parser.add_argument("--config", default="cluster.cfg", help="path of cluster.cfg")
    parser.add_argument("--node", required=True, help="alias of this node in cluster.cfg")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    try:
        cluster = config.load(args.config)
        cluster.node(args.node)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    try:
        Node(cluster, args.node).run()
    except DirectoryLocked as error:
        print(f"cannot start: {error}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
