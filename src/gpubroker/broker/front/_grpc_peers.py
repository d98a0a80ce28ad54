"""Per-peer caps on the gRPC server's connections, which gRPC cannot count per peer.

gRPC core caps a listener's connections in all (``grpc.max_allowed_incoming_connections``) and closes one with no
call after ``grpc.max_connection_idle_ms``, but it accepts its connections itself and has no per-peer limit, so one
peer could hold every slot. The connections are this process's own descriptors, though: ``GrpcPeerCensus`` looks
at them a few times a second, counts those accepted on the broker's gRPC listeners by peer (the uid on a Unix
socket, from SO_PEERCRED; the address on TCP) and shuts down the newest of any peer past its cap. gRPC then sees
the connection end and closes it as if the peer had hung up.

Each descriptor is examined through a duplicate of it, and shut down only through a duplicate whose socket is the
one that was counted (the same inode, held open by the duplicate): a descriptor that gRPC closed and the process
reused meanwhile is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
from collections.abc import Iterator

from gpubroker.broker.front._status import cancel_and_wait, log_failure
from gpubroker.broker.front.auth import RateLimitedLog, peer_credentials

__all__ = ["GrpcPeerCensus"]

log = logging.getLogger("gpubroker.server")
audit = logging.getLogger("gpubroker.audit")
# How often the connections are counted: the most a peer may stay past its cap (while gRPC's total cap, which
# refuses at once, still holds). Quickly while connections come; slowly when none did since the last count (a
# count reads every descriptor's link in /proc: about 10 us each).
CENSUS_INTERVAL = 0.2
QUIET_INTERVAL = 1.0


@dataclasses.dataclass
class _Seen:
    peer: str | None  # None: not a connection of a gRPC listener
    order: int  # when it was first seen: the newest over a peer's cap are shut down first


def _socket_inode(fd: int) -> int | None:
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if not link.startswith("socket:["):
        return None
    return int(link[len("socket:["):-1])


def _host(address: str) -> str:
    return address.removeprefix("::ffff:")  # (gRPC listens dual-stack: IPv4 peers come as v4-mapped addresses)


class GrpcPeerCensus:
    """Counts the gRPC listeners' connections per peer and shuts down those past ``max_per_peer``."""

    def __init__(self, addresses: list[str], max_per_peer: int, interval: float = CENSUS_INTERVAL,
                 quiet_interval: float = QUIET_INTERVAL) -> None:
        # The bound listen addresses: unix:PATH, HOST:PORT (a port of 0 already resolved).
        self.unix_paths = {a[len("unix:"):] for a in addresses if a.startswith("unix:")}
        self.tcp_ports = {int(a.rsplit(":", 1)[1]) for a in addresses if not a.startswith("unix:")}
        self.max_per_peer = max_per_peer
        self.interval = interval
        self.quiet_interval = quiet_interval
        self._seen: dict[int, _Seen] = {}  # socket inode -> what it is
        self._order = 0
        self._refusals = RateLimitedLog(audit)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="grpc peer census")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            busy = True
            try:
                busy = self.scan()
            except Exception as exc:  # a census that fails must not end the broker; try again next time
                log_failure(log, "counting the gRPC connections per peer failed", exc)
            await asyncio.sleep(self.interval if busy else self.quiet_interval)

    def _peer_of(self, sock: socket.socket) -> str | None:
        """The peer of a connection accepted on one of the gRPC listeners; None for any other socket."""
        if sock.type != socket.SOCK_STREAM:
            return None
        try:
            local = sock.getsockname()
            remote = sock.getpeername()
        except OSError:  # a listening socket, or one already closing
            return None
        if sock.family == socket.AF_UNIX:
            if local not in self.unix_paths:
                return None
            pid, uid = peer_credentials(sock)
            if pid == os.getpid():
                return None  # the broker's own vsock relay, which caps its peers (VMs) itself
            return f"uid {uid}" if uid >= 0 else "unix"
        if sock.family in (socket.AF_INET, socket.AF_INET6) and local[1] in self.tcp_ports and remote:
            return _host(remote[0])
        return None

    def scan(self) -> bool:
        """Count once, and shut down what is over the cap; whether any connection came since the last count."""
        seen: dict[int, _Seen] = {}
        by_peer: dict[str, list[tuple[int, int, int]]] = {}  # peer -> (order, fd, inode)
        arrived = False
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            inode = _socket_inode(fd)
            if inode is None:
                continue
            entry = self._seen.get(inode)
            if entry is None:
                entry = _Seen(self._examine(fd, inode), self._order)
                self._order += 1
                arrived = arrived or entry.peer is not None
            seen[inode] = entry
            if entry.peer is not None:
                by_peer.setdefault(entry.peer, []).append((entry.order, fd, inode))
        self._seen = seen
        for peer, conns in by_peer.items():
            excess = len(conns) - self.max_per_peer
            if excess <= 0:
                continue
            self._refusals.warning("grpc peer cap", "action=refuse-connection listener=grpc peer=%s open=%d "
                                   "reason=over max_grpc_connections_per_peer (%d): closing the newest %d",
                                   peer, len(conns), self.max_per_peer, excess)
            for _order, fd, inode in sorted(conns)[-excess:]:
                self._shut_down(fd, inode)
        return arrived

    def _examine(self, fd: int, inode: int) -> str | None:
        with _duplicate(fd, inode) as sock:
            return None if sock is None else self._peer_of(sock)

    def _shut_down(self, fd: int, inode: int) -> None:
        with _duplicate(fd, inode) as sock:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # gRPC reads the end and closes its descriptor


@contextlib.contextmanager
def _duplicate(fd: int, inode: int) -> Iterator[socket.socket | None]:
    """A duplicate of ``fd`` while it is still the socket ``inode`` (None once it is not), closed after."""
    sock = _open_duplicate(fd, inode)
    try:
        yield sock
    finally:
        if sock is not None:
            sock.close()


def _open_duplicate(fd: int, inode: int) -> socket.socket | None:
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino == inode:  # (else closed and reused since it was listed)
            return socket.socket(fileno=dup)
    except OSError:
        pass
    os.close(dup)
    return None
