"""Free TCP ports for the processes the tools start (local clusters, Docker deployments).

A port is picked free and handed to a process that binds it seconds later, and it is
free again while a killed node waits for its restart. Anything else on the machine that
asks the kernel for a port meanwhile (`bind(("", 0))`, or a `connect()`) may be handed the
same one. Two ways to pick, then:
- the kernel's choice (`bind` to port 0), from its ephemeral range: enough when this process
  is the only one picking;
- a *band*: random ports of a range the caller owns, checked free by binding them. A band
  outside the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999
  by default) is never handed out by the kernel, so processes with separate bands never
  meet: the Docker deployments pick from 61000-65535, and each pytest-xdist worker gets its
  own band below 32768 (`PORT_BAND_VARIABLE`, set by tests/conftest.py).
"""

from __future__ import annotations

import collections
import os
import secrets
import socket
import threading
from collections.abc import Iterable
from typing import Final

# "low-high" (inclusive): pick local clusters' ports from this band (tests/conftest.py).
PORT_BAND_VARIABLE: Final = "HASTREAM_PORT_BAND"
_TRIES_PER_PORT: Final = 16
# The ports this process handed out from a band lately. A port is picked before the process
# it is for binds it, so a pick meanwhile (a second cluster made before the first starts, a
# metrics port added to a written cfg) finds it free and could hand it out again; such a
# port is skipped while the band has others (the kernel seldom repeats a port soon either).
_RECENT_MAX: Final = 1024
_recent: collections.deque[int] = collections.deque(maxlen=_RECENT_MAX)
_recent_lock = threading.Lock()


class PortsUnavailable(RuntimeError):
    """Not `count` free ports in `band` on `host`."""

    def __init__(self, count: int, host: str, band: range) -> None:
        self.count = count
        self.host = host
        self.band = band
        super().__init__(
            f"could not find {count} free ports in {band.start}-{band.stop - 1} on {host}"
        )


def band_from_environment() -> range | None:
    """The band `PORT_BAND_VARIABLE` names, or None when it is unset or empty."""
    text = os.environ.get(PORT_BAND_VARIABLE, "").strip()
    if not text:
        return None
    low, sep, high = text.partition("-")
    try:
        band = range(int(low), int(high) + 1) if sep else None
    except ValueError:
        band = None
    if band is None or not (1024 <= band.start < band.stop <= 65536):
        raise ValueError(f"{PORT_BAND_VARIABLE}={text!r}: expected low-high within 1024-65535")
    return band


def free_ports(
    count: int,
    host: str = "127.0.0.1",
    *,
    band: range | None = None,
    exclude: Iterable[int] = (),
) -> list[int]:
    """`count` distinct ports free on `host` now, bound together, then released: from
    `band`, else from the band the environment names, else the kernel's choice."""
    if band is None:
        band = band_from_environment()
    if band is None:
        return _kernel_ports(count, host)
    excluded = set(exclude)
    with _recent_lock:
        try:
            ports = _band_ports(count, host, band, excluded | set(_recent))
        except PortsUnavailable:
            ports = _band_ports(count, host, band, excluded)  # a small band: reuse is allowed
        _recent.extend(ports)
    return ports


def _kernel_ports(count: int, host: str) -> list[int]:
    # All bound at once: released one at a time, the kernel may hand the same port out twice.
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _band_ports(count: int, host: str, band: range, excluded: set[int]) -> list[int]:
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(count * _TRIES_PER_PORT):  # bounded: a port taken or excluded is skipped
            port = band.start + secrets.randbelow(len(band))
            if port in excluded or port in ports:
                continue
            sock = socket.socket()
            sockets.append(sock)
            try:
                sock.bind((host if host != "0.0.0.0" else "", port))
            except OSError:
                continue  # in use on the host
            ports.append(port)
            if len(ports) == count:
                return ports
    finally:
        for sock in sockets:
            sock.close()
    raise PortsUnavailable(count, host, band)
