"""Image build step: install the node's runtime requirements unless the base image has them.

    python install_deps.py requirements-node.txt

On `hastream-base:local` (this machine's runtime, imported without a registry) every
distribution is already there and nothing is downloaded, so the build needs no network.
On a registry image such as python:3.11-slim they are missing and pip installs them.
Standard library only: it runs before the project's code is copied.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path


def requirement_names(path: Path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#", 1)[0])
        if match:
            names.append(match.group(1))
    return names


def missing(names: list[str]) -> list[str]:
    absent = []
    for name in names:
        try:
            print(f"present: {name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
    return absent


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: install_deps.py REQUIREMENTS", file=sys.stderr)
        return 2
    requirements = Path(argv[1])
    absent = missing(requirement_names(requirements))
    if not absent:
        print("every requirement is installed in the base image; nothing to download")
        return 0
    print(f"installing with pip (missing: {', '.join(absent)})", flush=True)
    command = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "-r", str(requirements)]
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv))
