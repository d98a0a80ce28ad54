"""What the benchmarks and the fuzz need to start a broker with a TCP link: a free loopback port."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A loopback port nothing listens on now (for ``link_listen``, whose port the client learns from the broker,
    but the fuzz and the benchmark name it up front)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
