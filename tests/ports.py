"""A free TCP port on 127.0.0.1 for a server a test starts, which binds it moments later.

A port found by binding to 0 comes from the kernel's ephemeral range, so in the seconds before the server
binds it the kernel may give it to anyone else: another pytest worker's bind to 0, or the local end of any
outgoing connection (and the other worker makes many). Ports below that range are never handed out by the
kernel, and each pytest-xdist worker takes its own slice of them, so no two workers can pick the same one;
within a slice the pick is random, so a worker does not retry a port it just closed.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

LOWEST = 10_000
"""The slices start here (above the ports of common local services)."""
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port nothing listens on now, from this worker's slice (from the kernel when there is no room)."""
    first, end = _slice()
    if end - first >= 16:
        for port in random.sample(range(first, end), min(64, end - first)):
            if _bindable(port):
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _slice() -> tuple[int, int]:
    """[first, end) of the ports below the ephemeral range that are this worker's."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32_768  # Linux's default; elsewhere the kernel's own range may differ, _bindable checks
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    size = max(0, ephemeral_low - LOWEST) // workers
    return LOWEST + index * size, LOWEST + (index + 1) * size


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
