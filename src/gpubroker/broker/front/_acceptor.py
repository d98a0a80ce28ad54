"""The front's acceptor process: every raw listener of the front accepts off the front's event loop.

A peer past ``max_connections_per_peer_per_second`` is refused as soon as its connection is accepted and its peer
named, but on the front's loop each refusal still cost an accept, an SO_PEERCRED lookup and a close (10-16 us):
one local user connecting and closing 25,000-37,000 times a second held the loop that serves every tenant's calls
(another tenant's unary p50 went from about 1 ms to 3-26 ms on a 2-core VM). So the front starts one small process
(this module, ``python -m``: no grpc, no numpy, no worker or device code; it never touches a GPU) that accepts on
every listening socket the front hands it, names each peer as the front does (``listeners.peer_of``: SO_PEERCRED
on a Unix socket, sock_diag for a local TCP peer), applies the per-peer connection rate (one ``PeerRate`` for
every listener), closes what it refuses, counts it, and hands the front only what it admits, over a Unix
SOCK_SEQPACKET socketpair: one typed message a packet (``wire/accept.py``), the connection attached (SCM_RIGHTS).
It runs at a lower CPU priority (``ACCEPTOR_NICE``): a churner's refusals cost the front's loop nothing and
compete for the CPU as a process of their own, behind the front and the workers.

Refusing after accept cannot keep the listener's backlog (one queue every peer's connect needs room in) from
filling: a churner's connections wait there until refused, and a non-blocking connect() by anyone else to a full
backlog fails (EAGAIN). So the front bans a uid that the process refuses for its rate 1,000 times within a second
from every Unix socket file, by an ACL entry the kernel checks at connect() (`ChurnBans`); and the process drains
a Unix listener in large batches with the cheapest refusal it has (`_Acceptor._accept_unix`).

A thread would not do: the accept, peer lookup and close of each refusal run Python code, which holds the GIL
the front's loop needs; a churner would take the loop's interpreter as surely as its time.

What the front takes from the process: which listener a connection came on (checked: a stream socket of that
listener's family whose local address is that listener's), and the owner of a local TCP peer's socket (looked
up as the connection was accepted, while the peer's socket surely existed). Everything else it checks itself
(``Acceptor.deliver`` names the peer again from SO_PEERCRED and the addresses), and every cap it held before it
still holds on the loop (concurrent connections per peer and in all, the pre-authentication caps). Refusals come
as counts, at most every ``REPORT_SECONDS``, into gpubroker_endpoint_refusals (reason ``connection rate``) and the
rate-limited audit lines. Out of descriptors: the process pauses a listener by itself when its own accept fails
(and says so), and when the front's does (``Pause``: the admitter could not serve a connection, or the front could
not receive one, which the kernel then closes: the one connection lost where accepting on the loop would have left
it in the backlog); connections wait in the backlog meanwhile. A listener closed by the front is shut first (the
kernel then refuses new connections whoever holds it), then closed by the process too. The process exits when
the front does (PR_SET_PDEATHSIG, and the socketpair's end); should it end first, every acceptor accepts on the
front's loop again (``accept_here``).
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import errno
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from gpubroker.broker.front._child_channel import FD_SPACE, ChildChannel, die_with_parent, start_child, take_fds
from gpubroker.broker.front._owners import SocketOwners
from gpubroker.broker.front.listeners import (
    ACCEPT_BACKOFF,
    ACCEPT_BACKOFF_MAX,
    ACCEPT_BATCH,
    DEFAULT_NETWORKS,
    GONE,
    Acceptor,
    PeerNetworks,
    PeerRate,
    out_of_descriptors,
    peer_of,
    uid_key,
)
from gpubroker.wire.accept import (
    MAX_ACCEPT_MESSAGE,
    MAX_REFUSED_PEERS,
    AcceptFailed,
    Admitted,
    Listen,
    Pause,
    Refused,
    Started,
    Unlisten,
    decode_from_acceptor,
    decode_to_acceptor,
    encode,
)

__all__ = ["ACCEPTOR_NICE", "BAN_SECONDS", "BAN_SECONDS_MAX", "CHURN_REFUSALS", "CHURN_WINDOW", "REPORT_SECONDS",
           "AcceptorProcess", "ChurnBans"]

log = logging.getLogger("gpubroker.server")
audit = logging.getLogger("gpubroker.audit")

# How much less CPU priority the acceptor process has than the front (nice): under contention it gets about a
# tenth of a core against each busy process of the front's priority.
ACCEPTOR_NICE: Final = 10
# Refusals are reported at most this often (and counted meanwhile).
REPORT_SECONDS: Final = 0.1
# How long the front waits for the process to say it has started before it accepts on its loop instead.
START_TIMEOUT: Final = 10.0
# Connections accepted and not yet taken by the front: past this, the process accepts no more until the front
# takes some (connections wait in the backlog).
MAX_UNSENT: Final = 256
# Connections a Unix listener's wakeup takes at most (the refusal path): a churner's backlog drained in one go.
DRAIN_BATCH: Final = 4096
_PEERCRED_SIZE: Final = 12  # struct ucred: pid, uid, gid
_UID: Final = struct.Struct("i")
# A local user refused for its connection rate this many times within CHURN_WINDOW seconds is connecting and
# closing in a loop (the default rate admits 200 a second): `ChurnBans` bans it from the Unix sockets for
# BAN_SECONDS, doubling while it goes on, up to BAN_SECONDS_MAX.
CHURN_REFUSALS: Final = 1000
CHURN_WINDOW: Final = 1.0
BAN_SECONDS: Final = 10.0
BAN_SECONDS_MAX: Final = 300.0
MAX_BANNED: Final = 64
# POSIX ACLs as the kernel takes them in system.posix_acl_access (linux/posix_acl_xattr.h): a version, then
# (tag, permissions, id) entries sorted by tag.
_ACL_XATTR: Final = "system.posix_acl_access"
_ACL_VERSION: Final = struct.Struct("<I")
_ACL_ENTRY: Final = struct.Struct("<HHI")
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_UNDEFINED_ID: Final = 0xFFFFFFFF


class _ToldOwner:
    """The owner of a local TCP peer's socket as the acceptor process found it (``listeners.OwnerLookup``)."""

    def __init__(self, uid: int) -> None:
        self.uid = uid

    def of(self, conn: socket.socket, peer: tuple[str, int]) -> int | None:
        return self.uid if self.uid >= 0 else None

    def close(self) -> None:
        pass


class ChurnBans:
    """Refuses a churning local user at connect, in the kernel: a uid whose connections the acceptor process refused
    for its rate `CHURN_REFUSALS` times within `CHURN_WINDOW` seconds gets a POSIX ACL entry with no permission
    on every Unix socket file of the front (``system.posix_acl_access``; the kernel checks a socket file's write
    permission at every ``connect()``, and a named user's entry decides before any group's) for `BAN_SECONDS`,
    doubling while it goes on (up to `BAN_SECONDS_MAX`).

    Why: every Unix listener has one backlog, shared by every peer, and the per-peer rate applies only after
    accept. A uid connecting and closing in a loop queues connections as fast as the acceptor refuses them, the
    backlog stays full, and anyone else's non-blocking connect() fails (EAGAIN: gRPC's UNAVAILABLE). Banned, its
    connect() fails with EACCES before a connection is made: the backlog drains, and the churn costs nothing but
    its own CPU. Uid 0 (which no permission stops) and the front's own uid are never banned; at most
    `MAX_BANNED` uids at once. A file system without POSIX ACLs: said once, and no bans (the backlog and the
    acceptor's rate are all there is)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._paths: set[str] = set()
        self._windows: dict[int, tuple[float, int]] = {}  # uid -> (window start, refusals in it)
        self._banned: dict[int, float] = {}  # uid -> when its ban ends
        self._strikes: dict[int, tuple[int, float]] = {}  # uid -> (bans in a row, when the last ended)
        self._unsupported = False

    def add(self, path: str) -> None:
        self._paths.add(path)
        if self._banned:
            self._apply(path)

    def discard(self, path: str) -> None:
        self._paths.discard(path)

    @property
    def banned(self) -> frozenset[int]:
        return frozenset(self._banned)

    def refused(self, key: str, connections: int, now: float | None = None) -> None:
        """``connections`` of the peer ``key`` were refused for its rate: ban it if it is a churning local user."""
        uid_text = key.removeprefix("uid ")
        if uid_text == key or not uid_text.isdigit() or self._unsupported:
            return
        uid = int(uid_text)
        if uid in (0, os.getuid()) or uid in self._banned:
            return
        now = time.monotonic() if now is None else now
        start, count = self._windows.get(uid, (now, 0))
        if now - start > CHURN_WINDOW:
            start, count = now, 0
        count += connections
        self._windows[uid] = (start, count)
        if len(self._windows) > MAX_REFUSED_PEERS:
            self._windows = {uid: (start, count)}
        if count >= CHURN_REFUSALS and len(self._banned) < MAX_BANNED:
            self._ban(uid, now)

    def _ban(self, uid: int, now: float) -> None:
        del self._windows[uid]
        strikes, ended = self._strikes.get(uid, (0, 0.0))
        if now - ended > BAN_SECONDS_MAX:
            strikes = 0
        seconds = min(BAN_SECONDS_MAX, BAN_SECONDS * 2 ** strikes)
        self._banned[uid] = now + seconds
        for path in list(self._paths):
            self._apply(path)
        if self._unsupported:
            del self._banned[uid]
            return
        self._strikes[uid] = (strikes + 1, now + seconds)
        self._loop.call_later(seconds, self._lift, uid)
        audit.warning("action=ban-uid peer=uid %d reason=connecting and closing in a loop (%d connections refused "
                      "for max_connections_per_peer_per_second within %g s): its connect() to the front's Unix "
                      "sockets refused by the kernel for %g s", uid, CHURN_REFUSALS, CHURN_WINDOW, seconds)

    def _lift(self, uid: int) -> None:
        if self._banned.pop(uid, None) is None:
            return
        for path in list(self._paths):
            self._apply(path)

    def _apply(self, path: str) -> None:
        """Give the socket file at ``path`` an ACL of its mode plus one empty entry per banned uid (none: no ACL)."""
        try:
            if not self._banned:
                with contextlib.suppress(OSError):
                    os.removexattr(path, _ACL_XATTR)
                return
            mode = os.stat(path).st_mode
            owner, group, other = (mode >> 6) & 7, (mode >> 3) & 7, mode & 7
            entries = [(_ACL_USER_OBJ, owner, _ACL_UNDEFINED_ID)]
            entries += [(_ACL_USER, 0, uid) for uid in sorted(self._banned)]
            entries += [(_ACL_GROUP_OBJ, group, _ACL_UNDEFINED_ID), (_ACL_MASK, group, _ACL_UNDEFINED_ID),
                        (_ACL_OTHER, other, _ACL_UNDEFINED_ID)]
            os.setxattr(path, _ACL_XATTR, _ACL_VERSION.pack(2) + b"".join(_ACL_ENTRY.pack(*e) for e in entries))
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP) and not self._unsupported:
                self._unsupported = True
                log.warning("cannot ban a churning uid from %s: its file system has no POSIX ACLs (%s); a uid "
                            "connecting and closing in a loop can keep its backlog full", path, exc.strerror)
            elif exc.errno != errno.ENOENT:
                log.warning("cannot set the ACL of %s: %s", path, exc.strerror)


# -- the front's side --------------------------------------------------------------------------------------------


class AcceptorProcess:
    """The front's handle on its acceptor process (``listeners.OffLoop``): `start` it on the front's loop before
    any acceptor starts, `close` it after the last has closed."""

    def __init__(self, rate: PeerRate, networks: PeerNetworks = DEFAULT_NETWORKS) -> None:
        self.rate = rate
        self.networks = networks
        self.process: subprocess.Popen[bytes] | None = None
        self._channel: ChildChannel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._acceptors: dict[int, Acceptor] = {}
        self._ids: dict[Acceptor, int] = {}
        self._next_id = 0
        self._closed = False
        self._started: asyncio.Future[None] | None = None
        self.bans: ChurnBans | None = None

    @property
    def alive(self) -> bool:
        return self._channel is not None

    async def start(self) -> None:
        """Start the process (on the front's loop), and wait until it runs: a front that says it is ready accepts.
        A process that does not start in time is killed, and the acceptors accept on the loop."""
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self.bans = ChurnBans(self._loop)
        self._thread = threading.get_ident()
        self.process, front = start_child(__name__, [
            "--rate", repr(self.rate.rate), "--burst", repr(self.rate.burst), "--ipv4", str(self.networks.ipv4),
            "--ipv6", str(self.networks.ipv6), "--nice", str(ACCEPTOR_NICE)])
        self._channel = ChildChannel(front, self._loop, "the acceptor process", self._read, self._gone)
        try:
            await asyncio.wait_for(asyncio.shield(self._started), START_TIMEOUT)
        except TimeoutError:
            self._gone(f"it did not start within {START_TIMEOUT:g} s")
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            return
        if self.alive:
            log.info("acceptor process started (pid %d, nice +%d)", self.process.pid, ACCEPTOR_NICE)

    async def close(self) -> None:
        """End the process (every acceptor closed by now) and wait for it."""
        self._closed = True
        self._drop_channel()
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await asyncio.to_thread(self.process.wait)

    def _drop_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    # -- listeners.OffLoop (from any thread: the gRPC gate may run a loop of its own) -----------------------

    def register(self, acceptor: Acceptor) -> None:
        self._on_front(self._register, acceptor)

    def unregister(self, acceptor: Acceptor) -> None:
        self._on_front(self._unregister, acceptor)

    def pause(self, acceptor: Acceptor, seconds: float) -> None:
        self._on_front(self._pause, acceptor, seconds)

    def _on_front(self, call: Callable[..., None], *args: object) -> None:
        if self._loop is None or threading.get_ident() == self._thread:
            call(*args)
        else:
            with contextlib.suppress(RuntimeError):  # (the front's loop is closed: the process is gone)
                self._loop.call_soon_threadsafe(call, *args)

    def _register(self, acceptor: Acceptor) -> None:
        if self._channel is None:
            acceptor.accept_here()
            return
        number = self._next_id
        self._next_id += 1
        self._acceptors[number] = acceptor
        self._ids[acceptor] = number
        try:
            fd = os.dup(acceptor.sock.fileno())
        except OSError as exc:  # (out of descriptors: this listener accepts on the loop)
            log.error("%s listener %s: cannot hand it to the acceptor process (%s): accepting on the front's loop",
                      acceptor.kind, acceptor.name, exc.strerror)
            del self._acceptors[number], self._ids[acceptor]
            acceptor.accept_here()
            return
        self._send(encode(Listen(number, acceptor.kind)), fd)
        if (path := _unix_path(acceptor.sock)) and self.bans is not None:
            self.bans.add(path)

    def _unregister(self, acceptor: Acceptor) -> None:
        number = self._ids.pop(acceptor, None)
        if number is None:
            return
        del self._acceptors[number]
        self._send(encode(Unlisten(number)), None)
        if (path := _unix_path(acceptor.sock)) and self.bans is not None:
            self.bans.discard(path)

    def _pause(self, acceptor: Acceptor, seconds: float) -> None:
        number = self._ids.get(acceptor)
        if number is not None:
            self._send(encode(Pause(number, min(60.0, seconds))), None)

    # -- the channel (on the front's loop) ---------------------------------------------------------------------

    def _send(self, payload: bytes, fd: int | None) -> None:
        """Send a message (with ``fd``, which is then closed here) now, or as soon as the channel takes it."""
        if self._channel is None:
            if fd is not None:
                os.close(fd)
            return
        self._channel.send(payload, fd)

    def _read(self) -> None:
        channel = self._channel
        for _ in range(ACCEPT_BATCH):
            if channel is None or self._channel is not channel:
                return
            got = channel.receive(MAX_ACCEPT_MESSAGE)
            if got is None:
                return
            payload, fds, truncated = got
            if not payload:
                for fd in fds:
                    os.close(fd)
                self._gone("it ended")
                return
            try:
                self._on_message(payload, fds, truncated=truncated)
            except Exception as exc:  # (a bug of ours: one message must not stop the front's accepting)
                log.error("acceptor process: a message failed: %r", exc)
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def _on_message(self, payload: bytes, fds: list[int], truncated: bool) -> None:
        """One message of the process; the descriptors in ``fds`` that are taken are removed from it."""
        try:
            message = decode_from_acceptor(payload)
        except ValueError as exc:
            log.error("acceptor process: a message that is not one (%s): ignored", str(exc)[:200])
            return
        if isinstance(message, Refused):
            self._on_refused(message)
            return
        if isinstance(message, Started):
            if self._started is not None and not self._started.done():
                self._started.set_result(None)
            return
        acceptor = self._acceptors.get(message.listener)
        if isinstance(message, AcceptFailed):
            if acceptor is not None:
                self._on_loop(acceptor, acceptor.failed, message.errno, message.reason, message.paused)
            return
        if len(fds) != 1:
            if truncated and acceptor is not None:
                # The front could not take the connection (out of descriptors): the kernel closed it. Pause the
                # listener, so that the next ones wait in the backlog instead.
                self._on_loop(acceptor, acceptor.back_off, OSError(errno.EMFILE, os.strerror(errno.EMFILE)))
            return
        fd = fds.pop()
        try:
            conn = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            return
        if acceptor is None or not _accepted_on(conn, acceptor.sock):
            conn.close()  # (a listener closed meanwhile)
            return
        self._on_loop(acceptor, acceptor.deliver, conn, _ToldOwner(message.owner))

    def _on_refused(self, message: Refused) -> None:
        named: dict[int, int] = {}
        for number, key, connections in message.peers:
            acceptor = self._acceptors.get(number)
            if acceptor is not None:
                named[number] = named.get(number, 0) + connections
                self._on_loop(acceptor, acceptor.refused, key, connections)
            if self.bans is not None:
                self.bans.refused(key, connections)
        for number, connections in message.counts:
            acceptor = self._acceptors.get(number)
            rest = connections - named.get(number, 0)
            if rest > 0 and acceptor is not None:
                self._on_loop(acceptor, self.rate.count, acceptor.kind, rest)

    def _on_loop(self, acceptor: Acceptor, call: Callable[..., None], *args: object) -> None:
        loop = acceptor.loop
        if loop is None or loop is self._loop:
            call(*args)
        else:
            with contextlib.suppress(RuntimeError):  # (its loop is closed)
                loop.call_soon_threadsafe(call, *args)

    def _gone(self, why: str) -> None:
        self._drop_channel()
        if self._started is not None and not self._started.done():
            self._started.set_result(None)  # (start ends: every acceptor accepts on the loop)
        if self._closed:
            return
        log.error("the acceptor process is gone (%s): accepting on the front's event loop from now on", why)
        acceptors, self._acceptors, self._ids = list(self._acceptors.values()), {}, {}
        for acceptor in acceptors:
            self._on_loop(acceptor, acceptor.accept_here)


def _unix_path(sock: socket.socket) -> str:
    """A Unix listener's socket file ("" for any other socket, or one with no file)."""
    if sock.family != socket.AF_UNIX:
        return ""
    try:
        name = sock.getsockname()
    except OSError:
        return ""
    return name if isinstance(name, str) and name.startswith("/") else ""


def _accepted_on(conn: socket.socket, listening: socket.socket) -> bool:
    """``conn`` is a stream socket accepted on ``listening``: its family, and its local address (a Unix socket's
    path; a TCP or vsock port)."""
    if conn.type != socket.SOCK_STREAM or conn.family != listening.family:
        return False
    try:
        mine, theirs = conn.getsockname(), listening.getsockname()
    except OSError:
        return False
    if conn.family == socket.AF_UNIX:
        return bool(mine == theirs)
    return bool(mine[1] == theirs[1])


# -- the acceptor process ----------------------------------------------------------------------------------------


class _Listening:
    def __init__(self, number: int, kind: str, sock: socket.socket) -> None:
        self.number, self.kind, self.sock = number, kind, sock
        self.owners = SocketOwners() if sock.family in (socket.AF_INET, socket.AF_INET6) else None
        self.backoff = 0.0
        self.paused_until = 0.0
        self.watched = False

    def close(self) -> None:
        self.sock.close()
        if self.owners is not None:
            self.owners.close()


class _Acceptor:
    """The process's one loop: accept on every listener, refuse past the rate, hand over the rest."""

    def __init__(self, channel: socket.socket, rate: PeerRate, networks: PeerNetworks) -> None:
        self.channel = channel
        self.rate = rate
        self.networks = networks
        self.poll = select.epoll()
        self.listening: dict[int, _Listening] = {}
        self.by_fd: dict[int, _Listening] = {}
        self.unsent: collections.deque[tuple[bytes, socket.socket | None, int]] = collections.deque()
        self.refused: dict[int, int] = {}
        self.refused_peers: dict[tuple[int, str], int] = {}
        self.uid_keys: dict[int, str] = {}  # (a Unix peer's uid -> its `Peer.key`, made once)
        self.reported = 0.0
        self.channel_events = select.EPOLLIN
        self.poll.register(channel.fileno(), self.channel_events)
        self.unsent.append((encode(Started(os.getpid())), None, -1))

    def run(self) -> None:
        self._flush()  # (Started)
        while True:
            timeout = self._timeout()
            for fd, events in self.poll.poll(timeout):
                if fd == self.channel.fileno():
                    if events & select.EPOLLOUT:
                        self._flush()
                    if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and not self._control():
                        return
                elif (listening := self.by_fd.get(fd)) is not None:
                    self._accept(listening)
            self._resume()
            self._report()
            self._watch_all()

    def _timeout(self) -> float:
        now = time.monotonic()
        waits = [listening.paused_until - now for listening in self.listening.values() if listening.paused_until]
        if self.refused:
            waits.append(self.reported + REPORT_SECONDS - now)
        return max(0.0, min(waits)) if waits else -1

    # -- the front's messages ---------------------------------------------------------------------------

    def _control(self) -> bool:
        """Take the front's messages; False once the front is gone."""
        for _ in range(ACCEPT_BATCH):
            try:
                payload, ancdata, _, _ = self.channel.recvmsg(MAX_ACCEPT_MESSAGE, FD_SPACE)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            fds = take_fds(ancdata)
            if not payload:
                return False
            message = decode_to_acceptor(payload)
            if isinstance(message, Listen) and len(fds) == 1:
                sock = socket.socket(fileno=fds.pop())
                sock.setblocking(False)
                self.listening[message.listener] = self.by_fd[sock.fileno()] = _Listening(message.listener,
                                                                                        message.kind, sock)
            elif isinstance(message, Unlisten):
                self._unlisten(message.listener)
            elif isinstance(message, Pause) and (paused := self.listening.get(message.listener)) is not None:
                self._stop_watching(paused)
                paused.paused_until = time.monotonic() + message.seconds
            for fd in fds:
                os.close(fd)
        return True

    def _unlisten(self, number: int) -> None:
        listening = self.listening.pop(number, None)
        if listening is None:
            return
        self._stop_watching(listening)
        del self.by_fd[listening.sock.fileno()]
        listening.close()
        kept: collections.deque[tuple[bytes, socket.socket | None, int]] = collections.deque()
        for payload, conn, owner in self.unsent:
            if owner == number and conn is not None:
                conn.close()
            else:
                kept.append((payload, conn, owner))
        self.unsent = kept
        self.refused.pop(number, None)

    # -- accepting ----------------------------------------------------------------------------------------

    def _watch_all(self) -> None:
        """Watch every listener not paused, while the front takes what was handed over."""
        full = len(self.unsent) >= MAX_UNSENT
        for listening in self.listening.values():
            if full:
                self._stop_watching(listening)
            elif not listening.watched and not listening.paused_until:
                self.poll.register(listening.sock.fileno(), select.EPOLLIN)
                listening.watched = True

    def _stop_watching(self, listening: _Listening) -> None:
        if listening.watched:
            self.poll.unregister(listening.sock.fileno())
            listening.watched = False

    def _resume(self) -> None:
        now = time.monotonic()
        for listening in self.listening.values():
            if listening.paused_until and now >= listening.paused_until:
                listening.paused_until = 0.0

    def _accept(self, listening: _Listening) -> None:
        if listening.sock.family == socket.AF_UNIX:
            self._accept_unix(listening)
            return
        for _ in range(ACCEPT_BATCH):
            if len(self.unsent) >= MAX_UNSENT or (accepted := self._next(listening)) is None:
                return
            conn, address = accepted
            try:
                peer = peer_of(conn, address, listening.owners, self.networks)
            except Exception:  # (its socket is gone, say): named as the front would not, refused
                conn.close()
                continue
            if not self.rate.take(peer.key):
                conn.close()
                self.refused[listening.number] = self.refused.get(listening.number, 0) + 1
                self._refused_peer(listening.number, peer.key[:128])
                continue
            owner = peer.uid if peer.local else -1
            self.unsent.append((encode(Admitted(listening.number, owner)), conn, listening.number))
            self._flush()

    def _accept_unix(self, listening: _Listening) -> None:
        """`_accept` on a Unix listener, with the cheapest refusal there is: accept, SO_PEERCRED, the peer's
        bucket, close (no `Peer` made; its key is the one `Peer.key` gives), up to `DRAIN_BATCH` at a time. A
        churner's connections queue in the one backlog every peer's connect needs room in: every microsecond of
        Python here is one the backlog stays fuller."""
        take, keys = self.rate.take, self.uid_keys
        refused = 0
        try:
            for _ in range(DRAIN_BATCH):
                if len(self.unsent) >= MAX_UNSENT or (accepted := self._next(listening)) is None:
                    return
                conn = accepted[0]
                try:
                    uid = _UID.unpack_from(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED_SIZE),
                                           4)[0]
                except OSError:  # (its socket is gone): named as the front would not, refused
                    conn.close()
                    continue
                key = keys.get(uid)
                if key is None:
                    key = uid_key(uid)
                    if len(keys) < MAX_REFUSED_PEERS:
                        keys[uid] = key
                if not take(key):
                    conn.close()
                    refused += 1
                    self._refused_peer(listening.number, key)
                    continue
                self.unsent.append((encode(Admitted(listening.number, -1)), conn, listening.number))
                self._flush()
        finally:
            if refused:
                self.refused[listening.number] = self.refused.get(listening.number, 0) + refused

    def _next(self, listening: _Listening) -> tuple[socket.socket, Any] | None:
        """The next connection of ``listening``'s backlog and its address, skipping those gone before they were
        taken; None when there is none now, or accept() failed (`_accept_failed` has paused or ended it)."""
        while True:
            try:
                accepted = listening.sock.accept()
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                if exc.errno in GONE:
                    continue
                self._accept_failed(listening, exc)
                return None
            listening.backoff = 0.0
            return accepted

    def _refused_peer(self, listener: int, key: str) -> None:
        """Count a refusal of ``key``'s on ``listener`` by name, for the report's first MAX_REFUSED_PEERS peers."""
        peer = (listener, key)
        if peer in self.refused_peers or len(self.refused_peers) < MAX_REFUSED_PEERS:
            self.refused_peers[peer] = self.refused_peers.get(peer, 0) + 1

    def _accept_failed(self, listening: _Listening, exc: OSError) -> None:
        """accept() failed (but for a connection gone before it was taken): out of descriptors or memory, pause
        the listener (doubling while that lasts); anything else, end it. The front is told either way."""
        if out_of_descriptors(exc):
            listening.backoff = min(ACCEPT_BACKOFF_MAX, max(ACCEPT_BACKOFF, listening.backoff * 2))
            listening.paused_until = time.monotonic() + listening.backoff
            self._stop_watching(listening)
            self._tell(AcceptFailed(listening.number, exc.errno or 0, exc.strerror or str(exc), listening.backoff))
            return
        self._stop_watching(listening)
        del self.by_fd[listening.sock.fileno()]
        del self.listening[listening.number]
        listening.close()
        self._tell(AcceptFailed(listening.number, exc.errno or 0, (exc.strerror or str(exc))[:200]))

    # -- to the front ---------------------------------------------------------------------------------------

    def _tell(self, message: AcceptFailed | Refused) -> None:
        self.unsent.append((encode(message), None, -1))
        self._flush()

    def _report(self) -> None:
        if not self.refused or time.monotonic() - self.reported < REPORT_SECONDS:
            return
        self._tell(Refused(tuple(self.refused.items()),
                           tuple((number, key, n) for (number, key), n in self.refused_peers.items())))
        self.refused.clear()
        self.refused_peers.clear()
        self.reported = time.monotonic()

    def _flush(self) -> None:
        while self.unsent:
            payload, conn, _ = self.unsent[0]
            try:
                if conn is None:
                    self.channel.send(payload)
                else:
                    self.channel.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                      array.array("i", [conn.fileno()]))])
            except (BlockingIOError, InterruptedError):
                self._want_writable(True)
                return
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.ECONNRESET):
                    raise SystemExit(0) from None  # (the front is gone)
                raise
            self.unsent.popleft()
            if conn is not None:
                conn.close()  # (the front has it now)
        self._want_writable(False)

    def _want_writable(self, wanted: bool) -> None:
        events = select.EPOLLIN | (select.EPOLLOUT if wanted else 0)
        if events != self.channel_events:
            self.channel_events = events
            self.poll.modify(self.channel.fileno(), events)


def main(argv: list[str]) -> None:
    options = dict(zip(argv[::2], argv[1::2], strict=False))
    die_with_parent(int(options["--parent"]))
    os.nice(int(options["--nice"]))
    channel = socket.socket(fileno=int(options["--channel"]))
    channel.setblocking(False)
    rate = PeerRate(float(options["--rate"]), float(options["--burst"]))
    _Acceptor(channel, rate, PeerNetworks(int(options["--ipv4"]), int(options["--ipv6"]))).run()


if __name__ == "__main__":
    main(sys.argv[1:])
