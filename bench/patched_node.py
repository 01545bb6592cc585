"""`python -m bench.patched_node --patches a,b -- --config cluster.cfg --node node1`: run one
unmodified node (`raftstore.__main__`) after applying candidate changes from bench.patches.
For A/B measurements only (bench.experiment)."""

from __future__ import annotations

import argparse
import sys

from bench import patches


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.patched_node")
    parser.add_argument("--patches", default="", help=f"comma-separated: {patches.names()}")
    parser.add_argument("node_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    patches.apply([name for name in args.patches.split(",") if name])
    from raftstore.__main__ import main as node_main

    node_args = args.node_args[1:] if args.node_args[:1] == ["--"] else args.node_args
    return node_main(node_args)


if __name__ == "__main__":
    sys.exit(main())
