#!/usr/bin/env bash
# Build the local base image `hastream-base:local` from this machine's own Python runtime
# (no registry, no network): the interpreter, its trimmed standard library, the node's
# runtime packages and the shared libraries they link, loaded with `docker import`.
# Skipped when the image exists with the same inputs hash; `--force` rebuilds.
#
#   deploy/docker/build_base.sh [--tag hastream-base:local] [--force] [--list]
#
# Uses the `python` on PATH (the interpreter whose runtime goes into the image); set
# PYTHON=/path/to/python3.11 to pick another. See deploy/docker/base_image.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python}" -m deploy.docker.base_image "$@"
