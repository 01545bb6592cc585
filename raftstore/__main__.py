"""`python -m raftstore --config cluster.cfg --node node1`: run one node."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hastream.errors import ConfigError
from raftstore import allocator, config, tuning
from raftstore.identity import StartRefused
from raftstore.node import DirectoryLocked, Node


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raftstore", description=__doc__)
    parser.add_argument("--config", default="cluster.cfg", help="path of cluster.cfg")
    parser.add_argument("--node", required=True, help="alias of this node in cluster.cfg")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--rejoin",
        default="",
        metavar="GROUPS",
        help="comma-separated raft group ids (or 'all') whose lost or damaged Raft state this "
        "node rebuilds from its peers, as a member that votes only once caught up",
    )
    args = parser.parse_args(argv)
    allocator.bound_arenas()  # before any thread of the node starts
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    # Everything the node creates (data files, logs, checkpoints) is its own: 0600 / 0700.
    os.umask(0o077)
    try:
        cluster = config.load(args.config)
        cluster.node(args.node)
        knobs = tuning.from_environment(os.environ, args.node)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    node_groups = [group.group_id for group in cluster.groups_of(args.node)]
    try:
        rejoin = _rejoin_groups(args.rejoin, node_groups)
    except ValueError as error:
        print(f"--rejoin {args.rejoin!r}: {error}", file=sys.stderr)
        return 2
    try:
        Node(cluster, args.node, rejoin=rejoin, tuning=knobs).run()
    except ConfigError as error:  # e.g. a TLS file that cannot be read
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except DirectoryLocked as error:
        print(f"cannot start: {error}", file=sys.stderr)
        return 3
    except StartRefused as error:
        print(f"cannot start: {error.reason}", file=sys.stderr)
        return 4
    return 0


def _rejoin_groups(text: str, node_groups: list[int]) -> frozenset[int]:
    if not text:
        return frozenset()
    if text == "all":
        return frozenset(node_groups)
    groups = frozenset(int(part) for part in text.split(","))
    unknown = sorted(groups - set(node_groups))
    if unknown:
        raise ValueError(f"this node is in no raft group {unknown}")
    return groups


if __name__ == "__main__":
    sys.exit(main())
