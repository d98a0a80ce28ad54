"""Listening sockets, made one way per scheme: every listener of the broker (the gRPC gate's Unix, TCP and vsock
sockets, the link's ``<socket>.fast``, TCP and vsock ports) and of ``gpubroker relay`` is bound here;
what it accepts goes through an `Acceptor` (listeners.py).

A Unix socket replaces a stale socket at its path, never any other file (a symlink included: whatever it points
to), and gets its owner and mode between bind and listen, so nobody connects while it has the umask's mode. A
socket that fails to bind or listen is closed before the error goes up.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path
from typing import Any

from gpubroker.broker.front._descriptors import set_passrights
from gpubroker.wire.errors import FailedPrecondition, InvalidArgument

__all__ = ["BACKLOG", "VMADDR_CID_ANY", "VMADDR_PORT_ANY", "listen_tcp", "listen_unix", "listen_vsock",
           "secure_unix_socket", "tcp_listeners", "vsock_socket"]

# Every listener's backlog: as many as the host allows (listen() caps it at net.core.somaxconn, 4096 by default).
# Connections a peer made and closed before they were accepted wait there too, and a Unix peer's non-blocking
# connect() fails (EAGAIN) while it is full: the deeper it is, the longer a burst the acceptor can fall behind.
BACKLOG = 65535

# socket.VMADDR_* exist only where AF_VSOCK does; the values are fixed by the Linux ABI.
VMADDR_CID_ANY = 0xFFFFFFFF
VMADDR_PORT_ANY = 0xFFFFFFFF


def secure_unix_socket(path: Path, mode: int, group: str = "") -> None:
    """Give the socket file at ``path`` its group (``group``, "" to leave it) and ``mode``."""
    if group:
        import grp

        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except KeyError:
            raise InvalidArgument(f"socket_group {group!r} does not exist") from None
    os.chmod(path, mode)


def listen_unix(path: Path, mode: int, group: str = "", backlog: int = BACKLOG,
                passrights: bool | None = None) -> socket.socket:
    """A listening Unix stream socket at ``path`` (its directory made if missing), owned by ``group`` with
    ``mode`` before anyone can connect; a stale socket there is replaced, any other file refused
    (InvalidArgument). ``passrights`` False: descriptors sent to it are refused by the kernel until a connection
    turns them on (_descriptors.py); None: the kernel's default."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise InvalidArgument(f"{path} exists and is not a socket")
        path.unlink()  # a stale socket from a previous run
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if passrights is not None:
            set_passrights(sock, passrights)
        sock.bind(str(path))
        secure_unix_socket(path, mode, group)  # before listen(): nobody connects while it has the umask's mode
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_tcp(family: int, address: Any, backlog: int = BACKLOG, v6only: bool | None = None) -> socket.socket:
    """A listening TCP socket of ``family`` bound to ``address`` (a sockaddr as getaddrinfo gives it), with
    SO_REUSEADDR (a restart rebinds while the last run's connections linger); ``v6only``: IPV6_V6ONLY's value
    for an IPv6 socket (None: the kernel's default)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if v6only is not None and family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def tcp_listeners(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to, on one port (0: the one the kernel picks for the
    first), non-blocking; socket.gaierror if ``host`` resolves to nothing, OSError if an address cannot be bound
    (but a second one that does not exist here: a host without IPv6, say)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = list(dict.fromkeys((family, sockaddr[:2]) for family, _t, _p, _c, sockaddr in infos))
    socks: list[socket.socket] = []
    try:
        for family, (ip, _port) in addresses:
            try:
                # One IPv6 address alone (``[::]``) serves IPv4 too, as gRPC's listener did.
                sock = listen_tcp(family, (ip, port), backlog, v6only=len(addresses) > 1)
            except OSError as exc:
                if socks and exc.errno == errno.EADDRNOTAVAIL:
                    continue  # (a host without IPv6, say: the first address is served)
                raise
            socks.append(sock)
            port = sock.getsockname()[1]  # (the others take the port the kernel gave the first)
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def vsock_socket() -> socket.socket:
    """An AF_VSOCK stream socket, or FailedPrecondition saying why this host has none."""
    family = getattr(socket, "AF_VSOCK", None)
    if family is None:
        raise FailedPrecondition("this platform has no AF_VSOCK sockets (vsock needs Linux)")
    try:
        return socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise FailedPrecondition(f"cannot create an AF_VSOCK socket ({exc.strerror}): this host has no vsock "
                                 "support (load vhost_vsock on a KVM host)") from None


def listen_vsock(port: int, cid: int = VMADDR_CID_ANY, backlog: int = BACKLOG) -> socket.socket:
    """A listening AF_VSOCK stream socket, or FailedPrecondition saying why there cannot be one."""
    sock = vsock_socket()
    try:
        sock.bind((cid, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            why = "the port is in use"
        elif exc.errno == errno.EACCES:
            why = "vsock ports below 1024 need CAP_NET_BIND_SERVICE"
        else:
            why = "this host has no vsock transport (load vhost_vsock on a KVM host)"
        where = "any CID" if cid == VMADDR_CID_ANY else f"CID {cid}"
        raise FailedPrecondition(f"cannot listen on vsock {where} port {port}: {exc.strerror}; {why}") from None
    return sock
