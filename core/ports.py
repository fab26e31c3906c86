"""Where a process that picks its own listening ports should pick them.

A port from ``bind(0)``, or any port in the kernel's ephemeral range, can be taken as the
source port of an outgoing connection (an HTTP client, a Redis connection) between the check
and the server's own bind: CI and the main job both saw servers fail with EADDRINUSE that
way. Ports below the ephemeral range are only ever taken by an explicit bind.
"""

from __future__ import annotations

import socket
from pathlib import Path

LOWEST_PICKED_PORT = 10000


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def pickable_ports() -> range:
    """Ports to pick listening ports from: below the ephemeral range."""
    return range(LOWEST_PICKED_PORT, ephemeral_range()[0])


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
