"""What the nodes (`raftstore`) and the client (`api_clients`, `spark_publisher`) share.

A leaf: it imports nothing else of the project, so neither side reaches into the other's
internals. `errors` (typed errors and their wire form), `model` (value types), `wire` (the
bounds of the wire contract), `files` (durable file writes), `grpc_engine` (gRPC's I/O
engine, chosen before grpc is imported).
"""

from importlib import metadata

try:
    __version__ = metadata.version("hastream")
except metadata.PackageNotFoundError:  # Run from a checkout that was not installed.
    __version__ = "0.1.0"
