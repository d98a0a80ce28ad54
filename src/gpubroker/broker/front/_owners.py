"""Who owns the other end of a TCP connection accepted here, when that end is on this host.

Every local process has the address 127.0.0.1 (and every address of 127.0.0.0/8, and the host's own addresses),
so counting local TCP peers by address would make all local users one peer, or let one be many. The kernel knows
the socket at the other end by the connection's four addresses, and its owner: one exact lookup through
NETLINK_SOCK_DIAG (``/proc/net/tcp{,6}``, a read of every TCP socket of the namespace, where sock_diag is missing).
`listeners.peer_of` names a local TCP peer by that uid, for every listener of the front.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct

__all__ = ["SocketOwners", "plain_host", "socket_owner"]

log = logging.getLogger("gpubroker.server")

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NLMSG = struct.Struct("=IHHII")  # struct nlmsghdr
_DIAG_REQ = struct.Struct("=BBBBI")  # struct inet_diag_req_v2 up to its socket id
_DIAG_PORTS = struct.Struct(">HH")  # inet_diag_sockid: source and destination ports, big-endian
_DIAG_TAIL = struct.Struct("=III")  # inet_diag_sockid: interface, cookie (two words)
_DIAG_MSG_UID = struct.Struct("=IIIII")  # inet_diag_msg after family, state, timer, retrans and the sock id
_DIAG_MSG_UID_OFFSET = 4 + 48
_NO_COOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF


def _address_bytes(family: int, host: str) -> bytes:
    raw = socket.inet_pton(family, host)
    return raw + bytes(16 - len(raw))


class _SockDiag:
    """Asks the kernel (NETLINK_SOCK_DIAG) for the owner of one TCP socket, found by its four addresses: one
    exact lookup in the kernel's table, whatever the number of connections."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.seq = 0

    def owner(self, family: int, src: tuple[str, int], dst: tuple[str, int]) -> int | None:
        """The uid owning the TCP socket of ``family`` bound to ``src`` and connected to ``dst``; None if there is
        none; OSError when sock_diag itself fails (no such netlink family, say)."""
        if self.sock is None:
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
            self.sock.settimeout(1.0)  # (the kernel answers within the send; this bounds a surprise)
        self.seq = self.seq + 1 & 0x7FFFFFFF
        request = (_DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES)
                   + _DIAG_PORTS.pack(src[1], dst[1]) + _address_bytes(family, src[0]) + _address_bytes(family, dst[0])
                   + _DIAG_TAIL.pack(0, _NO_COOKIE, _NO_COOKIE))
        self.sock.send(_NLMSG.pack(_NLMSG.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, self.seq, 0)
                       + request)
        while True:
            reply = self.sock.recv(8192)
            _length, kind, _flags, seq, _pid = _NLMSG.unpack_from(reply)
            if seq != self.seq:
                continue  # (the answer to an earlier request that timed out)
            if kind == _NLMSG_ERROR:
                (error,) = struct.unpack_from("=i", reply, _NLMSG.size)
                if -error == errno.ENOENT:
                    return None
                raise OSError(-error, os.strerror(-error))
            if kind != _SOCK_DIAG_BY_FAMILY:
                raise OSError(errno.EPROTO, f"unexpected sock_diag answer {kind}")
            offset = _NLMSG.size + _DIAG_MSG_UID_OFFSET
            _expires, _rqueue, _wqueue, uid, _inode = _DIAG_MSG_UID.unpack_from(reply, offset)
            return int(uid)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _proc_address(family: int, host: str, port: int) -> str:
    """An address as /proc/net/tcp{,6} writes it: the address's 32-bit words in host byte order, then the port."""
    raw = socket.inet_pton(family, host)
    words = struct.unpack(f"={len(raw) // 4}I", raw)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _proc_owner(family: int, src: tuple[str, int], dst: tuple[str, int]) -> int | None:
    """``_SockDiag.owner`` from /proc/net/tcp{,6}: a read of every TCP socket of the namespace."""
    local, remote = _proc_address(family, *src), _proc_address(family, *dst)
    table = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
    with open(table) as lines:
        next(lines, None)  # (the header)
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and fields[1] == local and fields[2] == remote:
                return int(fields[7])
    return None


def plain_host(host: str) -> str:
    """An IPv4 address as a v4-mapped IPv6 one (a dual-stack listener's view) -> the IPv4 address."""
    return host[len("::ffff:"):] if host.startswith("::ffff:") and "." in host else host


class SocketOwners:
    """The uid owning the other end of a TCP connection accepted here, when that end is on this host. One per
    event loop's thread (its netlink socket is not shared); `close` it when done."""

    def __init__(self) -> None:
        self.diag = _SockDiag()
        self.use_diag = True

    def of(self, conn: socket.socket, peer: tuple[str, int]) -> int | None:
        local_host, local_port = conn.getsockname()[:2]
        src, dst = (plain_host(peer[0]), peer[1]), (plain_host(local_host), local_port)
        family = socket.AF_INET if "." in src[0] else socket.AF_INET6
        if self.use_diag:
            try:
                uid = self.diag.owner(family, src, dst)
                if uid is None and family == socket.AF_INET:
                    # (an IPv6 socket that reached an IPv4 address: its end is found by its v4-mapped addresses)
                    uid = self.diag.owner(socket.AF_INET6, ("::ffff:" + src[0], src[1]), ("::ffff:" + dst[0], dst[1]))
                return uid
            except OSError as exc:
                log.warning("sock_diag cannot tell who owns local TCP connections (%s): reading /proc/net/tcp "
                            "instead", exc)
                self.use_diag = False
                self.diag.close()
        uid = _proc_owner(family, src, dst)
        if uid is None and family == socket.AF_INET:
            uid = _proc_owner(socket.AF_INET6, ("::ffff:" + src[0], src[1]), ("::ffff:" + dst[0], dst[1]))
        return uid

    def close(self) -> None:
        self.diag.close()


def socket_owner(conn: socket.socket) -> int | None:
    """The uid owning the other end of a TCP connection accepted here; None when that end is not on this host
    (or already gone)."""
    owners = SocketOwners()
    try:
        return owners.of(conn, conn.getpeername())
    finally:
        owners.close()
