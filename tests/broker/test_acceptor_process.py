"""The front's acceptor process (``src/gpubroker/broker/front/_acceptor.py``) with real listeners in this process:
what it admits reaches the listener with its peer as the front names it, what it refuses is counted, a closed
listener refuses at once, a paused one keeps its connections in the backlog, and the front accepts on its loop
once the process is gone; the process runs at a lower priority and dies with the front. A real broker behind it:
tests/security/test_connection_churn_latency.py."""

from __future__ import annotations

import asyncio
import errno
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from gpubroker.broker.front._acceptor import ACCEPTOR_NICE, CHURN_REFUSALS, CHURN_WINDOW, AcceptorProcess, ChurnBans
from gpubroker.broker.front.listeners import Acceptor, Peer, PeerRate

TIMEOUT = 10.0


async def until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    """Wait (on the loop, which serves the acceptors meanwhile) until ``condition`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class Listener:
    """A Unix listener at ``path`` (or TCP on loopback) accepting through the acceptor process."""

    def __init__(self, accepts: AcceptorProcess, rate: PeerRate, path: Path | None = None,
                 admit: Callable[[socket.socket, Peer], bool] | None = None) -> None:
        if path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path))
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.address = sock.getsockname()
        self.family = sock.family
        self.admitted: list[tuple[socket.socket, Peer]] = []
        self.acceptor = Acceptor(sock, f"test:{self.address}", admit or self.keep, "link", rate, accepts)
        self.acceptor.start()

    def keep(self, conn: socket.socket, peer: Peer) -> bool:
        self.admitted.append((conn, peer))
        return True

    def connect(self) -> socket.socket:
        client = socket.socket(self.family, socket.SOCK_STREAM)
        client.connect(self.address)
        return client


@asynccontextmanager
async def acceptor_process(rate: float = 1000.0, burst: float = 1000.0) -> AsyncIterator[tuple[AcceptorProcess,
                                                                                                 PeerRate]]:
    peer_rate = PeerRate(rate, burst, {})
    accepts = AcceptorProcess(peer_rate)
    await accepts.start()
    try:
        yield accepts, peer_rate
    finally:
        await accepts.close()


def test_admitted_connections_reach_the_listener_named_by_the_front(tmp_path: Path) -> None:
    async def main() -> None:
        async with acceptor_process() as (accepts, rate):
            unix, tcp = Listener(accepts, rate, tmp_path / "s"), Listener(accepts, rate)
            clients = [unix.connect(), tcp.connect()]
            await until(lambda: len(unix.admitted) == 1 and len(tcp.admitted) == 1, "both connections admitted")
            conn, peer = unix.admitted[0]
            assert (peer.pid, peer.uid, peer.address) == (os.getpid(), os.getuid(), None)
            assert not conn.getblocking()
            conn, peer = tcp.admitted[0]
            # (the owner of a local TCP peer's socket: the one thing the front takes from the acceptor process)
            assert peer.local and peer.uid == os.getuid() and peer.key == f"uid {os.getuid()}"
            assert peer.address is not None and peer.address.port == clients[1].getsockname()[1]
            assert os.getpriority(os.PRIO_PROCESS, accepts.process.pid) == (  # type: ignore[union-attr]
                min(19, os.getpriority(os.PRIO_PROCESS, 0) + ACCEPTOR_NICE))
            for sock in [*clients, *(c for c, _ in unix.admitted + tcp.admitted)]:
                sock.close()
            unix.acceptor.close()
            tcp.acceptor.close()

    asyncio.run(main())


def test_connections_past_the_rate_are_refused_in_the_process_and_counted(tmp_path: Path) -> None:
    async def main() -> None:
        async with acceptor_process(rate=1.0, burst=5) as (accepts, rate):
            listener = Listener(accepts, rate, tmp_path / "s")
            for _ in range(60):
                listener.connect().close()
            refused = rate.refusals
            await until(lambda: refused.get(("link", "connection rate"), 0) + len(listener.admitted) == 60,
                        "every connection admitted or counted as refused")
            assert len(listener.admitted) <= 5 + 1  # (the bucket, and what it refilled meanwhile)
            listener.acceptor.close()

    asyncio.run(main())


def test_a_closed_listener_refuses_at_once_whoever_holds_it(tmp_path: Path) -> None:
    async def main() -> None:
        async with acceptor_process() as (accepts, rate):
            unix, tcp = Listener(accepts, rate, tmp_path / "s"), Listener(accepts, rate)
            for listener in (unix, tcp):
                listener.connect().close()
            await until(lambda: len(unix.admitted) == 1 and len(tcp.admitted) == 1, "both listeners serving")
            assert accepts.process is not None
            # Stopped: it cannot close its copy of either listening socket, which the kernel must refuse all the same
            # (the front shuts it: the same socket whoever holds it).
            accepts.process.send_signal(signal.SIGSTOP)
            try:
                for listener in (unix, tcp):
                    listener.acceptor.close()
                    with pytest.raises(ConnectionRefusedError):
                        listener.connect()
            finally:
                accepts.process.send_signal(signal.SIGCONT)

    asyncio.run(main())


def test_a_paused_listener_keeps_its_connections_in_the_backlog(tmp_path: Path) -> None:
    async def main() -> None:
        full = [True]
        listener: Listener

        def admit(conn: socket.socket, peer: Peer) -> bool:
            if full[0]:  # out of descriptors, as the gRPC gate is when it cannot open its socket to gRPC
                full[0] = False
                conn.close()
                listener.acceptor.back_off(OSError(errno.EMFILE, os.strerror(errno.EMFILE)))
                return False
            return listener.keep(conn, peer)

        async with acceptor_process() as (accepts, rate):
            listener = Listener(accepts, rate, tmp_path / "s", admit)
            clients = [listener.connect()]
            await until(lambda: not full[0], "the front out of descriptors")
            assert listener.acceptor.backoff > 0
            clients.append(listener.connect())  # (waits in the backlog while the listener is paused)
            await until(lambda: len(listener.admitted) == 1, "the next connection admitted after the pause")
            for sock in [*clients, *(c for c, _ in listener.admitted)]:
                sock.close()
            listener.acceptor.close()

    asyncio.run(main())


def test_the_front_accepts_on_its_loop_once_the_process_is_gone(tmp_path: Path) -> None:
    async def main() -> None:
        async with acceptor_process() as (accepts, rate):
            listener = Listener(accepts, rate, tmp_path / "s")
            listener.connect().close()
            await until(lambda: len(listener.admitted) == 1, "a connection admitted by the process")
            assert accepts.process is not None
            accepts.process.kill()
            await until(lambda: not accepts.alive, "the front to see the process gone")
            listener.connect().close()
            await until(lambda: len(listener.admitted) == 2, "a connection accepted on the front's loop")
            listener.acceptor.close()

    asyncio.run(main())


FRONT = textwrap.dedent("""
    import asyncio, os, socket, sys
    from gpubroker.broker.front._acceptor import AcceptorProcess
    from gpubroker.broker.front.listeners import Acceptor, PeerRate

    async def main():
        accepts = AcceptorProcess(PeerRate(10, 10))
        await accepts.start()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(sys.argv[1])
        sock.listen()
        admitted = asyncio.get_running_loop().create_future()
        Acceptor(sock, "test", lambda conn, peer: admitted.set_result(conn) or True, "link", None, accepts).start()
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(sys.argv[1])
        await admitted  # (the process is running: its parent-death signal is set)
        print(accepts.process.pid, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def test_the_process_dies_with_the_front(tmp_path: Path) -> None:
    front = subprocess.Popen([sys.executable, "-c", FRONT, str(tmp_path / "s")], stdout=subprocess.PIPE, text=True)
    try:
        assert front.stdout is not None
        child = int(front.stdout.readline())
        pidfd = os.pidfd_open(child)
        os.kill(child, signal.SIGSTOP)  # (a stopped process reads no end-of-file: its parent-death signal kills it)
    finally:
        front.kill()
        front.wait()
    try:
        assert select.select([pidfd], [], [], TIMEOUT)[0], "the acceptor process outlived the front"
    finally:
        if not select.select([pidfd], [], [], 0)[0]:  # (failed: no stopped process left behind)
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.close(pidfd)


def _acl_users(path: Path) -> set[int]:
    """The uids the socket file at ``path`` has a named user's ACL entry for (none: no ACL)."""
    try:
        acl = os.getxattr(path, "system.posix_acl_access")
    except OSError:
        return set()
    return {ident for tag, _, ident in struct.iter_unpack("<HHI", acl[4:]) if tag == 0x02}


def test_a_churning_uid_is_banned_from_the_unix_sockets_then_let_back(tmp_path: Path) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        paths = [tmp_path / "a.sock", tmp_path / "b.sock"]
        socks = []
        for path in paths:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path))
            os.chmod(path, 0o660)
            socks.append(sock)
        bans = ChurnBans(loop)
        for path in paths:
            bans.add(str(path))
        now = 1000.0
        bans.refused("uid 4321", CHURN_REFUSALS - 1, now)
        bans.refused("uid 4321", 1, now + CHURN_WINDOW + 0.1)  # (a new window: no ban)
        bans.refused("uid 0", 10 * CHURN_REFUSALS, now)  # (root: no permission stops it)
        bans.refused("10.0.0.0/24", 10 * CHURN_REFUSALS, now)  # (a remote peer: no uid)
        assert not bans.banned and all(not _acl_users(path) for path in paths)
        bans.refused("uid 4321", CHURN_REFUSALS, now + 2 * CHURN_WINDOW)
        assert bans.banned == {4321}
        assert all(_acl_users(path) == {4321} for path in paths)
        assert all(os.stat(path).st_mode & 0o777 == 0o660 for path in paths)  # (the mode is the same)
        bans._lift(4321)  # (as the timer does, BAN_SECONDS later)
        assert not bans.banned and all(not _acl_users(path) for path in paths)
        for sock in socks:
            sock.close()

    asyncio.run(main())
