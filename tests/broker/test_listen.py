"""Listening sockets (broker/front/listen.py): a Unix socket replaces a stale socket and nothing else, has its mode
before anyone can connect, and a failed bind leaves nothing open."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from gpubroker.broker.front.listen import listen_tcp, listen_unix
from gpubroker.wire.errors import InvalidArgument


def test_unix_listener_replaces_a_stale_socket_only(tmp_path: Path) -> None:
    path = tmp_path / "run" / "broker.sock"  # (its directory is made)
    first = listen_unix(path, 0o600)
    first.close()  # a stale socket, as a previous run leaves it
    second = listen_unix(path, 0o640)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
        assert second.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
    finally:
        second.close()
    regular = tmp_path / "data"
    regular.write_bytes(b"keep me")
    with pytest.raises(InvalidArgument, match="exists and is not a socket"):
        listen_unix(regular, 0o600)
    assert regular.read_bytes() == b"keep me"
    link = tmp_path / "link.sock"
    link.symlink_to(path)  # a link, even to a socket, is no stale socket of ours: never followed nor removed
    with pytest.raises(InvalidArgument, match="exists and is not a socket"):
        listen_unix(link, 0o600)
    assert link.is_symlink()


def test_a_failed_bind_leaves_no_socket_open(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        listen_unix(tmp_path / ("x" * 200) / "long.sock", 0o600)  # past AF_UNIX's 108 bytes
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            listen_tcp(socket.AF_INET, taken.getsockname())
    assert len(os.listdir("/proc/self/fd")) == before
