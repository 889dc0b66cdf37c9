"""The TCP port a worker group's rank 0 serves its rendezvous (torch's TCPStore) on.

The driver picks the port on rank 0's node and rank 0 binds it only later, when its constructor
runs ``init_process_group``. A port the kernel hands out for ``bind(("", 0))`` comes from the
ephemeral range (``net.ipv4.ip_local_port_range``, 32768-60999 by default), the same range every
outgoing connection on the node draws its local port from: on a busy node (Ray's gRPC channels, gloo's
full-mesh connections of other groups) one of them can take the port in between, and rank 0 fails with
EADDRINUSE. So the port is drawn at random from below the ephemeral range, where the kernel assigns
nothing by itself, and checked bindable; only a node with no such free port falls back to the kernel's.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)  # Linux's default
LOWEST_PORT = 20000
"""Below this many services have registered ports; the draw stays above it."""


def ephemeral_port_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The node's range of kernel-assigned local ports (Linux's default where it cannot be read)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_rendezvous_port(*, attempts: int = 64, rng: random.Random | None = None) -> int:
    """A port that is free now and outside the ephemeral range (the kernel's choice if none is found)."""
    rng = rng or random.SystemRandom()
    low, _ = ephemeral_port_range()
    if low - 1 > LOWEST_PORT:
        for _ in range(attempts):
            port = rng.randint(LOWEST_PORT, low - 1)
            if _bindable(port):
                return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
