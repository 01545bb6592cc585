"""Build the local base image `hastream-base:local` from this machine's own Python runtime.

Machines here have no container registry: `FROM python:3.11-slim` cannot be pulled, and a
build has no network. So the base image is assembled from files already on this machine and
loaded with `docker import` (the engine's `POST /images/create?fromSrc=-`):

    /usr/local/bin/python3.11 (+ python3, python)   the running interpreter's binary
    /usr/local/lib/python3.11/                       its standard library, without tests,
                                                     idlelib, tkinter, ensurepip, the static lib
    /usr/local/lib/python3.11/site-packages/         the node's runtime distributions only
                                                     (requirements-node.txt and what they
                                                     require), copied by their RECORD files;
                                                     never pyspark, pandas or test tools
    <libdir>/libpython3.11.so.1.0, libc, libstdc++   every shared library the files above
      libssl, libz, ... , the dynamic loader         link to, found with `ldd`, at the
                                                     paths the host has them
    /usr/bin/dash as /bin/sh                         a minimal shell (for `docker exec`)
    /etc/passwd, group, nsswitch.conf, hosts         root and the `hastream` user (uid 10001)

`python -m deploy.docker.base_image [--tag hastream-base:local] [--force]`, or
`deploy/docker/build_base.sh`. The image carries a label with a hash of its inputs (the
interpreter, the distributions and their versions, the host's OS release and this file);
`ensure_base_image` skips the build when an image with the tag and that hash exists.

libpython goes into the directory that holds the host's libc (a directory the dynamic
loader searches by default, as Debian's own python3.11 package does), so the image needs
no ld.so.cache and no LD_LIBRARY_PATH. Python finds its prefix from the binary's location
(the `lib/python3.11/os.py` landmark), so moving it from pyenv's prefix to /usr/local works.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import io
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final

log = logging.getLogger(__name__)

HERE: Final = Path(__file__).resolve().parent
REQUIREMENTS_NODE: Final = HERE / "requirements-node.txt"
BASE_TAG_DEFAULT: Final = "hastream-base:local"
INPUTS_LABEL: Final = "org.hastream.inputs"
NODE_UID: Final = 10001  # the `hastream` user the node runs as (see entrypoint.py)

PYTHON_VERSION: Final = f"{sys.version_info.major}.{sys.version_info.minor}"
PREFIX_IN_IMAGE: Final = PurePosixPath("/usr/local")
STDLIB_IN_IMAGE: Final = PREFIX_IN_IMAGE / "lib" / f"python{PYTHON_VERSION}"
SITE_IN_IMAGE: Final = STDLIB_IN_IMAGE / "site-packages"

# Standard library parts a server never imports (about 200 MB of the 257 MB).
STDLIB_EXCLUDED_DIRS: Final = frozenset(
    {
        "site-packages",
        "dist-packages",  # a distribution's python: its system packages are not ours
        "test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "lib2to3",
        f"config-{PYTHON_VERSION}-x86_64-linux-gnu",
        f"config-{PYTHON_VERSION}-aarch64-linux-gnu",
    }
)
# Extension modules for tests, terminals and GUIs (they would pull in Tk, X11, ncurses).
DYNLOAD_EXCLUDED: Final = re.compile(
    r"^(_test\w*|_ctypes_test|xxlimited\w*|_xxtestfuzz|_tkinter|_curses\w*|readline"
    r"|nis|ossaudiodev)\."
)
# pyarrow parts a node never loads: Flight RPC, S3, C++ tests, headers, Cython sources.
SITE_EXCLUDED: Final = re.compile(
    r"^pyarrow/(tests/|include/|src/|.*flight.*|libarrow_s3\.|_s3fs\.|_pyarrow_cpp_tests\.)"
    r"|\.(pxd|pyx|pxi|h|hpp|cc|cpp)$"
    r"|(^|/)__pycache__/.*\.opt-[12]\.pyc$"
)
STDLIB_EXCLUDED_FILE: Final = re.compile(r"\.opt-[12]\.pyc$")

ETC_PASSWD: Final = (
    "root:x:0:0:root:/root:/bin/sh\n"
    f"hastream:x:{NODE_UID}:{NODE_UID}:hastream node:/var/lib/hastream:/usr/sbin/nologin\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
ETC_GROUP: Final = f"root:x:0:\nhastream:x:{NODE_UID}:\nnogroup:x:65534:\n"
# Names resolve from /etc/hosts first (the deployment pins node names there), then DNS.
ETC_NSSWITCH: Final = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n"
ETC_HOSTS: Final = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"

IMAGE_CHANGES: Final = (
    "ENV PATH=/usr/local/bin:/usr/bin:/bin",
    "ENV LANG=C.UTF-8",
    "ENV PYTHONUNBUFFERED=1",
    "WORKDIR /",
    'CMD ["python3"]',
)


class BaseImageError(RuntimeError):
    """The base image cannot be built on this machine (a missing file or library)."""


# ---------------------------------------------------------------------------------------
# The file list (pure apart from reading the host's file system)


@dataclass(slots=True)
class Layout:
    """What goes into the image: paths in the image -> host files, symlinks, small files.
    Paths are absolute POSIX paths inside the image."""

    files: dict[PurePosixPath, Path] = field(default_factory=dict)
    symlinks: dict[PurePosixPath, str] = field(default_factory=dict)
    contents: dict[PurePosixPath, tuple[bytes, int]] = field(default_factory=dict)
    dirs: dict[PurePosixPath, int] = field(default_factory=dict)  # path -> mode

    def add_file(self, image_path: PurePosixPath, host_path: Path) -> None:
        self.files[image_path] = host_path

    def add_content(self, image_path: PurePosixPath, data: str, mode: int = 0o644) -> None:
        self.contents[image_path] = (data.encode(), mode)

    def all_paths(self) -> Iterator[PurePosixPath]:
        yield from self.files
        yield from self.symlinks
        yield from self.contents
        yield from self.dirs


def requirement_names(path: Path = REQUIREMENTS_NODE) -> list[str]:
    """Distribution names listed in a requirements file (versions are pip's business)."""
    names = []
    for line in path.read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#", 1)[0])
        if match:
            names.append(match.group(1))
    return names


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions(names: Iterable[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions `names` and, transitively, the ones they require (any
    requirement that is not behind an `extra`; one not installed here is skipped: its
    marker excludes this interpreter). Raises BaseImageError for a missing top-level one."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = [(name, True) for name in names]
    while pending:
        name, required = pending.pop()
        if _normalized(name) in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            if required:
                raise BaseImageError(
                    f"{name} is not installed for {sys.executable}; "
                    "run `python -m pip install -r requirements.txt` first"
                ) from None
            continue
        found[_normalized(name)] = dist
        for requirement in dist.requires or ():
            if "extra ==" in requirement or "extra==" in requirement:
                continue
            match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
            if match:
                pending.append((match.group(1), False))
    return sorted(found.values(), key=lambda dist: _normalized(dist.metadata["Name"]))


def _add_stdlib(layout: Layout, stdlib: Path) -> None:
    for directory, subdirs, files in os.walk(stdlib):
        relative = Path(directory).relative_to(stdlib)
        if relative == Path("."):
            subdirs[:] = sorted(d for d in subdirs if d not in STDLIB_EXCLUDED_DIRS)
        else:
            subdirs.sort()
        for name in sorted(files):
            if STDLIB_EXCLUDED_FILE.search(name):
                continue
            if relative == Path("lib-dynload") and DYNLOAD_EXCLUDED.match(name):
                continue
            host_path = Path(directory) / name
            layout.add_file(STDLIB_IN_IMAGE / relative.as_posix() / name, host_path)


def _add_distribution(layout: Layout, dist: importlib.metadata.Distribution) -> None:
    site = Path(str(dist.locate_file(""))).resolve()
    for entry in dist.files or ():
        relative = PurePosixPath(str(entry))
        if ".." in relative.parts or SITE_EXCLUDED.search(str(relative)):
            continue  # console scripts outside site-packages; parts a node never loads
        host_path = site / relative
        if host_path.is_file():
            layout.add_file(SITE_IN_IMAGE / relative, host_path)


def _is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            return file.read(4) == b"\x7fELF"
    except OSError:
        return False


_LDD_LINE: Final = re.compile(r"^\s*(\S+)(?:\s+=>\s+(\S+|not found))?")


def linked_libraries(path: Path) -> list[str] | None:
    """Absolute paths of the shared libraries `path` loads (ldd), or None if one of them
    is not found on this machine."""
    result = subprocess.run(
        ["ldd", str(path)], capture_output=True, text=True, check=False, timeout=60
    )
    if result.returncode != 0:
        return []  # statically linked or not a dynamic object: nothing to add
    libraries = []
    for line in result.stdout.splitlines():
        match = _LDD_LINE.match(line)
        if match is None:
            continue
        name, target = match.group(1), match.group(2)
        if target == "not found":
            log.warning("library not found file=%s library=%s", path, name)
            return None
        resolved = target or name
        if resolved.startswith("/"):
            libraries.append(resolved)
    return libraries


def _canonical(path: str) -> PurePosixPath:
    """`path` with its directory resolved (so /lib/x/libc.so.6 -> /usr/lib/x/libc.so.6 on a
    merged-/usr host) but its last component kept (it may be a soname symlink)."""
    directory = os.path.realpath(os.path.dirname(path))
    return PurePosixPath(directory) / os.path.basename(path)


def _add_host_path(layout: Layout, path: str) -> None:
    """A host file at its canonical path, following (and recording) symlink chains."""
    current = _canonical(path)
    for _ in range(16):  # bounded: symlink chains of shared libraries are short
        host = Path(current)
        if host.is_symlink():
            target = os.readlink(host)
            layout.symlinks[current] = target
            current = _canonical(str(PurePosixPath(current.parent) / target))
            continue
        if not host.is_file():
            raise BaseImageError(f"{path} resolves to {current}, which is not a file")
        layout.files[current] = host
        return
    raise BaseImageError(f"symlink chain too long at {path}")


def _add_shared_libraries(layout: Layout, inside: Iterable[Path]) -> None:
    """Every library the ELF files of `layout` load, except those shipped inside the copied
    trees (pyarrow's own libraries, found through $ORIGIN)."""
    roots = [str(root) for root in inside]
    dropped: list[PurePosixPath] = []
    needed: set[str] = set()
    for image_path, host_path in sorted(layout.files.items()):
        if not _is_elf(host_path):
            continue
        libraries = linked_libraries(host_path)
        if libraries is None:
            if image_path.parent.name == "lib-dynload":
                dropped.append(image_path)  # an optional stdlib module; log and leave it out
                continue
            raise BaseImageError(f"{host_path} needs a library this machine does not have")
        needed.update(lib for lib in libraries if not any(lib.startswith(r) for r in roots))
    for image_path in dropped:
        del layout.files[image_path]
    for library in sorted(needed):
        _add_host_path(layout, library)


def _add_system(layout: Layout) -> None:
    """Merged-/usr symlinks as on the host, a shell, /etc files, empty directories."""
    for top in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
        host = Path("/") / top
        if host.is_symlink():
            layout.symlinks[PurePosixPath("/") / top] = os.readlink(host)
    shell = os.path.realpath("/bin/sh")
    if Path(shell).is_file():
        _add_host_path(layout, shell)
        shell_dir = PurePosixPath(os.path.realpath("/bin"))
        if shell_dir / "sh" != PurePosixPath(shell):
            layout.symlinks[shell_dir / "sh"] = os.path.basename(shell)
    layout.add_content(PurePosixPath("/etc/passwd"), ETC_PASSWD)
    layout.add_content(PurePosixPath("/etc/group"), ETC_GROUP)
    layout.add_content(PurePosixPath("/etc/nsswitch.conf"), ETC_NSSWITCH)
    layout.add_content(PurePosixPath("/etc/hosts"), ETC_HOSTS)
    layout.add_content(PurePosixPath("/etc/hostname"), "localhost\n")
    layout.add_content(PurePosixPath("/etc/resolv.conf"), "")
    for directory, mode in (
        ("/tmp", 0o1777),
        ("/var/tmp", 0o1777),
        ("/root", 0o700),
        ("/proc", 0o555),
        ("/sys", 0o555),
        ("/dev", 0o755),
        ("/run", 0o755),
    ):
        layout.dirs[PurePosixPath(directory)] = mode


def runtime_layout(
    base_prefix: Path | None = None, requirement_file: Path = REQUIREMENTS_NODE
) -> Layout:
    """The complete file list of the base image, from the running interpreter's install."""
    prefix = Path(base_prefix or sys.base_prefix)
    stdlib = prefix / "lib" / f"python{PYTHON_VERSION}"
    binary = prefix / "bin" / f"python{PYTHON_VERSION}"
    if not binary.is_file() or not (stdlib / "os.py").is_file():
        raise BaseImageError(f"no python{PYTHON_VERSION} install under {prefix}")
    layout = Layout()
    layout.add_file(PREFIX_IN_IMAGE / "bin" / f"python{PYTHON_VERSION}", binary)
    layout.symlinks[PREFIX_IN_IMAGE / "bin" / "python3"] = f"python{PYTHON_VERSION}"
    layout.symlinks[PREFIX_IN_IMAGE / "bin" / "python"] = f"python{PYTHON_VERSION}"
    library_dir = PurePosixPath(os.path.dirname(_canonical_libc(binary)))
    for shared in sorted((prefix / "lib").glob(f"libpython{PYTHON_VERSION}*.so*")):
        if shared.is_file() and not shared.is_symlink():
            layout.add_file(library_dir / shared.name, shared)
    _add_stdlib(layout, stdlib)
    dists = distributions(requirement_names(requirement_file))
    for dist in dists:
        _add_distribution(layout, dist)
    site_roots = {Path(str(dist.locate_file(""))).resolve() for dist in dists}
    _add_shared_libraries(layout, [prefix.resolve(), *sorted(site_roots)])
    _add_system(layout)
    _add_parent_dirs(layout)
    return layout


def _canonical_libc(binary: Path) -> str:
    libraries = linked_libraries(binary) or []
    for library in libraries:
        if os.path.basename(library).startswith("libc.so"):
            return str(_canonical(library))
    raise BaseImageError(f"{binary} does not link libc (ldd found {libraries})")


def _add_parent_dirs(layout: Layout) -> None:
    symlinked = set(layout.symlinks)
    for path in list(layout.all_paths()):
        for parent in path.parents:
            if parent == PurePosixPath("/") or parent in symlinked:
                continue
            layout.dirs.setdefault(parent, 0o755)


# ---------------------------------------------------------------------------------------
# Hash of the inputs, tarball, import


def inputs_hash(base_prefix: Path | None = None, requirement_file: Path = REQUIREMENTS_NODE) -> str:
    """A cheap fingerprint of what the image is made of (no ldd, no file contents): the
    interpreter binary, the distributions and versions, the OS release and this module."""
    prefix = Path(base_prefix or sys.base_prefix)
    digest = hashlib.sha256()
    binary = prefix / "bin" / f"python{PYTHON_VERSION}"
    stat = binary.stat()
    digest.update(f"{sys.version}|{binary}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    for dist in distributions(requirement_names(requirement_file)):
        digest.update(f"{dist.metadata['Name']}=={dist.version}\n".encode())
    for path in (Path("/etc/os-release"), Path(__file__).resolve(), requirement_file):
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _tar_info(name: PurePosixPath, kind: bytes, mode: int, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(str(name).lstrip("/") or ".")
    info.type = kind
    info.mode = mode
    info.size = size
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = int(time.time())
    return info


def write_tarball(layout: Layout, output: Any) -> int:
    """Writes the layout as an uncompressed tar to the binary file `output`; returns the
    number of bytes of file data written."""
    total = 0
    with tarfile.open(fileobj=output, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(layout.dirs):
            tar.addfile(_tar_info(path, tarfile.DIRTYPE, layout.dirs[path]))
        for path in sorted(layout.symlinks):
            info = _tar_info(path, tarfile.SYMTYPE, 0o777)
            info.linkname = layout.symlinks[path]
            tar.addfile(info)
        for path, (data, mode) in sorted(layout.contents.items()):
            tar.addfile(_tar_info(path, tarfile.REGTYPE, mode, len(data)), io.BytesIO(data))
            total += len(data)
        for path, host_path in sorted(layout.files.items()):
            stat = host_path.stat()
            mode = 0o755 if stat.st_mode & 0o111 else 0o644
            info = _tar_info(path, tarfile.REGTYPE, mode, stat.st_size)
            info.mtime = int(stat.st_mtime)
            with host_path.open("rb") as file:
                tar.addfile(info, file)
            total += stat.st_size
    return total


def image_inputs_label(client: Any, tag: str) -> str | None:
    """The inputs label of image `tag`, None if there is no such image."""
    import docker.errors

    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    labels = image.labels or {}
    return str(labels.get(INPUTS_LABEL, ""))


def remove_if_dangling(client: Any, image_id: str) -> None:
    """Remove an image a rebuild untagged, unless something still uses it (its untagged
    parents go with it)."""
    import docker.errors

    try:
        if not client.images.get(image_id).tags:
            client.images.remove(image_id, noprune=False)
            log.info("removed replaced image id=%s", image_id)
    except docker.errors.ImageNotFound:
        pass  # already removed with a child it was the parent of
    except docker.errors.APIError as error:  # in use by a container or a child image
        log.info("kept replaced image id=%s reason=%s", image_id, error.explanation)


def build_base_image(client: Any, tag: str = BASE_TAG_DEFAULT, *, force: bool = False) -> str:
    """Builds (or keeps) the base image `tag`; returns its id. Skips the build when the
    image exists with the same inputs hash, unless `force`."""
    digest = inputs_hash()
    if not force and image_inputs_label(client, tag) == digest:
        log.info("base image is up to date tag=%s inputs=%s", tag, digest)
        return str(client.images.get(tag).id)
    previous = (
        str(client.images.get(tag).id) if image_inputs_label(client, tag) is not None else None
    )
    started = time.monotonic()
    layout = runtime_layout()
    repository, _, version = tag.rpartition(":")
    if not repository:
        repository, version = tag, "latest"
    with tempfile.TemporaryDirectory(prefix="hastream-base-") as scratch:
        tarball = Path(scratch) / "rootfs.tar"
        with tarball.open("wb") as output:
            size = write_tarball(layout, output)
        log.info("importing base image tag=%s files=%d bytes=%d", tag, len(layout.files), size)
        changes = [*IMAGE_CHANGES, f"LABEL {INPUTS_LABEL}={digest}"]
        # From a file: the SDK streams it with a Content-Length (its chunked mode for file
        # objects sends unframed bytes that the engine refuses: "header line too long").
        response = client.api.import_image_from_file(
            str(tarball), repository=repository, tag=version, changes=changes
        )
    image_id = _imported_id(response)
    log.info(
        "built base image tag=%s id=%s seconds=%.1f", tag, image_id, time.monotonic() - started
    )
    _smoke_test(client, tag)
    if previous is not None and previous != image_id:
        remove_if_dangling(client, previous)
    return image_id


def _imported_id(response: Any) -> str:
    text = response if isinstance(response, str) else str(response)
    match = re.search(r"sha256:[0-9a-f]{64}", text)
    if match is None:
        raise BaseImageError(f"docker import did not return an image id: {text[:500]}")
    return match.group(0)


def _smoke_test(client: Any, tag: str) -> None:
    """The image runs python and imports every runtime distribution."""
    modules = "grpc, google.protobuf, pyarrow, pysyncobj, cryptography.fernet"
    code = f"import sys, {modules}; print(sys.prefix, sys.version.split()[0])"
    output = client.containers.run(tag, ["python", "-c", code], remove=True, network_mode="none")
    log.info("base image smoke test: %s", output.decode().strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.docker.base_image", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tag", default=BASE_TAG_DEFAULT)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--list", action="store_true", help="print the file list, build nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        if args.list:
            layout = runtime_layout()
            for path in sorted(layout.all_paths()):
                print(path)
            return 0
        import docker

        image_id = build_base_image(docker.from_env(), args.tag, force=args.force)
    except BaseImageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.tag} {image_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
