"""The node of the HA stream table cluster (`python -m raftstore`)."""

# First, before any module of the node imports grpc: gRPC's polling engine (see there).
import hastream.grpc_engine  # noqa: F401
