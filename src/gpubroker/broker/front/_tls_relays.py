"""The front's TLS relay processes: a TCP link over TLS is decrypted and encrypted outside the front's process.

A link's relay is its whole cost: every byte decrypted, encrypted and copied. OpenSSL decrypts a TLS record
(16 KiB) a call, and Python's ssl lets go of the GIL for each call and takes it again; threads of one process
doing so take turns on its interpreter, each turn a wake-up of the thread that waits. Measured on an H200 host
(16 cores; the front's own ``_relay`` between TLS clients and a drain process), TLS streams through relay threads
of one process went at 1.2-1.6 GB/s in all for 1 to 8 streams; through a process each, 2.5 GB/s for 2 and 4.8 GB/s
for 4. So the front starts a few processes (``link_tls_processes``: by default one per two cores, at most 4), and
each takes its share of the TLS links, in a thread a link as before (``TcpRelay``): a striped copy's links are
dealt to different processes (the one relaying fewest links takes the next).

Each is this module run with ``python -m`` (subprocess: never a fork of the front's threads): no grpc, no device
code. It gets the TLS certificate, key and client CA in a memfd (``Serve``), never from a file; the connection of
each link after the front admitted it (the pre-authentication caps, per-peer counts and evictions all stay the
front's), with one typed message a packet on a Unix SOCK_SEQPACKET socketpair (``wire/tls_relay.py``). It does
the handshake, reads the hello and sends it to the front, which judges it on its loop as every hello; the front's
verdict comes back with the worker's end of the link's socketpair, and the process relays until either end
closes, then says so (the link's place in the counts is given back). The front keeps a descriptor of the
connection until the hello comes: an abort (the hello's deadline, an eviction) shuts it and settles the link in the
front at once, whatever the process has done with it yet; and a process that owes MAX_PENDING hellos is given no
more links until it catches up (the front's threads relay them meanwhile), so a flood of connections evicted as
fast as they come, or a hung process, costs the front no more than its caps allow. A process exits with
the front (PR_SET_PDEATHSIG, and the socketpair's end); should one end first, its links end (the front hears of
each, its hello failing or its relay over), another is started in its place, and meanwhile links go to the others
or (none left) to threads of the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from gpubroker.broker.front._child_channel import FD_SPACE, ChildChannel, die_with_parent, start_child, take_fds
from gpubroker.broker.front._tcp_relay import HandshakeFailed, Hello, HelloCutShort, SpinShare, TcpRelay
from gpubroker.wire.ring import link_spin_us
from gpubroker.wire.tls_relay import (
    MAX_NAME,
    MAX_NAMES,
    MAX_RELAY_MESSAGE,
    MAX_RELAYED_HELLO,
    Abort,
    Ended,
    Failure,
    HelloFailed,
    HelloRead,
    Progressed,
    Ready,
    Relay,
    Serve,
    Verdict,
    decode_from_relay,
    decode_serve,
    decode_to_relay,
    encode,
)

__all__ = ["HelperRelay", "TlsRelays", "server_context", "tls_relay_processes"]

log = logging.getLogger("gpubroker.server")

# Processes at most: a striped copy uses 4 links (client/_transports/_link.py TCP_STRIPES).
MAX_PROCESSES: Final = 4
# Links a process may owe the front their hello's report (handed over, not yet reported) before it is given no
# more: more than the pre-authentication caps let wait at once (max_unauthenticated_connections, 256), so only a
# process that fell behind (a flood of connections evicted as fast as they come, a process that hangs) reaches it.
MAX_PENDING: Final = 512
# How long the front waits for a process to say it is ready; one that does not is killed (its links are then
# relayed by threads of the front).
START_TIMEOUT: Final = 10.0
# A process that ended is started again, at most this often (one that fails at once is not restarted in a loop).
RESTART_SECONDS: Final = 1.0


def tls_relay_processes() -> int:
    """TLS relay processes for this host: one per two cores the front may use (a relay's decryption and the
    client's or the worker's side of it), at least one, at most MAX_PROCESSES."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_PROCESSES, cores // 2))


def server_context(material: Serve) -> ssl.SSLContext:
    """The TLS server context of a link: TLS 1.2 or later, this certificate chain and key, and (with a client CA)
    a client certificate required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # ssl loads a chain and key only from files: copies in a private temporary directory, removed at once.
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_path.write_bytes(material.cert)
        key_path.touch(0o600)
        key_path.write_bytes(material.key)
        context.load_cert_chain(cert_path, key_path)
    if material.client_ca is not None:
        context.load_verify_locations(cadata=material.client_ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context


# -- the front's side --------------------------------------------------------------------------------------------


class HelperRelay:
    """A link relayed by a TLS relay process (a `LinkRelay`, as `_links.py` sees it)."""

    def __init__(self, process: _Process, link: int, conn: socket.socket, hello_limit: int, timeout: float,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.hello: asyncio.Future[Hello] = loop.create_future()
        self.on_end: Callable[[], Any] | None = None
        self.link = link
        self._process = process
        self._conn: socket.socket | None = conn  # (kept until the hello comes: an abort shuts it whatever happens)
        self._hello_limit = hello_limit
        self._timeout = timeout
        self._aborted = False
        self._progressed = False
        self._started = False
        self._over = False  # the process has ended the link (or is gone)

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def progressed(self) -> bool:
        return self._progressed

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        conn = self._conn
        assert conn is not None
        try:
            fd = os.dup(conn.fileno())
        except OSError as exc:  # (out of descriptors)
            self._settle(exc)
            return
        self._process.send(Relay(self.link, self._hello_limit, self._timeout), fd, self)

    def abort(self) -> None:
        """Shut the connection (whichever process holds it, the socket ends) and settle its hello here and now:
        the front keeps nothing of an evicted or late connection while the relay process catches up."""
        self._aborted = True
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.shutdown(socket.SHUT_RDWR)
        self._process.send(Abort(self.link), None, None)
        self._settle(EOFError("shut: its hello's deadline passed, or it was evicted"))

    def decide(self, frames: list[bytes], worker: socket.socket | None, tenant: str = "") -> None:
        fd = worker.detach() if worker is not None else None  # (sent, then closed here)
        self._drop_conn()
        if self._over:  # (it stopped waiting for the verdict: nothing is relayed, the place given back here)
            if fd is not None:
                os.close(fd)
            self.ended()
        elif not self._process.send(Verdict(self.link, tuple(frames), tenant), fd, None):
            self.ended()  # (the process is gone: nothing is relayed)

    # -- told by the process (on the front's loop) ---------------------------------------------------------

    def progress(self, handshake: bool) -> None:
        self._started = True
        self._progressed = self._progressed or handshake

    def _settle(self, outcome: Hello | BaseException) -> None:
        self._drop_conn()
        if not self.hello.done():
            if isinstance(outcome, BaseException):
                self.hello.set_exception(outcome)
            else:
                self.hello.set_result(outcome)

    def read(self, message: HelloRead) -> None:
        self._settle((message.frame, message.names, message.issued))

    def failed(self, failure: Failure, why: str) -> None:
        self._started = False  # (a failed handshake waits out its failure delay: a newcomer may take its place)
        self._settle(_FAILURES[failure](why))

    def ended(self) -> None:
        """The relay is over (or never began): the link's place is given back, once."""
        self._over = True
        self._drop_conn()
        if not self.hello.done():
            self.hello.set_exception(EOFError("the TLS relay process ended"))
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()

    def _drop_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


_FAILURES: Final[dict[str, Callable[[str], BaseException]]] = {
    "handshake": HandshakeFailed, "cut-short": HelloCutShort, "timeout": TimeoutError, "closed": EOFError,
    "error": OSError,
}


class _Process:
    """One relay process as the front holds it: its channel (on the front's loop) and its links."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_gone: Callable[[_Process], None]) -> None:
        self.loop = loop
        self.process: subprocess.Popen[bytes] | None = None
        self.channel: ChildChannel | None = None
        self.links: dict[int, HelperRelay] = {}
        # Links handed over whose hello it has not yet reported: what it owes. Past MAX_PENDING it is given no more
        # (an anonymous flood of connections must not outrun it: each would wait in its channel and its threads).
        self.pending: set[int] = set()
        self.ready: asyncio.Future[None] = loop.create_future()  # (done at its Ready, or when it is gone)
        self.started = False
        self._on_gone = on_gone

    def start(self, material: Serve) -> None:
        memfd = os.memfd_create("gpubroker-tls", os.MFD_CLOEXEC)
        try:
            os.write(memfd, encode(material))
            os.lseek(memfd, 0, os.SEEK_SET)
            self.process, front = start_child(__name__, ["--material", str(memfd)], (memfd,),
                                              send_buffer=MAX_RELAY_MESSAGE * 2)
        finally:
            os.close(memfd)
        self.channel = ChildChannel(front, self.loop, f"TLS relay process {self.process.pid}", self._read, self.gone)

    @property
    def alive(self) -> bool:
        return self.channel is not None and self.started

    def send(self, message: Relay | Abort | Verdict, fd: int | None, link: HelperRelay | None) -> bool:
        """Send ``message`` (with ``fd``, closed here once sent); ``link``: a new link of this process. False
        (``fd`` closed) when the process is gone."""
        if self.channel is None:
            if fd is not None:
                os.close(fd)
            if link is not None:
                link.ended()
            return False
        if link is not None:
            self.links[link.link] = link
            self.pending.add(link.link)
        self.channel.send(encode(message), fd)
        return True

    def _read(self) -> None:
        for _ in range(64):
            got = self.channel.receive(MAX_RELAY_MESSAGE) if self.channel is not None else None
            if got is None:
                return
            payload, fds, _ = got
            for fd in fds:  # (it sends none: any is closed)
                os.close(fd)
            if not payload:
                self.gone("it ended")
                return
            try:
                message = decode_from_relay(payload)
            except ValueError as exc:
                log.error("TLS relay process: a message that is not one (%s): ignored", str(exc)[:200])
                continue
            if isinstance(message, Ready):
                self.started = True
                if not self.ready.done():
                    self.ready.set_result(None)
                continue
            link = self.links.get(message.link)
            if link is None:
                continue
            if isinstance(message, Progressed):
                link.progress(message.progressed)
                continue
            self.pending.discard(message.link)  # (its hello reported, or the link over)
            if isinstance(message, HelloRead):
                link.read(message)
            elif isinstance(message, HelloFailed):
                link.failed(message.failure, message.why)
            else:
                del self.links[message.link]
                link.ended()

    def gone(self, why: str, stopping: bool = False) -> None:
        """The process ended or cannot be spoken to (or the broker stops): its links end, and the process is
        killed."""
        channel, self.channel = self.channel, None
        if channel is None:
            return
        channel.close()
        if not self.ready.done():
            self.ready.set_result(None)
        if self.started:
            (log.info if stopping else log.warning)("TLS relay process %s: %s; its %d links end", self.pid, why,
                                                    len(self.links))
        links, self.links = self.links, {}
        self.pending.clear()
        for link in links.values():
            link.ended()
        self.kill()
        self._on_gone(self)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def kill(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()


class TlsRelays:
    """The front's TLS relay processes (`start`ed on its loop, `close`d when it stops): `relay` hands a TLS
    link to the one relaying fewest, or says there is none (the front relays it in a thread then)."""

    def __init__(self, material: Serve, count: int | None = None) -> None:
        self.material = material
        self.count = count if count is not None else tls_relay_processes()
        self.processes: list[_Process] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_link = 0
        self._last_start = 0.0
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self) -> None:
        """Start the processes and wait until they serve (those that do not in time are killed)."""
        self._loop = asyncio.get_running_loop()
        await asyncio.gather(*(self._start_one() for _ in range(self.count)))
        if self.processes:
            log.info("TCP links' TLS relayed by %d processes (pids %s)", len(self.processes),
                     ", ".join(str(p.pid) for p in self.processes))

    async def _start_one(self) -> None:
        assert self._loop is not None
        self._last_start = time.monotonic()
        process = _Process(self._loop, self._gone)
        try:
            process.start(self.material)
        except OSError as exc:
            log.error("cannot start a TLS relay process (%s): TLS links are relayed in the front", exc.strerror)
            return
        self.processes.append(process)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(process.ready), START_TIMEOUT)
        if not process.started:
            process.gone(f"it did not start within {START_TIMEOUT:g} s")
            log.error("a TLS relay process did not start: TLS links are relayed in the front meanwhile")

    def _gone(self, process: _Process) -> None:
        """A process ended: reaped, and another started in its place (at most one a RESTART_SECONDS)."""
        with contextlib.suppress(ValueError):
            self.processes.remove(process)
        loop = self._loop
        if loop is None:
            return
        if process.process is not None:
            loop.run_in_executor(None, process.process.wait)  # (off the loop: a killed process exits at once)
        if not self._closed and process.started:
            wait = max(0.0, self._last_start + RESTART_SECONDS - time.monotonic())
            loop.call_later(wait, self._restart)

    def _restart(self) -> None:
        if self._closed or self._loop is None or len(self.processes) >= self.count:
            return
        task = self._loop.create_task(self._start_one())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    def relay(self, conn: socket.socket, hello_limit: int, timeout: float) -> HelperRelay | None:
        """A link for ``conn`` in the process relaying fewest links (not yet `start`ed); None when no process
        serves, or for hellos larger than a message carries."""
        if self._loop is None or self._closed or hello_limit > MAX_RELAYED_HELLO:
            return None
        alive = [p for p in self.processes if p.alive and len(p.pending) < MAX_PENDING]
        if not alive:  # (none serves, or all are behind: a thread of the front relays it, as before them)
            return None
        process = min(alive, key=lambda p: len(p.links))
        link = HelperRelay(process, self._next_link, conn, hello_limit, timeout, self._loop)
        self._next_link += 1
        return link

    async def close(self) -> None:
        """End the processes (their links end with them) and wait for them."""
        self._closed = True
        for task in list(self._starting):
            task.cancel()
        processes = list(self.processes)
        for process in processes:
            process.gone("the broker stops", stopping=True)
        for process in processes:
            if process.process is not None:
                await asyncio.to_thread(process.process.wait)


# -- the relay process -------------------------------------------------------------------------------------------


class _RelayProcess:
    """The process's side: a thread a link (``TcpRelay``), told and heard over the channel."""

    def __init__(self, channel: socket.socket, context: ssl.SSLContext, spin: float = 0.0) -> None:
        self.channel = channel
        self.context = context
        self.spin = spin  # seconds a relay polls after moving bytes (0: never), within its tenant's share
        self._shares: weakref.WeakValueDictionary[str, SpinShare] = weakref.WeakValueDictionary()  # by tenant
        self._shares_lock = threading.Lock()
        self.links: dict[int, TcpRelay] = {}
        self._send_lock = threading.Lock()
        self._links_lock = threading.Lock()
        self._stop_r, self._stop_w = os.pipe()

    def send(self, message: Ready | Progressed | HelloRead | HelloFailed | Ended) -> None:
        with self._send_lock, contextlib.suppress(OSError):  # (the front is gone: the process ends anyway)
            self.channel.send(encode(message))

    def spin_share(self, tenant: str) -> SpinShare:
        """What the tenant's links in this process may poll, together (held by each while it relays)."""
        with self._shares_lock:
            share = self._shares.get(tenant)
            if share is None:
                share = self._shares[tenant] = SpinShare(self.spin)
            return share

    def run(self) -> None:
        self.send(Ready(os.getpid()))
        while True:
            try:
                payload, ancdata, _, _ = self.channel.recvmsg(MAX_RELAY_MESSAGE, FD_SPACE)
            except InterruptedError:
                continue
            except MemoryError:  # (the process's memory limit, for now: the message waits in the socket)
                time.sleep(0.05)
                continue
            except OSError:
                payload, ancdata = b"", []
            fds = take_fds(ancdata)
            if not payload:  # the front ended: every relay ends (they poll the stop pipe), and so does this
                os.write(self._stop_w, b"x")
                return
            message = decode_to_relay(payload)
            fd = fds.pop() if fds else None
            for extra in fds:
                os.close(extra)
            sock: socket.socket | None = None
            try:
                sock = socket.socket(fileno=fd) if fd is not None else None  # (its descriptor is the socket's now)
                self._handle(message, sock)
            except Exception as exc:  # (this link fails, not the process and every other link in it)
                if sock is not None:
                    sock.close()
                elif fd is not None:
                    os.close(fd)
                if isinstance(message, Relay):
                    self._failed(message.link, type(exc).__name__)

    def _failed(self, number: int, why: str) -> None:
        """Link ``number`` has no hello, nor relay: forgotten here, and the front told (its Ended follows)."""
        with self._links_lock:
            self.links.pop(number, None)
        self.send(HelloFailed(number, "error", why))
        self.send(Ended(number))

    def _handle(self, message: Relay | Abort | Verdict, sock: socket.socket | None) -> None:
        """One message of the front, with the socket it brought (taken here, or closed by the caller on an
        error)."""
        if isinstance(message, Relay):
            if sock is None:
                self._failed(message.link, "no connection came with the link")
                return
            self._relay(message, sock)
            return
        with self._links_lock:
            link = self.links.get(message.link)
        if isinstance(message, Abort):
            if link is not None:
                link.abort()
        elif link is None:  # (a verdict for a link that ended: its worker's end is closed)
            if sock is not None:
                sock.close()
        else:
            link.decide(list(message.frames), sock, message.tenant)

    def _relay(self, message: Relay, conn: socket.socket) -> None:
        number = message.link

        def report(outcome: Hello | BaseException) -> None:
            if isinstance(outcome, BaseException):
                failure, why = _failure(outcome)
                self.send(HelloFailed(number, failure, why[:512]))
            else:
                frame, names, issued = outcome
                if len(names) > MAX_NAMES or any(len(name) > MAX_NAME for name in names):
                    self.send(HelloFailed(number, "handshake", f"the client certificate has more than {MAX_NAMES} "
                                          f"names or one longer than {MAX_NAME} characters"))
                else:
                    self.send(HelloRead(number, frame, names, issued))

        def ended() -> None:
            with self._links_lock:
                self.links.pop(number, None)
            self.send(Ended(number))

        link = TcpRelay(conn, self.context, message.hello_limit, message.timeout, self._stop_r, report,
                        on_progress=lambda done: self.send(Progressed(number, done)),
                        spin_share=self.spin_share if self.spin else None)
        link.on_end = ended
        with self._links_lock:
            self.links[number] = link
        try:
            threading.Thread(target=link.run, name="gpubroker-link", daemon=True).start()
        except RuntimeError:  # (no thread to be had: the host's task limit) this link fails, not the process
            link.never_ran()
            self._failed(number, "no thread to relay it")


def _failure(exc: BaseException) -> tuple[Failure, str]:
    """How a hello failed, and why in words of ours or OpenSSL's (never text of the peer's)."""
    if isinstance(exc, HandshakeFailed):
        return "handshake", str(exc)
    if isinstance(exc, HelloCutShort):
        return "cut-short", str(exc)
    if isinstance(exc, TimeoutError):
        return "timeout", "no hello in time"
    if isinstance(exc, EOFError):
        return "closed", str(exc)
    return "error", type(exc).__name__


def main(argv: list[str]) -> None:
    options = dict(zip(argv[::2], argv[1::2], strict=False))
    die_with_parent(int(options["--parent"]))
    with open(int(options["--material"]), "rb") as material:
        context = server_context(decode_serve(material.read()))
    channel = socket.socket(fileno=int(options["--channel"]))
    # Its relays poll for a link's next bytes a while before they block (a TCP link's spin, wire/ring.py): the
    # process is the front's own, off its event loop (the front's own relay threads never spin).
    _RelayProcess(channel, context, link_spin_us(relayed=True) * 1e-6).run()


if __name__ == "__main__":
    main(sys.argv[1:])
