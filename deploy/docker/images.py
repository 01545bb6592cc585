"""Build the node image (`hastream-node:local`) on the Docker SDK, with no registry.

The build context is made here, in memory, from exactly what the Dockerfile copies
(hastream/, proto/, raftstore/, api_clients/, deploy/ without caches), so nothing else of the
checkout (data dirs, .git, caches) is sent to the engine and no .dockerignore is needed.
The image is labelled with a hash of that context and of the base image id; a build is
skipped when an image with the tag and that hash exists. `pull=False`: the base image is
the local `hastream-base:local` (see base_image.py) unless a registry base is asked for.
"""

from __future__ import annotations

import hashlib
import io
import logging
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from deploy.docker import base_image
from deploy.docker.base_image import BASE_TAG_DEFAULT, INPUTS_LABEL

log = logging.getLogger(__name__)

REPO: Final = Path(__file__).resolve().parents[2]
NODE_TAG_DEFAULT: Final = "hastream-node:local"
DOCKERFILE: Final = "deploy/docker/Dockerfile"
CONTEXT_DIRS: Final = ("hastream", "proto", "raftstore", "api_clients", "deploy")
CONTEXT_SKIPPED_PARTS: Final = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache"})
CONTEXT_SKIPPED_SUFFIXES: Final = (".pyc", ".pyo", ".swp")


class ImageBuildError(RuntimeError):
    """The engine refused or failed a build; `log_tail` holds its last output lines."""

    def __init__(self, tag: str, reason: str, log_tail: str = "") -> None:
        self.tag = tag
        self.log_tail = log_tail
        super().__init__(f"building {tag} failed: {reason}")


def context_files(repo: Path = REPO) -> Iterator[tuple[str, Path]]:
    """(path in the context, host file) of every file the Dockerfile may copy, sorted."""
    for top in CONTEXT_DIRS:
        for path in sorted((repo / top).rglob("*")):
            relative = path.relative_to(repo)
            if not path.is_file() or CONTEXT_SKIPPED_PARTS.intersection(relative.parts):
                continue
            if path.name.endswith(CONTEXT_SKIPPED_SUFFIXES):
                continue
            yield relative.as_posix(), path


def build_context(repo: Path = REPO) -> tuple[bytes, str]:
    """The build context as tar bytes, and a hash of its paths, modes and contents."""
    digest = hashlib.sha256()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, path in context_files(repo):
            data = path.read_bytes()
            mode = 0o755 if path.stat().st_mode & 0o111 else 0o644
            digest.update(f"{name}\0{mode}\0{len(data)}\0".encode())
            digest.update(data)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            info.mtime = 0  # content decides the build cache, not checkout times
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue(), digest.hexdigest()


def build_node_image(
    client: Any,
    tag: str = NODE_TAG_DEFAULT,
    base: str = BASE_TAG_DEFAULT,
    *,
    force: bool = False,
    repo: Path = REPO,
) -> str:
    """Builds (or keeps) the node image `tag` FROM `base`; returns its id. `base` must be
    present locally (nothing is pulled)."""
    import docker.errors

    try:
        base_id = client.images.get(base).id
    except docker.errors.ImageNotFound:
        reason = f"base image {base} is not present (build it: deploy/docker/build_base.sh)"
        raise ImageBuildError(tag, reason) from None
    context, context_hash = build_context(repo)
    digest = hashlib.sha256(f"{context_hash}|{base}|{base_id}".encode()).hexdigest()[:16]
    if not force and base_image.image_inputs_label(client, tag) == digest:
        log.info("node image is up to date tag=%s inputs=%s", tag, digest)
        return str(client.images.get(tag).id)
    previous = _image_id(client, tag)
    started = time.monotonic()
    lines: list[str] = []
    stream = client.api.build(
        fileobj=io.BytesIO(context),
        custom_context=True,
        dockerfile=DOCKERFILE,
        tag=tag,
        buildargs={"BASE_IMAGE": base},
        labels={INPUTS_LABEL: digest},
        pull=False,
        rm=True,
        forcerm=True,
        decode=True,
    )
    for chunk in stream:
        if "stream" in chunk:
            lines.extend(line for line in chunk["stream"].splitlines() if line.strip())
        if "error" in chunk:
            raise ImageBuildError(tag, str(chunk["error"]).strip(), "\n".join(lines[-30:]))
    image = client.images.get(tag)
    if previous is not None and previous != image.id:
        base_image.remove_if_dangling(client, previous)
    log.info(
        "built node image tag=%s id=%s base=%s seconds=%.1f",
        tag,
        image.short_id,
        base,
        time.monotonic() - started,
    )
    return str(image.id)


def _image_id(client: Any, tag: str) -> str | None:
    import docker.errors

    try:
        return str(client.images.get(tag).id)
    except docker.errors.ImageNotFound:
        return None


def ensure_images(
    client: Any,
    *,
    node_tag: str = NODE_TAG_DEFAULT,
    base: str = BASE_TAG_DEFAULT,
    force: bool = False,
) -> str:
    """The node image, building what is missing or stale: the local base image first when
    `base` is the local tag, then the node image. Returns the node image id."""
    if base != BASE_TAG_DEFAULT:
        return build_node_image(client, node_tag, base, force=force)
    previous_base = _image_id(client, base)
    base_id = base_image.build_base_image(client, base, force=force)
    node_id = build_node_image(client, node_tag, base, force=force)
    if previous_base is not None and previous_base != base_id:
        # Only now: the replaced node image was its last child.
        base_image.remove_if_dangling(client, previous_base)
    return node_id
