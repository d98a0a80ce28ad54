"""A stand-in for vsock in a real broker, for hosts with no vsock loopback (these VMs: nothing here can connect to
the host's own vsock port). Loaded by the broker's interpreter (its PYTHONPATH names this directory) when
GPB_TEST_VSOCK_STANDIN names a socket path: the broker's vsock_port listener is then a Unix socket at that path, and
a peer of it is named as the vsock guest it stands for, by the abstract address it bound (``\\0gpb-guest-CID-N``),
as the host's kernel names a real guest by its CID. Everything else (the broker, its gate, gRPC, PoCL) is real.
The variables are removed at once: the broker's workers and other children never see them."""

from __future__ import annotations

import os
import socket
from typing import Any

_path = os.environ.pop("GPB_TEST_VSOCK_STANDIN", "")
if _path:
    os.environ.pop("PYTHONPATH", None)

    from gpubroker.broker.front import _server, listeners
    from gpubroker.wire.addresses import VsockAddress

    def _listen_standin(port: int, cid: int = -1, backlog: int = 128) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(_path)
        sock.listen(backlog)
        return sock

    _real_peer_of = listeners.peer_of

    def _peer_of(conn: socket.socket, accepted: Any, owners: Any = None,
                 networks: listeners.PeerNetworks = listeners.DEFAULT_NETWORKS) -> listeners.Peer:
        if conn.family == socket.AF_UNIX and conn.getsockname() == _path:
            _, _, cid, n = bytes(accepted).decode().split("-")  # (an unbound peer fails here: refused)
            return listeners.Peer(-1, -1, VsockAddress(int(cid), 1024 + int(n)), accepted)
        return _real_peer_of(conn, accepted, owners, networks)

    _server.listen_vsock = _listen_standin  # type: ignore[assignment]
    listeners.peer_of = _peer_of
