"""Limits before authentication on the raw Unix listeners (``<socket>.fast``, ``<socket>.shm``).

Anyone who can open a socket can hold a connection and make the broker buffer what it sends before it knows who
is talking. So until a connection has authenticated it is counted, in all and per peer uid (the kernel's
SO_PEERCRED, which a peer cannot forge), and refused at once past either cap; its first frame (the hello) must
fit in ``hello_max_bytes`` and arrive within ``hello_timeout_seconds``. Refusals go to the audit log with the
peer's pid and uid, rate-limited. Authenticated connections that sit idle for ``connection_idle_seconds`` are
closed by a sweep (a timestamp per frame costs less than a timer per frame).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..auth import RateLimitedLog, peer_credentials
from ..config import BrokerConfig

__all__ = ["IdleSweeper", "PreAuthGate", "Ticket"]

audit = logging.getLogger("gpubroker.audit")
def _where(listener: str) -> str:
    """A listener as the audit names it: a Unix socket's path as ``unix:PATH``; the link's TCP and vsock
    listeners by their own scheme (``tls:HOST:PORT peer=...``)."""
    return listener if listener.startswith(("tcp:", "tls:", "vsock:")) else f"unix:{listener}"


@dataclass
class Ticket:
    """One admitted connection that has not authenticated yet; ``done`` gives its place back (once)."""

    gate: PreAuthGate
    pid: int
    uid: int
    # Whose count it is in: the peer's uid on local sockets; on TCP, where every peer's uid is unknown (-1),
    # its address, so that one remote host's connections cannot use up everyone's share.
    key: int | str
    listener: str
    open: bool = True

    @property
    def peer(self) -> str:
        return f"{_where(self.listener)} pid={self.pid} uid={self.uid}"

    def done(self) -> None:
        if self.open:
            self.open = False
            self.gate._release(self.key)

    def refuse(self, why: str) -> None:
        """Audit a refusal of this connection (the caller closes it)."""
        self.gate.refused(self.listener, self.pid, self.uid, why)
        self.done()


class PreAuthGate:
    """Counts unauthenticated connections across every raw listener of the broker."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.total = 0
        self.per_uid: dict[int | str, int] = {}
        self.audit = RateLimitedLog(audit)
        self.refusals = 0

    @property
    def hello_max_bytes(self) -> int:
        return max(1, min(self.config.hello_max_bytes, 64 * 1024))

    @property
    def hello_timeout(self) -> float:
        """Seconds a hello may take (the config's schema keeps it above 0)."""
        return self.config.hello_timeout_seconds

    def admit(self, sock: socket.socket | None, listener: str, address: str | None = None) -> Ticket | None:
        """A ticket for a new connection, or None (audited) when a cap is reached: the caller closes it. A TCP
        peer is counted by its ``address`` (the per-uid cap applies to each address)."""
        pid, uid = peer_credentials(sock)
        key: int | str = address if address is not None else uid
        cfg = self.config
        if self.total >= cfg.max_unauthenticated_connections:
            self.refused(listener, pid, uid, f"{self.total} unauthenticated connections open, the limit")
            return None
        mine = self.per_uid.get(key, 0)
        if mine >= cfg.max_unauthenticated_per_uid:
            who = f"address {address}" if address is not None else f"uid {uid}"
            self.refused(listener, pid, uid, f"{who} has {mine} unauthenticated connections open, the limit")
            return None
        self.total += 1
        self.per_uid[key] = mine + 1
        return Ticket(self, pid, uid, key, listener)

    def _release(self, key: int | str) -> None:
        self.total -= 1
        left = self.per_uid.get(key, 1) - 1
        if left > 0:
            self.per_uid[key] = left
        else:
            self.per_uid.pop(key, None)

    def refused(self, listener: str, pid: int, uid: int, why: str) -> None:
        self.refusals += 1
        # Rate-limited per listener (there are a few), so that a flood on one still leaves the others' lines.
        where = _where(listener)
        self.audit.warning(f"pre-auth refusals on {where}", "refused: peer=%s pid=%d uid=%d reason=%s",
                           where, pid, uid, why)


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
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
