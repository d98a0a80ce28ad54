"""A byte relay between a listening socket and a stream target: vsock <-> the broker's Unix socket.

PyPI grpcio refuses `vsock:` addresses, so VMs reach the broker through this relay: on the host the broker
listens on AF_VSOCK and pipes each connection to its own Unix socket (`serve --vsock-port`); in a guest
`gpubroker relay` accepts on a local Unix socket and connects out over AF_VSOCK. gRPC's own framing, auth and
credentials pass through untouched, because the broker and the client both still see a Unix socket.

Only the loop's `sock_*` primitives are used, never transports: uvloop builds a TCP transport for any
non-Unix socket (it sets TCP_NODELAY and cannot name vsock peers), so streams would fail on vsock there.
Each direction holds at most one chunk; `sock_sendall` waits for the kernel to take it before the next read,
so a slow side pushes back on the fast one instead of growing a buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from gpubroker.broker.front.auth import RateLimitedLog
from gpubroker.broker.front.listen import VMADDR_CID_ANY, VMADDR_PORT_ANY, listen_unix, vsock_socket
from gpubroker.broker.front.listeners import Acceptor, Peer, PeerRate, pump
from gpubroker.wire.addresses import AddressError, VsockAddress, parse_address, unix_path
from gpubroker.wire.errors import InvalidArgument

__all__ = ["VMADDR_CID_ANY", "VMADDR_PORT_ANY", "RelayServer", "serve_relay", "unix_connector", "vsock_connector"]

log = logging.getLogger("gpubroker.relay")
audit = logging.getLogger("gpubroker.audit")

Connector = Callable[[], Awaitable[socket.socket]]


def unix_connector(path: str) -> Connector:
    async def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, path)
        except BaseException:
            sock.close()
            raise
        return sock
    return connect


def vsock_connector(cid: int, port: int, timeout: float = 10.0) -> Connector:
    async def connect() -> socket.socket:
        # uvloop's sock_connect resolves non-Unix addresses through getaddrinfo, which knows no vsock:
        # connect blocking (bounded by the timeout) in a thread instead.
        sock = vsock_socket()
        sock.settimeout(timeout)
        try:
            await asyncio.to_thread(sock.connect, (cid, port))
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        return sock
    return connect


def _describe(sock: socket.socket, peer: object) -> str:
    if getattr(socket, "AF_VSOCK", None) == sock.family and isinstance(peer, tuple):
        return f"vsock CID {peer[0]} port {peer[1]}"
    return f"{sock.family.name} {peer!r}" if peer else sock.family.name


class RelayServer:
    """Accepts on ``listen_sock`` and relays each connection to a fresh socket from ``connect``."""

    def __init__(self, listen_sock: socket.socket, connect: Connector, max_connections: int,
                 max_per_peer: int = 0, idle_seconds: float = 0.0, connection_rate: PeerRate | None = None) -> None:
        self.listen_sock = listen_sock
        self.max_connections = max_connections
        # Before any byte is relayed nobody is authenticated: one peer (a VM's CID, a local uid) may hold at most
        # this many connections (0: no limit), and a connection with no traffic either way for idle_seconds is
        # closed (gRPC's keepalive pings keep live channels busy well within that).
        self.max_per_peer = max_per_peer
        self.idle_seconds = idle_seconds
        self._per_peer: dict[object, int] = {}
        self._refusals = RateLimitedLog(audit)
        self._connect = connect
        self._conns: set[asyncio.Task[None]] = set()
        self._acceptor = Acceptor(listen_sock, _describe(listen_sock, listen_sock.getsockname()), self._admit,
                                  "relay", connection_rate)

    @property
    def active(self) -> int:
        return len(self._conns)

    def start(self) -> None:
        self._acceptor.start()

    def _admit(self, conn: socket.socket, peer: Peer) -> bool:
        """Relay ``conn`` (accepted by the Acceptor), or refuse it by closing it at once."""
        who = _describe(conn, peer.accepted)
        key = _peer_key(conn, peer)
        if len(self._conns) >= self.max_connections:
            # Refuse by closing at once: queueing would let one guest hold the rest hostage.
            self._refusals.warning("relay refusal", "relay: refused %s, %d connections already open", who,
                                   len(self._conns))
            conn.close()
            return True
        if self.max_per_peer and self._per_peer.get(key, 0) >= self.max_per_peer:
            self._refusals.warning("relay refusal", "relay: refused %s (%s), which already has %d connections "
                                   "open, the limit per peer", who, key, self._per_peer[key])
            conn.close()
            return True
        log.info("relay: accepted %s", who)
        self._per_peer[key] = self._per_peer.get(key, 0) + 1
        task = asyncio.get_running_loop().create_task(self._relay(conn, who))
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)

        def left(_task: object, key: object = key) -> None:
            self._left(key)

        task.add_done_callback(left)
        return True

    def _left(self, key: object) -> None:
        left = self._per_peer.get(key, 1) - 1
        if left > 0:
            self._per_peer[key] = left
        else:
            self._per_peer.pop(key, None)

    async def _relay(self, client: socket.socket, who: str) -> None:
        backend: socket.socket | None = None
        try:
            client.setblocking(False)
            try:
                backend = await self._connect()
            except OSError as exc:
                log.warning("relay: %s: cannot reach the backend: %s", who, exc)
                return
            activity = [time.monotonic()]
            pumps = [asyncio.ensure_future(pump(client, backend, activity)),
                     asyncio.ensure_future(pump(backend, client, activity))]
            try:
                # Either side closing (or failing) ends the whole connection: close both, nothing lingers.
                while True:
                    done, _ = await asyncio.wait(pumps, timeout=self.idle_seconds / 4 or None,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if done:
                        break
                    if time.monotonic() - activity[0] > self.idle_seconds:
                        log.info("relay: closing %s, idle for %.0f s", who, self.idle_seconds)
                        break
            finally:
                for task in pumps:
                    task.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            client.close()
            if backend is not None:
                backend.close()
            log.debug("relay: closed %s", who)

    def close(self) -> None:
        """Stop accepting and end every relayed connection."""
        self._acceptor.close()
        for task in self._conns:
            task.cancel()

    async def wait_closed(self) -> None:
        await asyncio.gather(*self._conns, return_exceptions=True)


def _peer_key(sock: socket.socket, peer: Peer) -> object:
    """Whom a relayed connection is counted against: a VM's CID, a local peer's uid (SO_PEERCRED)."""
    if isinstance(peer.address, VsockAddress):
        return f"cid:{peer.address.cid}"
    if peer.address is None and peer.uid >= 0:
        return f"uid:{peer.uid}"
    return f"{sock.family.name}:{peer.accepted!r}"


async def serve_relay(listen_sock: socket.socket, target: str | Connector, max_connections: int = 256,
                      max_per_peer: int = 0, idle_seconds: float = 0.0,
                      connection_rate: PeerRate | None = None) -> RelayServer:
    """Relay connections on ``listen_sock`` to the Unix socket path ``target`` (or sockets ``target()`` opens)."""
    if max_connections < 1:
        raise InvalidArgument("max_connections must be >= 1")
    server = RelayServer(listen_sock, unix_connector(target) if isinstance(target, str) else target, max_connections,
                         max_per_peer, idle_seconds, connection_rate)
    server.start()
    return server


async def run_guest_relay(listen_path: str, cid: int, port: int, max_connections: int = 256,
                          mode: int = 0o660) -> None:
    """`gpubroker relay`: a local Unix socket in a guest, relayed to the broker over vsock, until signalled."""
    import signal

    relay = await serve_relay(listen_unix(Path(listen_path), mode), vsock_connector(cid, port), max_connections)
    log.info("relaying unix:%s to vsock CID %d port %d", listen_path, cid, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        relay.close()
        await relay.wait_closed()
        with contextlib.suppress(OSError):
            os.unlink(listen_path)


def run_relay_command(listen: str, vsock_connect: str, max_connections: int = 256, mode: int = 0o660) -> None:
    """`gpubroker relay --listen unix:PATH --vsock-connect CID:PORT`, on uvloop where it is installed."""
    path = unix_path(listen)
    if not path:
        raise InvalidArgument(f"--listen must be unix:PATH, not {listen!r}")
    try:
        host = parse_address(f"vsock:{vsock_connect}")
        if not isinstance(host, VsockAddress):
            raise AddressError
        cid, port = host.cid, host.port
    except AddressError:
        raise InvalidArgument(f"--vsock-connect must be CID:PORT (e.g. 2:7070), not {vsock_connect!r}") from None
    vsock_socket().close()  # no vsock here: say so now, not on the first client's connection
    try:
        import uvloop
    except ImportError:
        uvloop = None  # type: ignore[assignment]  # the module or None, tested before use
    main = run_guest_relay(path, cid, port, max_connections, mode)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(main) if uvloop is not None else asyncio.run(main)
