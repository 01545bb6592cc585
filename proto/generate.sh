#!/usr/bin/env bash
# Regenerates the Python gRPC code from proto/hastream.proto. Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/hastream.proto
