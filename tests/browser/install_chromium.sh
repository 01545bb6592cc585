#!/usr/bin/env bash
# Installs Debian's `chromium` package for the status-page browser test when it is missing.
# Needs root and apt (the test skips, with the reason, when this script fails).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "chromium is missing and installing it needs root" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "chromium is missing and this machine has no apt-get" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-cache show chromium >/dev/null 2>&1; then
    apt-get update -qq
fi
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
command -v chromium >/dev/null
