"""The front's one accept loop: every raw listener of the broker (the gRPC gate's Unix, TCP and vsock listeners,
the link's ``<socket>.fast``, vsock and TCP ports, the metrics endpoint) accepts through an
`Acceptor`.

An acceptor takes what its listening socket has queued in batches, then lets the loop serve what it accepted
before taking more; each connection goes to the listener's ``admit`` with its `Peer` (who is at the other end, in
the same terms whichever the scheme, named by `peer_of` for every listener alike: whom each per-peer cap counts
it against is `Peer.key`), which counts it, refuses it or serves it.
Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) it stops accepting for a moment, doubling while that
lasts, rather than spinning on a listener it cannot serve: connections wait in the backlog meanwhile (or the
kernel refuses them once it is full). A connection that is gone before it was taken (ECONNABORTED, EPROTO, EPERM)
is skipped; any other failure ends the listener, with a log line saying so.

In the broker every acceptor accepts off the front's event loop, in the front's acceptor process (``accepts``:
`_acceptor.AcceptorProcess`), which applies the per-peer connection rate and closes what it refuses, so that a
peer connecting and closing in a loop costs the loop nothing: the acceptor here is then told of each connection
admitted (`deliver`), of refusals (`refused`) and of failures (`failed`), and names the peer again itself. With
no acceptor process (``gpubroker relay``, tests), or once it is gone, it accepts on the loop as described above.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

from gpubroker.broker.front._owners import SocketOwners, plain_host
from gpubroker.broker.front.auth import RateLimitedLog, peer_credentials
from gpubroker.wire.addresses import TcpAddress, VsockAddress

__all__ = ["ACCEPT_BACKOFF", "ACCEPT_BACKOFF_MAX", "ACCEPT_BATCH", "DEFAULT_NETWORKS", "GONE", "PUMP_CHUNK", "Acceptor",
           "Admit", "OffLoop", "OwnerLookup", "Peer", "PeerNetworks", "PeerRate", "out_of_descriptors", "peer_of",
           "pump", "take_place_of", "uid_key"]

log = logging.getLogger("gpubroker.server")
audit = logging.getLogger("gpubroker.audit")

# Connections accepted per wakeup of a listener: then the loop serves what it accepted before accepting more.
ACCEPT_BATCH: Final = 64
# Out of descriptors: the acceptor stops accepting for this long, doubling while it lasts (up to the most).
ACCEPT_BACKOFF: Final = 0.05
ACCEPT_BACKOFF_MAX: Final = 1.0
_OUT_OF_DESCRIPTORS: Final = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
GONE: Final = (errno.ECONNABORTED, errno.EPROTO, errno.EPERM)
# Peers a `PeerRate` remembers at most: past it, those whose bucket is full again are forgotten (they lose nothing),
# then if need be the oldest half (they start again with a full bucket: the table stays bounded whoever floods it).
MAX_RATED_PEERS: Final = 4096


class PeerRate:
    """A rate limit per peer (`Peer.key`, or any key): a token bucket each, ``rate`` tokens a second up to ``burst``.

    Each bucket is kept as one number, the time at which it is full again (GCRA): a take is a dict lookup and some
    arithmetic (well under a microsecond), and a peer whose bucket is full again is the same as one never seen, so
    idle peers are forgotten without a sweep. ``refusals``: gpubroker_endpoint_refusals' counts, which refusals
    by this limit count into as (endpoint, ``reason``)."""

    def __init__(self, rate: float, burst: float, refusals: dict[tuple[str, str], int] | None = None,
                 reason: str = "connection rate") -> None:
        self.rate, self.burst = rate, burst
        self.refusals = refusals if refusals is not None else {}
        self.reason = reason
        self._interval = 1.0 / rate
        self._slack = (max(1.0, burst) - 1.0) * self._interval  # how far ahead of now a bucket may be full again
        self._full_at: dict[str, float] = {}

    def take(self, key: str, now: float | None = None, tokens: float = 1.0) -> bool:
        """Take ``tokens`` of ``key``'s tokens (one by default); False (nothing taken) if it has fewer left."""
        if now is None:
            now = time.monotonic()
        full_at = self._full_at.get(key, now)
        if full_at < now:
            full_at = now
        elif full_at - now > self._slack - (tokens - 1.0) * self._interval:
            return False
        self._full_at[key] = full_at + tokens * self._interval
        if len(self._full_at) > MAX_RATED_PEERS:
            self._forget(now)
        return True

    def left(self, key: str, now: float) -> float:
        """The tokens ``key`` has left now."""
        return self.burst - max(0.0, self._full_at.get(key, now) - now) / self._interval

    def count(self, endpoint: str, refusals: int = 1) -> None:
        """Count ``refusals`` at ``endpoint`` (its key set by `register` before anyone iterates the counts)."""
        if (endpoint, self.reason) in self.refusals:
            self.refusals[(endpoint, self.reason)] += refusals

    def register(self, endpoint: str) -> None:
        self.refusals.setdefault((endpoint, self.reason), 0)

    @property
    def peers(self) -> int:
        """Peers remembered (whose bucket is not known to be full again)."""
        return len(self._full_at)

    def _forget(self, now: float) -> None:
        # (list(): one step under the GIL, should another thread take meanwhile)
        busy = [(key, full_at) for key, full_at in list(self._full_at.items()) if full_at > now]
        if len(busy) > MAX_RATED_PEERS // 2:
            busy = busy[len(busy) - MAX_RATED_PEERS // 2:]
        self._full_at = dict(busy)


@dataclass(frozen=True)
class PeerNetworks:
    """How remote TCP peers are grouped into one peer (``peer_network_ipv4`` / ``peer_network_ipv6``): by the
    network of this prefix length their address is in. One host commonly holds a network's worth of addresses
    (an IPv6 host its /64), so the default counts a /24 or /64 as one peer; where many clients each have an address
    of their own in one such network (pods of one Kubernetes node), a longer prefix gives each its own caps."""

    ipv4: int = 24
    ipv6: int = 64

    def of(self, host: str) -> str:
        """The network ``host`` is counted by; a name that is no address, itself."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host
        return str(ipaddress.ip_network(f"{ip}/{self.ipv4 if ip.version == 4 else self.ipv6}", strict=False))


DEFAULT_NETWORKS: Final = PeerNetworks()


@dataclass(frozen=True)
class Peer:
    """Who is at the other end of an accepted connection, as far as the kernel tells: on a Unix socket the peer
    process's pid and uid (SO_PEERCRED, which a peer cannot forge; -1 if unknown) and no address; on TCP and vsock
    its address, and on TCP from this host (``local``: loopback, or the host's own address) the uid owning the
    client's socket (sock_diag: every local process has the address 127.0.0.1; -1 if its socket is gone, or
    sits in another network namespace). A remote peer's pid and uid are unknown (-1)."""

    pid: int
    uid: int
    address: TcpAddress | VsockAddress | None  # (an IPv4 peer of a dual-stack listener: its IPv4 address)
    accepted: Any  # the address as accept() gave it, as audit lines show it
    local: bool = False
    networks: PeerNetworks = DEFAULT_NETWORKS  # (how a remote TCP peer is grouped)

    @property
    def host(self) -> str:
        """A TCP peer's host, a vsock peer's CID ("" on a Unix socket)."""
        if isinstance(self.address, TcpAddress):
            return self.address.host
        return str(self.address.cid) if self.address is not None else ""

    @property
    def loopback(self) -> bool:
        """A TCP peer at a loopback address (127.0.0.0/8, ::1)."""
        return isinstance(self.address, TcpAddress) and _is_loopback(self.address.host)

    @property
    def key(self) -> str:
        """Whom a connection of this peer is counted against, by every listener's caps alike: ``uid N`` where the
        kernel names its uid (a Unix socket, TCP from this host), so that one local user is one peer whatever
        the listener or address (127.0.0.0/8 is all the host's own); a remote TCP peer's network (`PeerNetworks`:
        by default a /24 or /64, since one host commonly holds a network's worth of addresses); a VM by its CID."""
        if self.uid >= 0:
            return uid_key(self.uid)
        if isinstance(self.address, VsockAddress):
            return f"vsock {self.address.cid}"
        if isinstance(self.address, TcpAddress):
            return self.address.host if self.local else self.networks.of(self.address.host)
        return uid_key(-1)  # (a Unix peer whose credentials were not told)


H = TypeVar("H")


def take_place_of(held: Mapping[str, Mapping[H, None]], newcomer: str) -> tuple[str, H] | None:
    """At a cap on what all peers together hold (``held``: each peer's holds, oldest first), the hold a newcomer of
    peer ``newcomer`` takes the place of, with its peer: the oldest of the peer holding the most, if it holds at
    least two more than ``newcomer`` does (so each peer keeps its fair share of the total, whoever came first, and
    two peers never take turns ending each other's); None: the newcomer is refused. Four local users at their
    per-peer share held a whole total before (the health probe's streams, the metrics endpoint's connections)."""
    if not held:
        return None
    most = max(held, key=lambda key: len(held[key]))
    mine = held.get(newcomer)
    if len(held[most]) <= (len(mine) if mine is not None else 0) + 1:
        return None
    return most, next(iter(held[most]))


def uid_key(uid: int) -> str:
    """`Peer.key` of a peer the kernel names by its uid (-1: a Unix peer whose credentials were not told); the
    acceptor process's cheapest refusal of a Unix peer computes it without making a `Peer`."""
    return f"uid {uid}" if uid >= 0 else "unix"


class OwnerLookup(Protocol):
    """Who owns the socket at the other end of a local TCP connection (`_owners.SocketOwners`; or, in the front,
    what its acceptor process found when it accepted the connection)."""

    def of(self, conn: socket.socket, peer: tuple[str, int]) -> int | None: ...

    def close(self) -> None: ...


def peer_of(conn: socket.socket, accepted: Any, owners: OwnerLookup | None = None,
            networks: PeerNetworks = DEFAULT_NETWORKS) -> Peer:
    """The `Peer` of ``conn``, which accept() returned with the address ``accepted``: the one naming of peers for
    every listener. ``owners``: the caller's lookup of local TCP peers' owners (one is made for this call
    without it); ``networks``: how remote TCP peers are grouped."""
    if conn.family == socket.AF_UNIX:
        pid, uid = peer_credentials(conn)
        return Peer(pid, uid, None, accepted)
    if conn.family == getattr(socket, "AF_VSOCK", None):
        return Peer(-1, -1, VsockAddress(int(accepted[0]), int(accepted[1])), accepted)
    host, port = plain_host(str(accepted[0])), int(accepted[1])
    address = TcpAddress(host, port)
    if not _is_loopback(host) and host != plain_host(str(conn.getsockname()[0])):
        return Peer(-1, -1, address, accepted, networks=networks)
    lookup: OwnerLookup = owners if owners is not None else SocketOwners()
    owner: int | None
    try:
        owner = lookup.of(conn, (host, port))
    except OSError as exc:  # (neither sock_diag nor /proc/net/tcp answers: counted by its address)
        _audit.warning("peer owner", "cannot tell who owns the local TCP peer %s: %s", address, exc.strerror or exc)
        owner = None
    finally:
        if owners is None:
            lookup.close()
    return Peer(-1, -1 if owner is None else owner, address, accepted, local=True, networks=networks)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# (the accepted socket, its peer) -> whether to go on accepting now (False: the admitter ran out of descriptors
# itself and called `Acceptor.back_off`).
Admit = Callable[[socket.socket, Peer], bool]

_audit = RateLimitedLog(audit)


def out_of_descriptors(exc: OSError) -> bool:
    """Whether ``exc`` says the process (or host) is out of descriptors or memory: a moment later may do."""
    return exc.errno in _OUT_OF_DESCRIPTORS


class OffLoop(Protocol):
    """Where acceptors accept off the front's event loop (`_acceptor.AcceptorProcess`): it accepts on each
    registered acceptor's listening socket and tells the acceptor what came (`Acceptor.deliver`, `refused`,
    `failed`); on its end, `Acceptor.accept_here` on each."""

    networks: PeerNetworks  # (how the front groups remote TCP peers: every acceptor's peers are named alike)

    def register(self, acceptor: Acceptor) -> None: ...

    def unregister(self, acceptor: Acceptor) -> None: ...

    def pause(self, acceptor: Acceptor, seconds: float) -> None: ...


class Acceptor:
    """Accepts on one listening socket (non-blocking from here on), on the loop `start` is given.

    ``name``: the listener as audit lines name it; ``kind``: which listener family it is (``grpc``, ``link``,
    ``metrics``, ``relay``), the rate-limited audit line's kind and gpubroker_endpoint_refusals' endpoint.
    ``rate``: how fast each peer may connect (one `PeerRate` for every listener of the front, so that a peer is
    one peer whichever it connects to): a connection past it is closed as soon as it is accepted and its peer
    named, before the listener sees it. On the loop, a peer connecting and closing in a loop costs it one accept,
    one SO_PEERCRED lookup and one close per connection (10-16 us); with ``accepts``, the front's acceptor
    process, which applies the same rate (one bucket per peer for every listener), it costs the loop nothing: the
    acceptor here counts what the process refused and serves what it admitted."""

    def __init__(self, sock: socket.socket, name: str, admit: Admit, kind: str, rate: PeerRate | None = None,
                 accepts: OffLoop | None = None) -> None:
        self.sock, self.name, self.kind = sock, name, kind
        self._admit = admit
        self._rate = rate
        if rate is not None:
            rate.register(kind)
        self.failures = 0  # accept() out of descriptors (or memory): each time, the acceptor backs off
        self.backoff = 0.0
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepts = accepts
        self._networks = accepts.networks if accepts is not None else DEFAULT_NETWORKS
        self._paused_until = 0.0  # (off the loop: the acceptor process is told to pause until then)
        # Who owns local TCP peers' sockets: the acceptor's own lookup (its netlink socket is used on its loop only).
        self._owners = SocketOwners() if sock.family in (socket.AF_INET, socket.AF_INET6) else None
        sock.setblocking(False)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the acceptor serves its connections on, once started."""
        return self._loop

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Accept on ``loop`` (the running one by default), from its thread; or, with ``accepts``, have the
        acceptor process accept, and serve what it admits on ``loop``."""
        self._loop = loop or asyncio.get_running_loop()
        if self._accepts is not None:
            self._accepts.register(self)
        else:
            self._loop.add_reader(self.sock.fileno(), self._accept)

    def accept_here(self) -> None:
        """The acceptor process is gone: accept on the loop from now on (on the loop's thread)."""
        self._accepts = None
        if not self.closed and self._loop is not None and self.sock.fileno() >= 0:
            self._loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting and close the listening socket (on the loop's thread, once started)."""
        if self.closed:
            return
        self.closed = True
        if self._accepts is not None:
            # The acceptor process holds the same listening socket: shut it first, so that from now on the kernel
            # refuses connections to it whoever holds it (a vsock one cannot be shut: closed when the process is
            # told to), then tell the process to close its copy (what it accepted meanwhile is closed too).
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            if self._loop is not None:
                self._accepts.unregister(self)
        elif self._loop is not None and self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        if self._owners is not None:
            self._owners.close()

    def back_off(self, exc: OSError) -> None:
        """Out of descriptors (or memory): accept nothing for a moment; connections wait in the backlog."""
        assert self._loop is not None
        if self._accepts is not None:
            now = time.monotonic()
            if now < self._paused_until:
                return  # (connections the process handed over before the pause: they find the front as full)
            self.backoff = min(ACCEPT_BACKOFF_MAX, max(ACCEPT_BACKOFF, self.backoff * 2))
            self._paused_until = now + self.backoff
            self._pausing(exc.strerror)
            self._accepts.pause(self, self.backoff)
            return
        self.backoff = min(ACCEPT_BACKOFF_MAX, max(ACCEPT_BACKOFF, self.backoff * 2))
        self._pausing(exc.strerror)
        self._loop.remove_reader(self.sock.fileno())
        self._loop.call_later(self.backoff, self._resume)

    def _pausing(self, why: str | None) -> None:
        _audit.warning(f"{self.kind} accept", "action=pause-accept listener=%s reason=accept failed (%s): accepting "
                       "again in %.2f s (connections wait in the backlog)", self.name, why, self.backoff)

    def _resume(self) -> None:
        if not self.closed and self.sock.fileno() >= 0:
            assert self._loop is not None
            self._loop.add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if out_of_descriptors(exc):
                    self.failures += 1
                    self.back_off(exc)
                    return
                if exc.errno in GONE:
                    continue  # (that connection is gone; the next one may be fine)
                log.error("%s listener %s: accept failed, no longer accepting: %s", self.kind, self.name, exc)
                assert self._loop is not None
                self._loop.remove_reader(self.sock.fileno())
                return
            self.backoff = 0.0
            try:
                peer = peer_of(conn, address, self._owners, self._networks)
                if self._rate is not None and not self._rate.take(peer.key):
                    conn.close()
                    self.refused(peer.key)
                    continue
                conn.setblocking(False)  # (as asyncio's sock_accept leaves it: every admitter serves it on a loop)
                if not self._admit(conn, peer):
                    return
            except Exception as exc:  # one connection's failure must not stop the listener
                conn.close()
                log.error("%s listener %s: admitting a connection failed: %r", self.kind, self.name, exc)

    # -- told by the acceptor process (on this acceptor's loop) -------------------------------------------------

    def deliver(self, conn: socket.socket, owners: OwnerLookup) -> None:
        """Serve ``conn``, which the acceptor process accepted on this listener and admitted at its peer's rate.
        The peer is named here again, as `peer_of` names every peer, from what the kernel tells this process
        (SO_PEERCRED, the addresses); ``owners``: the owner of a local TCP peer's socket, as the process found it
        when it accepted the connection (the socket may be gone by now)."""
        if self.closed:
            conn.close()
            return
        try:
            peer = peer_of(conn, conn.getpeername(), owners, self._networks)
        except OSError:  # (gone already: reset before the front took it)
            conn.close()
            return
        if self._paused_until and time.monotonic() >= self._paused_until:
            self._paused_until, self.backoff = 0.0, 0.0
        try:
            conn.setblocking(False)
            self._admit(conn, peer)  # (False: it backed off, and told the process so)
        except Exception as exc:  # one connection's failure must not stop the listener
            conn.close()
            log.error("%s listener %s: admitting a connection failed: %r", self.kind, self.name, exc)

    def refused(self, key: str, connections: int = 1) -> None:
        """``connections`` of the peer ``key`` were closed at accept, past its connection rate: count them."""
        if self._rate is None:
            return
        self._rate.count(self.kind, connections)
        _audit.warning(f"{self.kind} connection rate", "action=refuse-connection listener=%s peer=%s reason=over "
                       "max_connections_per_peer_per_second (%g a second, %g at once)%s", self.name, key,
                       self._rate.rate, self._rate.burst, f" connections={connections}" if connections > 1 else "")

    def failed(self, code: int, reason: str, paused: float) -> None:
        """accept() failed in the acceptor process: it paused for ``paused`` seconds (out of descriptors or
        memory), or, with 0, stopped accepting on this listener."""
        if paused > 0:
            self.failures += 1
            self.backoff = paused
            self._pausing(reason)
            return
        log.error("%s listener %s: accept failed, no longer accepting: [Errno %d] %s", self.kind, self.name, code,
                  reason)


# What a pumped relay (``pump``) holds in user space per direction: one read's worth.
PUMP_CHUNK = 64 * 1024


async def pump(src: socket.socket, dst: socket.socket, activity: list[float] | None = None,
               inspect: Callable[[bytes], bool] | None = None) -> None:
    """One direction of a relay with the loop's ``sock_*`` calls, for sockets uvloop makes no transport of (vsock):
    ``src``'s bytes to ``dst`` until ``src`` ends; each read waits for the kernel to take the last, so a side that
    does not read pushes back on the other. ``activity[0]`` is set to when bytes last moved. ``inspect`` sees each
    read first: False ends the pump, that read unsent."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError):  # (a reset is one more way for a side to close)
        while data := await loop.sock_recv(src, PUMP_CHUNK):
            if activity is not None:
                activity[0] = time.monotonic()
            if inspect is not None and not inspect(data):
                return
            await loop.sock_sendall(dst, data)
