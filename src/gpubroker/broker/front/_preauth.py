"""Limits before authentication on the raw listeners (``<socket>.fast``, the link's vsock and TCP ports).

Anyone who can open a socket can hold a connection and make the broker buffer what it sends before it knows who
is talking. So until a connection has authenticated it is counted, per kind of listener (the Unix ``.fast``
sockets, TCP, vsock: each has ``max_unauthenticated_connections`` of its own, so that peers of one can never take
the places of another's, the local fast path's least of all) and per peer across them all, and refused at once
past either cap. A peer is named as every listener of the front names it (``listeners.Peer.key``): by uid on a
Unix socket (SO_PEERCRED) and on TCP from this host (the uid owning the client's socket: every local user has the
address 127.0.0.1, and every address of 127.0.0.0/8 is the host's own), by its /24 or /64 on other TCP, by CID on
vsock; ``max_unauthenticated_per_uid`` caps each. Its first frame (the hello) must
fit in ``hello_max_bytes`` and arrive within ``hello_timeout_seconds``. Refusals go to the audit log with the
peer's pid and uid, rate-limited. Authenticated connections that sit idle for ``connection_idle_seconds`` are
closed by a sweep (a timestamp per frame costs less than a timer per frame).

A cap alone would let a flood of silent connections from one uid deny everyone of that uid (several tenants may
run as one uid): at a cap, a new connection takes the place of the oldest one that is *idle* (no hello bytes
waiting in its socket, or sitting out a failed authentication's delay) rather than being refused. A client
sends its hello as soon as it connects (the SDK does), so its connection is never the idle one; only when no
connection of that peer is idle is the new one refused. A malformed hello (not msgpack, not a map, unhashable
keys, cut short) is refused like a failed authentication: an answer, an audit line and the failure delay
(``refuse_malformed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._status import cancel_and_wait
from gpubroker.broker.front.auth import FailurePenalty, RateLimitedLog, failure_delay
from gpubroker.broker.front.listeners import Peer
from gpubroker.wire.addresses import VsockAddress

__all__ = ["IdleSweeper", "PreAuthGate", "Ticket", "refuse_and_delay", "refuse_malformed"]

audit = logging.getLogger("gpubroker.audit")
def _where(listener: str) -> str:
    """A listener as the audit names it: a Unix socket's path as ``unix:PATH``; the link's TCP and vsock
    listeners by their own scheme (``tls:HOST:PORT peer=...``)."""
    return listener if listener.startswith(("tcp:", "tls:", "vsock:")) else f"unix:{listener}"


@dataclass(eq=False)  # (each connection's own: the gate finds and removes it by identity)
class Ticket:
    """One admitted connection that has not authenticated yet; ``done`` gives its place back (once)."""

    gate: PreAuthGate
    pid: int
    uid: int
    # Whose count it is in (``Peer.key``): a local peer's uid, a remote one's network, so that one host's
    # connections cannot use up everyone's share; and which listeners' total (``Peer`` kind: unix, tcp, vsock).
    key: str
    listener: str
    kind: str
    open: bool = True
    # How the gate may end this connection to make room for a newer one of the same peer (None: never), and the
    # socket it peeks at to tell whether a hello is on its way.
    evict: Callable[[], None] | None = None
    sock: socket.socket | None = None
    judging: bool = False  # its hello is being authenticated: not idle, whatever its socket holds
    # Whether its hello has begun arriving where the socket no longer shows it (a TCP link's thread reads it):
    # then it is not idle either.
    progressed: Callable[[], bool] | None = None
    delaying: bool = False  # sitting out a failed authentication's delay: idle, whatever its socket holds
    _woken: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def peer(self) -> str:
        return f"{_where(self.listener)} pid={self.pid} uid={self.uid}"

    def done(self) -> None:
        if self.open:
            self.open = False
            self.gate._release(self)

    def refuse(self, why: str) -> None:
        """Audit a refusal of this connection (the caller closes it)."""
        self.gate.refused(self.listener, self.pid, self.uid, why)
        self.done()

    @property
    def idle(self) -> bool:
        """Evictable now: nothing of a hello waits in its socket (or its peer is gone) and none is being judged."""
        if not self.open or self.evict is None or self.judging:
            return False
        if self.progressed is not None and self.progressed():
            return False
        if self.delaying or self.sock is None:
            return True
        try:
            return not self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # (b"": the peer closed)
        except BlockingIOError:
            return True
        except OSError:
            return True  # (a broken connection: nothing will come)

    async def sit_out_failure(self) -> None:
        """Wait out the failure delay a failed authentication of this connection earned; meanwhile the
        connection keeps its place but is idle: a newer connection of its peer may take that place, which ends
        the wait at once (so an evicted connection's descriptor goes now, not after its delay)."""
        delay = failure_delay.get()
        if not delay:
            return
        failure_delay.set(0.0)
        self.delaying = True
        self._woken = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait([self._woken], timeout=delay)
        finally:
            self.delaying = False
            self._woken = None

    def _wake(self) -> None:
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)


class PreAuthGate:
    """Counts unauthenticated connections of every raw listener of the broker: per kind of listener, and per peer
    across them all."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.totals: dict[str, int] = {}  # by kind of listener (unix, tcp, vsock)
        self.per_uid: dict[str, int] = {}  # by peer (Peer.key)
        self.tickets: dict[str, list[Ticket]] = {}  # open tickets per peer key, oldest first
        self.evictions = 0
        self.audit = RateLimitedLog(audit)
        self.refusals = 0

    @property
    def hello_max_bytes(self) -> int:
        return max(1, min(self.config.hello_max_bytes, 64 * 1024))

    @property
    def hello_timeout(self) -> float:
        """Seconds a hello may take (the config's schema keeps it above 0)."""
        return self.config.hello_timeout_seconds

    @property
    def total(self) -> int:
        """Unauthenticated connections open on every raw listener."""
        return sum(self.totals.values())

    def admit(self, peer: Peer, listener: str) -> Ticket | None:
        """A ticket for a new connection, or None (audited) when a cap is reached: the caller closes it."""
        pid, uid, key = peer.pid, peer.uid, peer.key
        kind = ("unix" if peer.address is None else "vsock" if isinstance(peer.address, VsockAddress) else "tcp")
        cfg = self.config
        if self.per_uid.get(key, 0) >= cfg.max_unauthenticated_per_uid and not self._evict(key, None):
            self.refused(listener, pid, uid, f"{key} has {self.per_uid.get(key, 0)} unauthenticated connections "
                         "open (none idle), the limit")
            return None
        if self.totals.get(kind, 0) >= cfg.max_unauthenticated_connections and not self._evict(None, kind):
            self.refused(listener, pid, uid, f"{self.totals.get(kind, 0)} unauthenticated {kind} connections open "
                         "(none idle), the limit")
            return None
        self.totals[kind] = self.totals.get(kind, 0) + 1
        self.per_uid[key] = self.per_uid.get(key, 0) + 1
        ticket = Ticket(self, pid, uid, key, listener, kind)
        self.tickets.setdefault(key, []).append(ticket)
        return ticket

    def _evict(self, key: str | None, kind: str | None) -> bool:
        """Make room by ending the oldest idle connection of ``key`` (None: of the peer holding the most on
        listeners of ``kind``; None: of any kind); whether one was ended. A connection whose hello is on its way is
        never the one."""
        def held(k: str) -> int:
            return sum(1 for t in self.tickets[k] if kind is None or t.kind == kind)

        keys = [key] if key is not None else sorted(self.tickets, key=lambda k: -held(k))
        for k in keys:
            for ticket in list(self.tickets.get(k, ())):
                if (kind is None or ticket.kind == kind) and ticket.idle:
                    self.evictions += 1
                    evict = ticket.evict
                    ticket.refuse("no hello yet, and a newer connection of this peer needed its place")
                    assert evict is not None
                    with contextlib.suppress(OSError):
                        evict()
                    ticket._wake()
                    return True
        return False

    def _release(self, ticket: Ticket) -> None:
        key = ticket.key
        self.totals[ticket.kind] -= 1
        left = self.per_uid.get(key, 1) - 1
        if left > 0:
            self.per_uid[key] = left
        else:
            self.per_uid.pop(key, None)
        mine = self.tickets.get(key)
        if mine is not None:
            with contextlib.suppress(ValueError):
                mine.remove(ticket)
            if not mine:
                del self.tickets[key]

    def refused(self, listener: str, pid: int, uid: int, why: str) -> None:
        self.refusals += 1
        # Rate-limited per listener (there are a few), so that a flood on one still leaves the others' lines.
        where = _where(listener)
        # (by the listener alone: a TCP or vsock connection's name also holds its peer's address and port, and a
        # kind per connection would limit nothing)
        kind = f"pre-auth refusals on {where.split(' peer=', 1)[0]}"
        self.audit.warning(kind, "refused: peer=%s pid=%d uid=%d reason=%s", where, pid, uid, why)


async def refuse_malformed(ticket: Ticket, penalty: FailurePenalty, penalty_key: str, why: str) -> None:
    """A hello that is no hello (not msgpack, not a map, unhashable keys, cut short): audited (rate limited) and
    charged to its peer as a failed authentication, whose delay is waited out here; then the caller answers, or
    just closes, and gives the ticket back."""
    await refuse_and_delay(ticket, penalty, penalty_key, f"malformed hello: {why}")


async def refuse_and_delay(ticket: Ticket, penalty: FailurePenalty, penalty_key: str, why: str) -> None:
    """A connection refused before its hello was judged (a malformed hello, a failed TLS handshake): audited (rate
    limited) and charged to its peer as a failed authentication, whose delay is waited out here."""
    ticket.gate.refused(ticket.listener, ticket.pid, ticket.uid, why)
    failure_delay.set(penalty.fail(penalty_key))
    await ticket.sit_out_failure()


@dataclass(eq=False)
class Idle:
    """What the sweep needs of a connection: when it last did something, and how to close it."""

    close: Callable[[], None]
    last_active: float = field(default_factory=time.monotonic)
    busy: int = 0  # requests being served: a long kernel is not idleness


class IdleSweeper:
    """Closes authenticated connections that did nothing for ``idle_seconds`` (0: never)."""

    def __init__(self, idle_seconds: float, what: str) -> None:
        self.idle_seconds = idle_seconds
        self.what = what
        self.entries: set[Idle] = set()
        self._task: asyncio.Task[None] | None = None

    def add(self, close: Callable[[], None]) -> Idle:
        entry = Idle(close)
        self.entries.add(entry)
        if self._task is None and self.idle_seconds > 0:
            self._task = asyncio.get_running_loop().create_task(self._sweep(), name=f"idle-sweep {self.what}")
        return entry

    def remove(self, entry: Idle) -> None:
        self.entries.discard(entry)

    async def _sweep(self) -> None:
        interval = max(0.05, min(1.0, self.idle_seconds / 4))
        while True:
            await asyncio.sleep(interval)
            cutoff = time.monotonic() - self.idle_seconds
            for entry in [e for e in self.entries if not e.busy and e.last_active < cutoff]:
                self.entries.discard(entry)
                logging.getLogger("gpubroker.server").info("%s: closing a connection idle for %.0f s", self.what,
                                                           self.idle_seconds)
                with contextlib.suppress(OSError):
                    entry.close()

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
