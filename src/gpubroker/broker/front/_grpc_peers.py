"""The gRPC gate: the front accepts the connections of its gRPC listeners itself, caps them per peer as it accepts
them, and relays each one's bytes to gRPC.

gRPC core accepts the connections of the addresses it listens on, and has no limit per peer: one peer could hold
every slot of its total cap. So gRPC listens only on Unix sockets in a directory of the broker's own (mode 0700:
nobody else can connect to them), and the public addresses (``unix:PATH``, ``HOST:PORT``) are the gate's. For each
connection it accepts, the gate names the peer as every listener of the front does (``listeners.peer_of``):

- on a Unix socket, the uid the kernel recorded at connect (SO_PEERCRED);
- on TCP from this host (loopback, or the host's own address), the uid that owns the client's socket, which the
  kernel finds by the connection's addresses (sock_diag, ``_owners.py``): every local process has the address
  127.0.0.1, so counting local peers by address would make all local users one peer;
- on other TCP, its network: the /24 of an IPv4 address, the /64 of an IPv6 one;
- on vsock (``vsock_port``: VM guests, whose ``gpubroker relay`` connects out over AF_VSOCK), the guest's CID,
  which the host's kernel sets (a guest cannot claim another's).

and refuses it, by closing it at once before reading a byte, when its peer holds ``max_grpc_connections_per_peer``
or ``max_grpc_connections`` are open: both caps hold exactly, at every instant, however fast a peer reconnects.
A refusal costs one accept, one lookup and one close (its audit line is rate-limited). Out of descriptors, the
gate stops accepting for a moment rather than spinning.

Connections that have not authenticated cannot keep the others out. Until one of its calls authenticates (the
call's handler tells the gate: ``grpc_authenticated``), a connection is *unauthenticated*, whatever calls that
failed (a wrong token: each one resets gRPC's idle close) or needed no token (health) it made, and

- it is closed ``grpc_unauthenticated_seconds`` after it was accepted, if it has not authenticated by then;
- at ``max_grpc_connections``, a newcomer takes the place of the oldest unauthenticated connection of the peer
  holding the most of them, if that peer holds more than the newcomer's does (else the newcomer is refused).
  Eight peers (eight uids of a container's user namespace, eight /64s) each holding its per-peer share of the pool
  with failing calls no longer lock a tenant out: its connection evicts one of theirs, is the newest of its peer's
  one or two, and is never evicted once its first call has authenticated, within milliseconds. (A flood that
  needs an identity per connection and evicts faster than a client authenticates is a volumetric attack: each
  connection also costs its peer a token of ``max_connections_per_peer_per_second``.)

Both are counted in gpubroker_endpoint_refusals (grpc: "unauthenticated timeout", "evicted unauthenticated"), and
their audit lines are rate-limited. An evicted connection leaves the counts at once (its transports close on the
loop's next turn), so the caps count connections exactly; their descriptors, within one accept batch.

An admitted connection is relayed to gRPC's private listener byte for byte: TLS passes through untouched (gRPC
terminates it, so client certificates reach the call's auth context as before), and so do gRPC's own handshake
timeout, idle timeout and keepalives, whose closes end the relayed connection. gRPC's local credentials check the
kind of connection gRPC sees, a Unix socket here: the private listener of a loopback TCP address takes UDS local
credentials, and the gate checks instead that its peers are loopback, as gRPC's LOCAL_TCP check did. gRPC names a
relayed connection's peer by the address of the gate's end, an abstract Unix address the kernel picks
(``unix-abstract:1f3a0``); ``grpc_peer`` maps it back to the peer the gate accepted.

The gate also bounds how fast a peer may connect (``max_connections_per_peer_per_second``, the `Acceptor`'s, one
`PeerRate` for every listener of the front) and start calls (``max_grpc_calls_per_peer_per_second``, checked by
the call's handler before any other work: ``over_call_rate``). A call past its peer's call rate is refused, and
the connection it came on is cut: the gate stops relaying what the client sends at once (a flood of HTTP/2
HEADERS and RST_STREAM frames already on its way stops reaching gRPC, whose every call runs the front's handler
on the loop every tenant's calls share), lets the refusal reach the client, then closes the connection. A
flooder must reconnect, at the connection rate.

gRPC parses every HTTP/2 frame in the front's process, and frames that start no call (SETTINGS, WINDOW_UPDATE for a
stream that never existed, PRIORITY, CONTINUATION...) need no stream and no token. So the gate reads the frame
headers of what a cleartext client sends it (``ControlFrames``: headers only, across reads; payloads skipped) and
takes each such frame from its peer's ``max_grpc_control_frames_per_peer_per_second``: a read past it is not
relayed and the connection is cut, counted in gpubroker_endpoint_refusals (grpc: "control frames") and audited
rate-limited. A client sends about four per unary call, about two per Commands batch, one per MiB copied. TLS
passes through the gate unread (gRPC terminates it): a TLS listener's control frames are bounded by gRPC alone.

The relay forwards at the protocol level (each side's data is written to the other's transport; a side whose
writes back up pauses the other's reads), on the front's event loop. It costs a gRPC unary round trip one more
wakeup each way (40-60 us on the 2-core VM it was measured on, about 5-8% of a call; gRPC copies within noise).
On a thread of its own with its own uvloop (``own_thread``) it was no faster there: each relayed write then also
hands the GIL between threads (unary round trips up to 15% slower than on the front's loop, copies within noise).
A vsock connection is relayed with the loop's ``sock_*`` calls instead (`_PumpedRelay`, with ``listeners.pump``,
as ``relay.py`` does): uvloop makes a TCP transport of any socket that is not a Unix one, which fails on vsock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

from gpubroker.broker.front.auth import RateLimitedLog
from gpubroker.broker.front.listen import BACKLOG, listen_unix, tcp_listeners
from gpubroker.broker.front.listeners import Acceptor, OffLoop, Peer, PeerRate, out_of_descriptors, pump
from gpubroker.wire.addresses import TcpAddress, UnixAddress, VsockAddress, parse_host_port
from gpubroker.wire.errors import InvalidArgument

__all__ = ["GrpcGate", "grpc_authenticated", "grpc_peer", "grpc_peer_key", "over_call_rate"]

log = logging.getLogger("gpubroker.server")
audit = logging.getLogger("gpubroker.audit")
# A relayed connection ends when either side ends it; the other then has this long to take what was sent to it
# last (a GOAWAY, say) before it is cut.
CLOSE_GRACE = 5.0
# What one side of a relayed connection may hold unsent before it stops reading the other side.
WRITE_BUFFER_HIGH = 256 * 1024
# A connection cut for its peer's call rate stops being read at once, and is closed this much later: time for the
# refusal (RESOURCE_EXHAUSTED, saying which limit) to reach the client.
CUT_GRACE = 0.2
# The client connection preface of HTTP/2 in cleartext (RFC 9113 3.4): a connection that starts otherwise is TLS
# (gRPC terminates it: the gate cannot read its frames) or garbage (gRPC closes it).
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# A control frame costs one token, and one more for each this many bytes of its payload: a 16 KiB SETTINGS frame
# holds 2,730 settings, each parsed (legit control frames are 4 to 40 bytes).
CONTROL_FRAME_BYTES = 256
# A DATA frame carrying fewer bytes than this costs a token too: gRPC parses every frame it is given, whether or not
# its stream exists (DATA for a stream never opened is skipped, not an error), so 1-byte DATA frames (10 bytes on
# the wire) were a flood no bucket counted: 270 MB in 4 s from one uid cost the front 5.1 CPU-s and alice's p50
# 0.9 -> 110 ms. A client's messages go in frames of 16 KiB (gRPC's frame size), each ending in one smaller frame:
# about one token per message it sends.
SMALL_DATA_BYTES = 1024
_FRAME_HEAD = struct.Struct(">BHBB")  # an HTTP/2 frame header's length (8 + 16 bits), type and flags; then its stream

# gRPC's peer string of a relayed connection ("unix-abstract:NAME") -> the relayed connection. Written by the
# gate's loop, read by the front's handlers (with own_thread, on two threads: each a single dict operation).
_relayed: dict[str, _Relay | _PumpedRelay] = {}


def grpc_peer(context: Any) -> str:
    """The peer of a gRPC call as the gate accepted it (``ipv4:HOST:PORT``, with ``uid=N`` for a local peer;
    ``unix:PATH uid=N``), rather than the gate's end of the relay that gRPC sees."""
    seen: str = context.peer()
    relay = _relayed.get(seen)
    return relay.peer.name if relay is not None else seen


def grpc_peer_key(context: Any) -> str:
    """Whom a gRPC call is counted against, as the gate counted its connection (``Peer.key``: "uid N" for a local
    peer, whatever its socket; a remote peer's /24 or /64); a call that did not come through the gate, by gRPC's
    name for its peer."""
    seen: str = context.peer()
    relay = _relayed.get(seen)
    return relay.peer.key if relay is not None else seen


# Registers a call's credential's revocation watch: given what to do at the revocation, returns what unregisters it.
Watch = Callable[[Callable[[], None]], Callable[[], None]]


def grpc_authenticated(context: Any, tenant: str, watch: Watch | None = None) -> str | None:
    """A call on this connection authenticated as ``tenant`` (the call's handler, once the credential checked out):
    the gate no longer closes the connection for never authenticating, nor evicts it for a newcomer, and counts it
    against ``tenant``'s ``max_grpc_connections_per_tenant``; past that, why the call is refused (the connection
    stays unauthenticated). ``watch`` registers the credential's revocation, at which the connection is
    unauthenticated again (its place in the tenant's share given back, its deadline running again). One dict lookup
    and a flag for every call after a connection's first."""
    relay = _relayed.get(context.peer())
    if relay is not None and not relay.authenticated:
        if not relay.gate.claim(relay, tenant, watch):
            return (f"tenant {tenant!r} holds {relay.gate.max_per_tenant} authenticated gRPC connections, "
                    "max_grpc_connections_per_tenant: make this call on one of them (a client needs one)")
        relay.authenticated = True
        relay.gate.authenticated(relay)
    return None


def over_call_rate(context: Any) -> str | None:
    """Take one of the call's peer's tokens of ``max_grpc_calls_per_peer_per_second``; with none left, why the
    call is refused (its connection is being cut). A dict lookup and some arithmetic: the first thing a call
    does. (Every public listener's calls come through the gate, vsock guests' included.)"""
    relay = _relayed.get(context.peer())
    if relay is None:
        return None
    rate = relay.gate.call_rate
    if rate is None or rate.take(relay.peer.key):
        return None
    relay.gate.too_many_calls(relay)
    return (f"{relay.peer.key} started gRPC calls faster than max_grpc_calls_per_peer_per_second ({rate.rate:g} a "
            f"second, {rate.burst:g} at once), on all its connections together: this call is refused and its "
            f"connection closed; slow down")


class ControlFrames:
    """Counts the HTTP/2 frames a client sends that start no call, from the frame headers of what it sends, across
    reads (a header split between two reads is joined; payloads are skipped, never copied).

    gRPC parses every frame in the front's process. HEADERS start calls, which
    ``max_grpc_calls_per_peer_per_second`` bounds only once they reach a handler (a rapid reset's never do), so each
    costs a token here too, and an RST_STREAM cancelling one costs none; DATA frames carry their messages, which
    flow control bounds by bytes, not by frames: one under ``SMALL_DATA_BYTES`` costs a token (the last frame of a
    message, or a small message; or a flood of 1-byte frames for a stream that need not exist), an empty one that
    ends its stream none. Every other frame (SETTINGS, WINDOW_UPDATE, PRIORITY, PING, RST_STREAM beyond one per
    HEADERS, GOAWAY, CONTINUATION, PUSH_PROMISE, an unknown type) is a *control frame*: it needs no stream and no
    token, and nothing else bounds it. ``feed``
    says what a read's control frames cost (one token each, one more per ``CONTROL_FRAME_BYTES`` of payload), which
    the gate takes from its peer's ``max_grpc_control_frames_per_peer_per_second``. A connection that does not start
    with the cleartext preface (TLS: the gate cannot read it) is passed through unread."""

    __slots__ = ("_calls", "_head", "_seen", "_skip", "reading")

    def __init__(self) -> None:
        self.reading: bool | None = None  # None: until the preface is seen (or is not); False: never read
        self._seen = b""  # the connection's first bytes, until they are the preface (or are not)
        self._skip = len(H2_PREFACE)  # bytes still to pass before the next frame header
        self._head = b""  # the part of a frame header the last read ended in
        self._calls = 0  # HEADERS frames sent and not cancelled by an RST_STREAM (an upper bound of calls open)

    def feed(self, data: bytes, most: float) -> float:
        """What the control frames whose headers end in ``data`` cost; it stops counting past ``most`` (a flood
        of tiny frames costs its reader no more than the budget it went over)."""
        if not self.reading:
            if self.reading is False:
                return 0.0
            seen = self._seen + data[:len(H2_PREFACE) - len(self._seen)]
            if not H2_PREFACE.startswith(seen):
                self.reading = False
                return 0.0
            self._seen = seen
            if len(seen) == len(H2_PREFACE):
                self.reading = True
        size = len(data)
        pos = self._skip
        cost: float = 0.0
        if self._head:  # (the rest of the header the last read ended in: nothing to skip before it)
            taken = 9 - len(self._head)
            head = self._head + data[:taken]
            if len(head) < 9:
                self._head = head
                return 0.0
            self._head = b""
            high, low, kind, flags = _FRAME_HEAD.unpack_from(head)
            length = high << 16 | low
            if kind or length < SMALL_DATA_BYTES:
                cost += self._cost(kind, flags, length)
            pos = taken + length
        while pos + 9 <= size:
            high, low, kind, flags = _FRAME_HEAD.unpack_from(data, pos)
            length = high << 16 | low
            if kind or length < SMALL_DATA_BYTES:  # (not a full DATA frame: the most frames of a copy, passed at once)
                cost += self._cost(kind, flags, length)
                if cost > most:
                    return cost  # (its connection is cut: where this read ends no longer matters)
            pos += 9 + length
        if pos >= size:
            self._skip = pos - size
        else:
            self._skip = 0
            self._head = data[pos:]
        return cost

    def _cost(self, kind: int, flags: int, length: int) -> int:
        if kind == 1:  # HEADERS: a call, which an RST_STREAM may cancel. It costs a token too: gRPC parses a
            # rapid reset's HEADERS and RST_STREAM here though few of its calls ever reach a handler and the call rate
            # (a legit unary call costs about 4 tokens, 2,000 a second at the call rate's most: far under this rate).
            # Its header block costs what a CONTINUATION's would: gRPC decodes all of it (HPACK) before any handler,
            # and no flow control bounds it (16 KiB HEADERS, one a token, cost the front 4.6 CPU-s in 4 s).
            self._calls += 1
            return 1 + length // CONTROL_FRAME_BYTES
        if kind == 0:  # a DATA frame under SMALL_DATA_BYTES: the end of a call's messages, a small message, or nothing
            return 0 if flags & 1 and not length else 1
        if kind == 3 and self._calls:  # RST_STREAM cancelling a call it started
            self._calls -= 1
            return 0
        return 1 + length // CONTROL_FRAME_BYTES


# -- listeners and peers -------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Listener:
    public: str  # as the broker lists it: unix:PATH or HOST:PORT (vsock:PORT, VM guests)
    private: str  # the path of gRPC's listener its connections are relayed to
    loopback_only: bool  # local credentials: only loopback peers (what gRPC's LOCAL_TCP check allowed)
    acceptor: Acceptor = dataclasses.field(init=False)


@dataclasses.dataclass(frozen=True)
class _Peer:
    key: str  # whom the connection is counted against (Peer.key): "uid N", a remote network
    name: str  # as gRPC would name it, for audit lines: ipv4:HOST:PORT [uid=N], unix:PATH uid=N, vsock:CID:PORT


def _tcp_name(host: str, port: int) -> str:
    return f"ipv4:{host}:{port}" if "." in host else f"ipv6:[{host}]:{port}"


class GrpcGate:
    """Accepts on the public gRPC addresses, caps connections in all and per peer, relays them to gRPC."""

    def __init__(self, max_connections: int, max_per_peer: int, refusals: dict[tuple[str, str], int] | None = None,
                 own_thread: bool = False, connection_rate: PeerRate | None = None,
                 call_rate: PeerRate | None = None, accepts: OffLoop | None = None,
                 unauthenticated_seconds: float | None = None, control_rate: PeerRate | None = None,
                 max_per_tenant: int | None = None) -> None:
        self.max_connections = max_connections
        self.accepts = accepts  # where the acceptors accept (the front's acceptor process), if not on the loop
        self.max_per_peer = max_per_peer
        # How long a connection may go without an authenticated call (None: for ever, as a bare relay's tests do).
        self.unauthenticated_seconds = unauthenticated_seconds
        self.connection_rate = connection_rate  # how fast each peer may connect (the acceptors')
        self.call_rate = call_rate  # how fast each peer may start calls (``over_call_rate``)
        if call_rate is not None:
            call_rate.register("grpc")
        # How fast each peer may send control frames (ControlFrames), on all its connections together.
        self.control_rate = control_rate
        self.open = 0
        self.per_peer: dict[str, int] = {}
        # Authenticated connections per tenant (of their first authenticated call), at most max_per_tenant: they are
        # never evicted, so without it one tenant from many peers could hold the whole pool. Claimed on the front's
        # loop, given back on the gate's (with own_thread, two threads: the lock).
        self.max_per_tenant = max_per_tenant
        self.per_tenant: dict[str, int] = {}
        self._tenant_lock = threading.Lock()
        self._front_loop: asyncio.AbstractEventLoop | None = None  # (where grpc_authenticated runs)
        # Peer key -> its connections that have not authenticated, oldest first; and, for each count n, the peers
        # holding n of them, in the order they came to hold n: the peer holding the most is found in at most
        # max_per_peer steps, however many peers there are.
        self.unauthenticated: dict[str, dict[_Relay | _PumpedRelay, None]] = {}
        self._holding: list[dict[str, None]] = [{} for _ in range(max_per_peer + 1)]
        # (endpoint, reason) -> count, for gpubroker_endpoint_refusals: its keys are set here, before the gate's
        # thread counts into them, so that a scrape iterating it never sees it grow.
        self.refusals = refusals if refusals is not None else {}
        for reason in ("connections", "peer connections", "unauthenticated timeout", "evicted unauthenticated",
                       "control frames", "tenant connections"):
            self.refusals.setdefault(("grpc", reason), 0)
        self._audit = RateLimitedLog(audit)
        self._listeners: list[_Listener] = []
        self._relays: set[_Relay | _PumpedRelay] = set()
        self.private_dir = Path(tempfile.mkdtemp(prefix="gpubroker-grpc-"))  # mode 0700, the broker's own
        self._private: dict[str, str] = {}  # public address -> private path
        self._own_thread = own_thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._emptied: asyncio.Future[None] | None = None  # (set once the last relay is gone, while stopping)

    # -- set up (on the front's thread, before start) ------------------------------------------------------------

    def _private_path(self, public: str) -> str:
        path = self._private.get(public)
        if path is None:
            path = self._private[public] = str(self.private_dir / f"grpc{len(self._private)}.sock")
        return path

    def private_address(self, public: str) -> str:
        """``unix:PATH`` of gRPC's listener behind the public address ``public`` (as ``listen_*`` returned it)."""
        return str(UnixAddress(self.private_path(public)))

    def private_path(self, public: str) -> str:
        """The path of gRPC's Unix listener behind the public address ``public``."""
        return self._private[public]

    def listen_unix(self, path: Path, mode: int, group: str = "", backlog: int = BACKLOG) -> str:
        """Listen on the Unix socket ``path`` (a stale one replaced; its ``group`` and ``mode`` set before anyone
        can connect); returns its public address, whose private one ``private_address`` gives."""
        public = f"unix:{path}"
        # gRPC takes no descriptors: none may reach the relay's recv (_descriptors.py)
        sock = listen_unix(path, mode, group, backlog, passrights=False)
        sock.setblocking(False)
        self._add_listener(sock, public, self._private_path(public), loopback_only=False)
        return public

    def listen_tcp(self, address: str, loopback_only: bool, backlog: int = BACKLOG) -> str:
        """Listen on ``HOST:PORT`` (every address HOST resolves to, on one port; port 0: one the kernel picks);
        returns the address with its port, whose private one ``private_address`` gives."""
        try:
            wanted = parse_host_port(address)
        except ValueError as exc:
            raise InvalidArgument(f"listen: {exc}") from None
        host, port = wanted.host, wanted.port
        try:
            socks = tcp_listeners(host, port, backlog)
        except socket.gaierror as exc:
            raise InvalidArgument(f"listen: cannot resolve {host!r}: {exc.strerror}") from None
        port = socks[0].getsockname()[1]
        public = str(TcpAddress(host, port))
        private = self._private_path(public)
        for sock in socks:
            self._add_listener(sock, public, private, loopback_only)
        return public

    def listen_vsock(self, sock: socket.socket, port: int, behind: str) -> str:
        """Accept VM guests on ``sock``, listening on the AF_VSOCK port ``port`` (grpcio cannot listen on vsock),
        relayed to gRPC's listener behind the public Unix address ``behind``, whose local credentials then carry
        the bearer token as for a local client; each guest is a peer of its own (its CID). Returns its public
        address, ``vsock:PORT``."""
        public = f"vsock:{port}"
        self._add_listener(sock, public, self.private_path(behind), loopback_only=False)
        return public

    def _add_listener(self, sock: socket.socket, public: str, private: str, loopback_only: bool) -> None:
        listener = _Listener(public, private, loopback_only)
        listener.acceptor = Acceptor(sock, public, functools.partial(self._admit, listener), "grpc",
                                     self.connection_rate, self.accepts)
        self._listeners.append(listener)

    @property
    def accept_failures(self) -> int:
        """How often accept() ran out of descriptors (or memory): each time, the gate backed off."""
        return sum(listener.acceptor.failures for listener in self._listeners)

    # -- run -------------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start accepting (gRPC's private listeners must be serving by now)."""
        with contextlib.suppress(RuntimeError):
            self._front_loop = asyncio.get_running_loop()
        if not self._own_thread:
            self._loop = asyncio.get_running_loop()
            self._begin()
            return
        ready = threading.Event()

        def run() -> None:
            try:
                import uvloop

                loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            except ImportError:
                loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            loop.call_soon(ready.set)
            loop.call_soon(self._begin)
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="gpubroker grpc gate", daemon=True)
        self._thread.start()
        ready.wait()

    def _begin(self) -> None:
        assert self._loop is not None
        for listener in self._listeners:
            listener.acceptor.start(self._loop)

    async def close_listeners(self) -> None:
        """Stop accepting; the connections relayed so far go on (gRPC's graceful stop ends them)."""
        if self._loop is None:
            for listener in self._listeners:
                listener.acceptor.close()
            return
        await self._on_gate(self._close_listeners())

    async def _close_listeners(self) -> None:
        assert self._loop is not None
        for listener in self._listeners:
            listener.acceptor.close()

    async def stop(self) -> None:
        """Stop accepting, cut every relayed connection, end the gate's thread and remove its directory."""
        if self._closed:
            return
        await self.close_listeners()
        self._closed = True
        if self._loop is not None:
            await self._on_gate(self._cut_all())
            if self._thread is not None:
                with contextlib.suppress(RuntimeError):  # (its loop already stopped)
                    self._loop.call_soon_threadsafe(self._loop.stop)
                await asyncio.to_thread(self._thread.join, 10.0)
        shutil.rmtree(self.private_dir, ignore_errors=True)

    async def _cut_all(self) -> None:
        for relay in list(self._relays):
            relay.abort()
        if self._relays:  # (their transports close on the loop's next turns)
            self._emptied = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._emptied, CLOSE_GRACE)

    async def _on_gate(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` on the gate's loop, and wait for it."""
        assert self._loop is not None
        if not self._own_thread:
            await work
            return
        try:
            future = asyncio.run_coroutine_threadsafe(work, self._loop)
        except RuntimeError:  # (its loop already stopped)
            work.close()
            return
        await asyncio.wrap_future(future)

    # -- accept (on the gate's loop) ---------------------------------------------------------------------------------

    def _admit(self, listener: _Listener, conn: socket.socket, accepted: Peer) -> bool:
        """Relay ``conn``, or refuse it; whether to go on accepting now."""
        peer = self._identify(listener, conn, accepted)
        if isinstance(peer, str):
            self._refuse(conn, listener, "not local", None, peer)
            return True
        held = self.per_peer.get(peer.key, 0)
        if held >= self.max_per_peer:
            self._refuse(conn, listener, "peer connections", peer, f"{peer.key} holds {held} gRPC connections, "
                         f"max_grpc_connections_per_peer")
            return True
        if self.open >= self.max_connections:
            victim = self._evictable(peer.key)
            if victim is None:
                self._refuse(conn, listener, "connections", peer, f"{self.open} gRPC connections open, the broker's "
                             f"max_grpc_connections ({self.max_connections}), none of them evictable for this peer")
                return True
            self._drop(victim, "evicted unauthenticated", f"max_grpc_connections ({self.max_connections}) open: its "
                       f"place taken by {peer.name} ({victim.peer.key} holds the most connections that never "
                       f"authenticated)")
        try:
            # The socket to gRPC, now: a connection accepted is one that has both its descriptors.
            backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:
            conn.close()
            if out_of_descriptors(exc):
                listener.acceptor.back_off(exc)
                return False
            raise
        self.open += 1
        self.per_peer[peer.key] = held + 1
        relay: _Relay | _PumpedRelay
        relay = _PumpedRelay(self, peer) if isinstance(accepted.address, VsockAddress) else _Relay(self, peer)
        self._relays.add(relay)
        self._track(relay)
        assert self._loop is not None
        if self.unauthenticated_seconds is not None:
            relay.deadline = self._loop.call_later(self.unauthenticated_seconds, self._expire, relay)
        relay.task = self._loop.create_task(relay.open(conn, backend, listener.private))
        return True

    def _identify(self, listener: _Listener, conn: socket.socket, accepted: Peer) -> _Peer | str:
        """Who is at the other end of ``conn`` (``accepted``: as the front names peers, ``listeners.peer_of``),
        counted as every listener counts peers; a string saying why it may not connect, if it may not."""
        if isinstance(accepted.address, VsockAddress):  # (a VM guest: its CID, which the host's kernel sets)
            return _Peer(accepted.key, f"vsock:{accepted.address.cid}:{accepted.address.port}")
        if not isinstance(accepted.address, TcpAddress):  # (a Unix socket)
            return _Peer(accepted.key, f"{listener.public} uid={accepted.uid}")
        name = _tcp_name(accepted.address.host, accepted.address.port)
        if listener.loopback_only and not accepted.loopback:
            return f"{name} is not a loopback peer (the listener has local credentials)"
        if accepted.uid >= 0:
            return _Peer(accepted.key, f"{name} uid={accepted.uid}")
        if accepted.loopback:
            # (the owner of a loopback peer's socket is always found while that socket exists)
            return f"{name}: cannot tell who owns it (its socket is gone)"
        # (a remote peer; or, through the host's own address, a peer in another network namespace, whose sockets
        # these lookups do not see: counted by its address)
        return _Peer(accepted.key, name)

    def _refuse(self, conn: socket.socket, listener: _Listener, reason: str, peer: _Peer | None, why: str) -> None:
        conn.close()
        if ("grpc", reason) in self.refusals:
            self.refusals[("grpc", reason)] += 1
        self._audit.warning(f"grpc {reason}", "action=refuse-connection listener=%s peer=%s reason=%s",
                            listener.public, peer.name if peer is not None else "-", why)

    # -- connections that have not authenticated (on the gate's loop) -------------------------------------------------

    def _track(self, relay: _Relay | _PumpedRelay) -> None:
        mine = self.unauthenticated.setdefault(relay.peer.key, {})
        mine[relay] = None
        self._move(relay.peer.key, len(mine) - 1, len(mine))

    def _untrack(self, relay: _Relay | _PumpedRelay) -> None:
        key = relay.peer.key
        mine = self.unauthenticated.get(key)
        if mine is None or relay not in mine:
            return
        del mine[relay]
        self._move(key, len(mine) + 1, len(mine))
        if not mine:
            del self.unauthenticated[key]

    def _move(self, key: str, was: int, now: int) -> None:
        if was:
            self._holding[was].pop(key, None)
        if now:
            self._holding[now][key] = None

    def _evictable(self, key: str) -> _Relay | _PumpedRelay | None:
        """The connection a newcomer of peer ``key`` takes the place of at max_grpc_connections: the oldest
        unauthenticated connection of the peer holding the most, if it holds more than ``key`` does."""
        mine = len(self.unauthenticated.get(key, ()))
        for count in range(self.max_per_peer, mine, -1):
            while self._holding[count]:
                holder = next(iter(self._holding[count]))
                oldest = next(iter(self.unauthenticated[holder]))
                if not oldest.authenticated:
                    return oldest
                self._authenticated(oldest)  # (it authenticated on the front's thread a moment ago)
        return None

    def claim(self, relay: _Relay | _PumpedRelay, tenant: str, watch: Watch | None = None) -> bool:
        """Count ``relay``'s first authenticated call's ``tenant`` (on the front's loop), and watch its credential
        (``watch``); False (counted in gpubroker_endpoint_refusals, audited rate-limited) if the tenant holds
        max_per_tenant already."""
        with self._tenant_lock:
            if not relay.counted or relay.tenant is not None:  # (gone already, or counted)
                return True
            held = self.per_tenant.get(tenant, 0)
            if self.max_per_tenant is not None and held >= self.max_per_tenant:
                refused = True
            else:
                refused = False
                self.per_tenant[tenant] = held + 1
                relay.tenant = tenant
                if watch is not None:
                    # A rotated token's (or a removed tenant's) connection is one that never authenticated again:
                    # else its holder would keep it for ever (a wrong token's calls keep gRPC's idle close away),
                    # never evicted, in its former tenant's share. (Under the lock: its release takes it off.)
                    relay.unwatch = watch(functools.partial(self._revoked, relay))
        if refused:
            self.refusals[("grpc", "tenant connections")] += 1
            self._audit.warning("grpc tenant connections", "action=refuse-call peer=%s tenant=%s reason=the tenant "
                                "holds %d authenticated gRPC connections, max_grpc_connections_per_tenant",
                                relay.peer.name, tenant, held)
        return not refused

    def _revoked(self, relay: _Relay | _PumpedRelay) -> None:
        """The credential that authenticated ``relay`` was revoked (on the front's loop, at a reload): it gives back
        its place in its tenant's share and is unauthenticated again, until a call authenticates on it."""
        relay.unwatch = None  # (the revocation took the watch off)
        self._untenant(relay)
        relay.authenticated = False
        self._on_gate_loop(self._unauthenticated, relay)

    def _unauthenticated(self, relay: _Relay | _PumpedRelay) -> None:
        if not relay.counted or relay.authenticated:  # (gone, or authenticated again meanwhile)
            return
        if relay.peer.key not in self.unauthenticated or relay not in self.unauthenticated[relay.peer.key]:
            self._track(relay)
        if self.unauthenticated_seconds is not None and relay.deadline is None:
            assert self._loop is not None
            relay.deadline = self._loop.call_later(self.unauthenticated_seconds, self._expire, relay)

    def _on_gate_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the gate's loop: from the front's loop, handed over where the gate has a thread of
        its own (nothing, once that loop has stopped); here otherwise."""
        if self._own_thread and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # (its loop already stopped)
                self._loop.call_soon_threadsafe(fn, *args)
        else:
            fn(*args)

    def _untenant(self, relay: _Relay | _PumpedRelay) -> None:
        with self._tenant_lock:
            if (tenant := relay.tenant) is not None:
                relay.tenant = None
                left = self.per_tenant.get(tenant, 1) - 1
                if left > 0:
                    self.per_tenant[tenant] = left
                else:
                    self.per_tenant.pop(tenant, None)

    def authenticated(self, relay: _Relay | _PumpedRelay) -> None:
        """``relay`` carried an authenticated call (``grpc_authenticated``, on the front's loop)."""
        self._on_gate_loop(self._authenticated, relay)

    def _authenticated(self, relay: _Relay | _PumpedRelay) -> None:
        if relay.deadline is not None:
            relay.deadline.cancel()
            relay.deadline = None
        self._untrack(relay)

    def _expire(self, relay: _Relay | _PumpedRelay) -> None:
        relay.deadline = None
        if not relay.authenticated and relay.counted:
            self._drop(relay, "unauthenticated timeout", f"no authenticated call within grpc_unauthenticated_seconds "
                       f"({self.unauthenticated_seconds:g})")

    def _drop(self, relay: _Relay | _PumpedRelay, reason: str, why: str) -> None:
        """Close ``relay`` at once (it never authenticated); its place is free now."""
        self.refusals[("grpc", reason)] += 1
        self._audit.warning(f"grpc {reason}", "action=close-connection peer=%s reason=%s", relay.peer.name, why)
        self._uncount(relay)
        relay.abort()

    def _uncount(self, relay: _Relay | _PumpedRelay) -> None:
        """Give back ``relay``'s places: when it is released, or at once when it is dropped."""
        with self._tenant_lock:
            if not relay.counted:
                return
            relay.counted = False
        self._untenant(relay)
        if (unwatch := relay.unwatch) is not None:
            relay.unwatch = None
            if self._own_thread and self._front_loop is not None:  # (the watches are the front loop's)
                with contextlib.suppress(RuntimeError):
                    self._front_loop.call_soon_threadsafe(unwatch)
            else:
                unwatch()
        if relay.deadline is not None:
            relay.deadline.cancel()
            relay.deadline = None
        self._untrack(relay)
        self.open -= 1
        key = relay.peer.key
        left = self.per_peer.get(key, 1) - 1
        if left > 0:
            self.per_peer[key] = left
        else:
            self.per_peer.pop(key, None)

    def too_many_calls(self, relay: _Relay | _PumpedRelay) -> None:
        """``relay``'s peer started a call past its call rate (on the front's loop): cut the connection."""
        assert self.call_rate is not None
        self.call_rate.count("grpc")
        if relay.cutting:
            return
        relay.cutting = True
        self._audit.warning("grpc call rate", "action=close-connection peer=%s reason=over "
                            "max_grpc_calls_per_peer_per_second (%g a second, %g at once)", relay.peer.name,
                            self.call_rate.rate, self.call_rate.burst)
        self._on_gate_loop(relay.cut)

    def over_control_rate(self, relay: _Relay | _PumpedRelay, frames: ControlFrames, data: bytes) -> bool:
        """Whether ``data``, from ``relay``'s client, takes its peer past its control-frame rate: then it is not
        relayed, and the connection is cut (on the gate's loop)."""
        rate = self.control_rate
        assert rate is not None
        # (what the peer has left bounds what is read of a flood: a flooder reconnecting with its bucket empty is
        # cut at its first control frame)
        now = time.monotonic()
        cost = frames.feed(data, rate.left(relay.peer.key, now))
        if not cost or rate.take(relay.peer.key, now, cost):
            return False
        frames.reading = False  # (read no more of it)
        self.refusals[("grpc", "control frames")] += 1
        if not relay.cutting:
            relay.cutting = True
            self._audit.warning("grpc control frames", "action=close-connection peer=%s reason=over "
                                "max_grpc_control_frames_per_peer_per_second (%g a second, %g at once): HTTP/2 "
                                "frames that start no call", relay.peer.name, rate.rate, rate.burst)
            relay.cut()
        return True

    def _release(self, relay: _Relay | _PumpedRelay) -> None:
        self._relays.discard(relay)
        self._uncount(relay)
        if not self._relays and self._emptied is not None and not self._emptied.done():
            self._emptied.set_result(None)


class _Side(asyncio.Protocol):
    """One side of a relayed connection: what it receives is written to the other side."""

    def __init__(self, relay: _Relay, frames: ControlFrames | None = None) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.other: _Side | None = None
        self.early: list[bytes] = []  # received before the other side opened
        self.frames = frames  # the client's side: its control frames, counted against its peer's rate

    def _peer_transport(self) -> asyncio.Transport | None:
        other = self.other.transport if self.other is not None else None
        return other if other is not None and not other.is_closing() else None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # (uvloop's: not a subclass, the same API)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        self.relay.sides += 1
        other = self.other
        assert other is not None
        if other.transport is None:
            # Nowhere to write to yet (gRPC sends its SETTINGS at once): what comes meanwhile waits here. (Reading
            # is paused, but uvloop starts a transport's reading only after this returns.)
            transport.pause_reading()
        else:
            if other.early:
                transport.writelines(other.early)
                other.early = []
            other.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        frames = self.frames
        if frames is not None and frames.reading is not False and self.relay.gate.over_control_rate(
                self.relay, frames, data):
            return
        other = self._peer_transport()
        if other is not None:
            other.write(data)
        elif self.other is not None and self.other.transport is None and not self.relay.closing:
            self.early.append(data)

    def eof_received(self) -> bool:
        self.relay.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.relay.sides -= 1
        self.relay.close()

    def pause_writing(self) -> None:
        other = self._peer_transport()
        if other is not None:
            other.pause_reading()

    def resume_writing(self) -> None:
        other = self._peer_transport()
        if other is not None and not (self.relay.cutting and self is self.relay.backend):  # (the cut client stays)
            other.resume_reading()


class _Relay:
    """A connection the gate admitted: the client's socket and the gate's socket to gRPC, joined."""

    def __init__(self, gate: GrpcGate, peer: _Peer) -> None:
        self.gate = gate
        self.peer = peer
        self.client = _Side(self, ControlFrames() if gate.control_rate is not None else None)
        self.backend = _Side(self)
        self.client.other, self.backend.other = self.backend, self.client
        self.sides = 0  # transports open
        self.opening = True
        self.closing = False
        self.cutting = False  # its peer went over its call rate: the client is no longer read, and closed soon
        self.released = False
        self.name = ""  # gRPC's peer string of the gate's end
        self.task: asyncio.Task[None] | None = None
        self._cut: asyncio.TimerHandle | None = None
        self.authenticated = False  # a call on it authenticated (set on the front's loop: grpc_authenticated)
        self.tenant: str | None = None  # whose max_grpc_connections_per_tenant it counts against, once authenticated
        self.unwatch: Callable[[], None] | None = None  # takes its credential's revocation watch off
        self.counted = True  # it holds its places in the gate's counts (given back when released or dropped)
        self.deadline: asyncio.TimerHandle | None = None  # closes it unless it authenticates first

    async def open(self, conn: socket.socket, backend: socket.socket, private: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            backend.setblocking(False)
            conn.setblocking(False)
            self.name = _name_relay(backend, self)
            await loop.sock_connect(backend, private)
            await loop.create_unix_connection(lambda: self.backend, sock=backend)
            await loop.connect_accepted_socket(lambda: self.client, sock=conn)
        except BaseException as exc:
            if isinstance(exc, (OSError, RuntimeError)) and not self.closing:
                log.warning("gRPC gate: cannot relay %s to gRPC: %s", self.peer.name, exc)
            if self.backend.transport is None:
                backend.close()
            if self.client.transport is None:
                conn.close()
            self.close()
            if not isinstance(exc, (OSError, RuntimeError)):
                raise  # (cancelled: the gate is stopping)
        finally:
            self.opening = False
            self._maybe_release()

    def close(self) -> None:
        """End both sides: each first sends what it holds (for CLOSE_GRACE at most)."""
        if not self.closing:
            self.closing = True
            for side in (self.client, self.backend):
                if side.transport is not None:
                    side.transport.close()
            if self.sides:
                self._cut = asyncio.get_running_loop().call_later(CLOSE_GRACE, self.abort)
        self._maybe_release()

    def cut(self) -> None:
        """Stop relaying what the client sends (its calls no longer reach gRPC), and close in CUT_GRACE."""
        if self.client.transport is not None:
            self.client.transport.pause_reading()
        if not self.closing:
            asyncio.get_running_loop().call_later(CUT_GRACE, self.close)

    def abort(self) -> None:
        self.closing = True
        for side in (self.client, self.backend):
            if side.transport is not None:
                side.transport.abort()
        if self.task is not None and self.opening:
            self.task.cancel()

    def _maybe_release(self) -> None:
        if self.closing and not self.opening and not self.sides and not self.released:
            self.released = True
            if self._cut is not None:
                self._cut.cancel()
            if self.name:
                _relayed.pop(self.name, None)
            self.gate._release(self)


class _PumpedRelay:
    """A connection the gate admitted on vsock, relayed with the loop's ``sock_*`` calls rather than transports
    (uvloop cannot make a transport of a vsock socket): each direction holds at most one chunk, and a side that does
    not take it pushes back on the other. Either side ending ends both, as in ``relay.py``."""

    def __init__(self, gate: GrpcGate, peer: _Peer) -> None:
        self.gate = gate
        self.peer = peer
        self.cutting = False  # its peer went over its call rate: the client is no longer read, and closed soon
        self.name = ""  # gRPC's peer string of the gate's end
        self.task: asyncio.Task[None] | None = None
        self.authenticated = False  # a call on it authenticated (set on the front's loop: grpc_authenticated)
        self.tenant: str | None = None  # whose max_grpc_connections_per_tenant it counts against, once authenticated
        self.unwatch: Callable[[], None] | None = None  # takes its credential's revocation watch off
        self.counted = True  # it holds its places in the gate's counts (given back when released or dropped)
        self.deadline: asyncio.TimerHandle | None = None  # closes it unless it authenticates first
        self._upstream: asyncio.Task[None] | None = None  # client -> gRPC
        self._ended: asyncio.Future[None] | None = None

    async def open(self, conn: socket.socket, backend: socket.socket, private: str) -> None:
        loop = asyncio.get_running_loop()
        self._ended = ended = loop.create_future()
        pumps: list[asyncio.Task[None]] = []
        try:
            backend.setblocking(False)
            conn.setblocking(False)
            self.name = _name_relay(backend, self)
            await loop.sock_connect(backend, private)
            frames = ControlFrames() if self.gate.control_rate is not None else None
            self._upstream = loop.create_task(pump(conn, backend, inspect=None if frames is None else (
                lambda data: frames.reading is False or not self.gate.over_control_rate(self, frames, data))))
            pumps = [self._upstream, loop.create_task(pump(backend, conn))]
            for task in pumps:
                task.add_done_callback(self._pump_ended)
            await ended
        except OSError as exc:
            log.warning("gRPC gate: cannot relay %s to gRPC: %s", self.peer.name, exc)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            conn.close()
            backend.close()
            if self.name:
                _relayed.pop(self.name, None)
            self.gate._release(self)

    def _pump_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() and task is self._upstream and self.cutting:
            return  # (the cut stopped reading the client: the refusal still goes out until CUT_GRACE)
        self._end()

    def _end(self) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    def cut(self) -> None:
        """Stop relaying what the client sends (its calls no longer reach gRPC), and close in CUT_GRACE."""
        self.cutting = True
        if self._upstream is not None and not self._upstream.done():
            self._upstream.cancel()
            asyncio.get_running_loop().call_later(CUT_GRACE, self._end)

    def abort(self) -> None:
        if self.task is not None:
            self.task.cancel()


def _name_relay(backend: socket.socket, relay: _Relay | _PumpedRelay) -> str:
    """Bind ``backend`` (the gate's socket to gRPC) to an abstract address, under which gRPC names the relayed
    connection's peer and ``_relayed`` finds ``relay``; "" if it cannot be (gRPC's peer is then "unix:", and audit
    lines show that)."""
    with contextlib.suppress(OSError):
        backend.bind("")  # Linux autobind: an abstract address no other socket has
        name = backend.getsockname()
        if isinstance(name, bytes) and name[:1] == b"\0":
            seen = "unix-abstract:" + name[1:].decode("ascii", "replace")
            _relayed[seen] = relay
            return seen
    return ""
