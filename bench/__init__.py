"""The benchmarks. Importing the package picks gRPC's polling engine for the benchmark
process before any of its modules imports grpc (hastream/grpc_engine.py): their raw gRPC
stubs and pipelines then run as the project's clients do, and the nodes they start inherit
the same setting. `GRPC_EXPERIMENTS=""` keeps gRPC's defaults in both, for an A/B."""

from hastream import grpc_engine as _grpc_engine  # noqa: F401  (its import is the setting)
