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
import ctypes
import errno
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Final

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

__all__ = ["ACCEPTOR_NICE", "REPORT_SECONDS", "AcceptorProcess"]

log = logging.getLogger("gpubroker.server")

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
_FD_SPACE: Final = socket.CMSG_SPACE(array.array("i", [0]).itemsize)
_PR_SET_PDEATHSIG: Final = 1


class _ToldOwner:
    """The owner of a local TCP peer's socket as the acceptor process found it (``listeners.OwnerLookup``)."""

    def __init__(self, uid: int) -> None:
        self.uid = uid

    def of(self, conn: socket.socket, peer: tuple[str, int]) -> int | None:
        return self.uid if self.uid >= 0 else None

    def close(self) -> None:
        pass


def _take_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            found = array.array("i")
            found.frombytes(data[:len(data) - len(data) % found.itemsize])
            fds.extend(found)
    return fds


# -- the front's side --------------------------------------------------------------------------------------------


class AcceptorProcess:
    """The front's handle on its acceptor process (``listeners.OffLoop``): `start` it on the front's loop before
    any acceptor starts, `close` it after the last has closed."""

    def __init__(self, rate: PeerRate, networks: PeerNetworks = DEFAULT_NETWORKS) -> None:
        self.rate = rate
        self.networks = networks
        self.process: subprocess.Popen[bytes] | None = None
        self._channel: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._acceptors: dict[int, Acceptor] = {}
        self._ids: dict[Acceptor, int] = {}
        self._next_id = 0
        self._unsent: collections.deque[tuple[bytes, int | None]] = collections.deque()  # (waits for the channel)
        self._writing = False
        self._closed = False
        self._started: asyncio.Future[None] | None = None

    @property
    def alive(self) -> bool:
        return self._channel is not None

    async def start(self) -> None:
        """Start the process (on the front's loop), and wait until it runs: a front that says it is ready accepts.
        A process that does not start in time is killed, and the acceptors accept on the loop."""
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._thread = threading.get_ident()
        front, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [sys.executable, "-s", "-P", "-m", __name__, "--channel", str(child.fileno()), "--parent",
                    str(os.getpid()), "--rate", repr(self.rate.rate), "--burst", repr(self.rate.burst),
                    "--ipv4", str(self.networks.ipv4), "--ipv6", str(self.networks.ipv6), "--nice", str(ACCEPTOR_NICE)]
            # subprocess (vfork + exec), as the workers are started: never a fork of a process full of threads.
            # Its stdout and stderr are the front's: it writes nothing but a traceback on a bug.
            self.process = subprocess.Popen(argv, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        except BaseException:
            front.close()
            raise
        finally:
            child.close()
        front.setblocking(False)
        self._channel = front
        self._loop.add_reader(front.fileno(), self._read)
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
        if channel is None:
            return
        assert self._loop is not None
        self._loop.remove_reader(channel.fileno())
        if self._writing:
            self._loop.remove_writer(channel.fileno())
        channel.close()
        for _, fd in self._unsent:
            if fd is not None:
                os.close(fd)
        self._unsent.clear()

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

    def _unregister(self, acceptor: Acceptor) -> None:
        number = self._ids.pop(acceptor, None)
        if number is None:
            return
        del self._acceptors[number]
        self._send(encode(Unlisten(number)), None)

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
        self._unsent.append((payload, fd))
        self._flush()

    def _flush(self) -> None:
        channel = self._channel
        assert channel is not None and self._loop is not None
        while self._unsent:
            payload, fd = self._unsent[0]
            try:
                if fd is None:
                    channel.send(payload)
                else:
                    channel.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            except (BlockingIOError, InterruptedError):
                if not self._writing:
                    self._writing = True
                    self._loop.add_writer(channel.fileno(), self._flush)
                return
            except OSError as exc:
                self._gone(f"cannot write to it ({exc.strerror})")
                return
            self._unsent.popleft()
            if fd is not None:
                os.close(fd)
        if self._writing:
            self._writing = False
            self._loop.remove_writer(channel.fileno())

    def _read(self) -> None:
        channel = self._channel
        for _ in range(ACCEPT_BATCH):
            if channel is None or self._channel is not channel:
                return
            try:
                payload, ancdata, flags, _ = channel.recvmsg(MAX_ACCEPT_MESSAGE, _FD_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._gone(f"cannot read from it ({exc.strerror})")
                return
            fds = _take_fds(ancdata)
            if not payload:
                for fd in fds:
                    os.close(fd)
                self._gone("it ended")
                return
            try:
                self._on_message(payload, fds, truncated=bool(flags & socket.MSG_CTRUNC))
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
                payload, ancdata, _, _ = self.channel.recvmsg(MAX_ACCEPT_MESSAGE, _FD_SPACE)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            fds = _take_fds(ancdata)
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
        for _ in range(ACCEPT_BATCH):
            if len(self.unsent) >= MAX_UNSENT:
                return
            try:
                conn, address = listening.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if out_of_descriptors(exc):
                    listening.backoff = min(ACCEPT_BACKOFF_MAX, max(ACCEPT_BACKOFF, listening.backoff * 2))
                    listening.paused_until = time.monotonic() + listening.backoff
                    self._stop_watching(listening)
                    self._tell(AcceptFailed(listening.number, exc.errno or 0, exc.strerror or str(exc),
                                            listening.backoff))
                    return
                if exc.errno in GONE:
                    continue
                self._stop_watching(listening)
                del self.by_fd[listening.sock.fileno()]
                del self.listening[listening.number]
                listening.close()
                self._tell(AcceptFailed(listening.number, exc.errno or 0, (exc.strerror or str(exc))[:200]))
                return
            listening.backoff = 0.0
            try:
                peer = peer_of(conn, address, listening.owners, self.networks)
            except Exception:  # (its socket is gone, say): named as the front would not, refused
                conn.close()
                continue
            if not self.rate.take(peer.key):
                conn.close()
                self.refused[listening.number] = self.refused.get(listening.number, 0) + 1
                key = (listening.number, peer.key[:128])
                if key in self.refused_peers or len(self.refused_peers) < MAX_REFUSED_PEERS:
                    self.refused_peers[key] = self.refused_peers.get(key, 0) + 1
                continue
            owner = peer.uid if peer.local else -1
            self.unsent.append((encode(Admitted(listening.number, owner)), conn, listening.number))
            self._flush()

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


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
               ctypes.c_ulong(0), ctypes.c_ulong(0))
    if os.getppid() != parent:  # (the front died before the prctl took)
        raise SystemExit(0)


def main(argv: list[str]) -> None:
    options = dict(zip(argv[::2], argv[1::2], strict=False))
    _die_with_parent(int(options["--parent"]))
    os.nice(int(options["--nice"]))
    channel = socket.socket(fileno=int(options["--channel"]))
    channel.setblocking(False)
    rate = PeerRate(float(options["--rate"]), float(options["--burst"]))
    _Acceptor(channel, rate, PeerNetworks(int(options["--ipv4"]), int(options["--ipv6"]))).run()


if __name__ == "__main__":
    main(sys.argv[1:])
