"""Picking a port to listen on: a service's data plane when none is configured, and the launcher's
services and the tests' processes."""

from __future__ import annotations

import random
import socket
from pathlib import Path

PICKED_PORTS_FROM = 20000  # free_port picks from here up to the ephemeral range


def free_port(host: str = "127.0.0.1") -> int:
    """A port free to listen on, picked below the kernel's ephemeral range when there is room: a
    port from that range can meanwhile become the source port of an outgoing connection, and a
    readiness probe to it before its service listens can even connect to itself (TCP
    self-connect), read its own request back and take the port."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randint(PICKED_PORTS_FROM, low - 1) if low > PICKED_PORTS_FROM + 1000 else 0
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError(f"no free port on {host}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # unknown: let the kernel choose
