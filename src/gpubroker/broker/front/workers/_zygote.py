"""The front's side of the workers' zygote (``broker/zygote``): start it, have it fork launchers, see them end.

The zygote loads a worker's code once; each sandboxed worker then starts as a fork of it (the launcher) that
builds the sandbox and runs the worker without a new interpreter. To the worker's client a forked launcher is what
the Popen of ``python -m gpubroker.broker.sandbox`` was (``LauncherProcess``): a pid, its output pipes, a kill (by
pidfd: the launcher is the zygote's child, so its pid could be another process's once it is reaped), and its exit
code, which only its parent can read and so the zygote reports.

The zygote starts with the front, in the background; a worker start that comes while it loads waits for it (its
load is what an exec'd worker would do anyway). Should it fail to start, or die, or a worker it forked fail to
start where an exec'd one then starts, workers start as before (exec'd launchers) and the log says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
from collections import deque
from typing import IO, Protocol

from gpubroker.broker.sandbox import python_argv
from gpubroker.wire.zygote import (
    MAX_ZYGOTE_MESSAGE,
    Exited,
    Fork,
    Forked,
    ForkFailed,
    Launch,
    Ready,
    decode_from_zygote,
    encode,
)

__all__ = ["ForkRefused", "LauncherProcess", "Zygote", "ZygoteProcess"]

log = logging.getLogger("gpubroker.workers")

# How long the zygote may take to load (a CUDA host's CuPy import on a busy machine) before workers start without.
READY_TIMEOUT = 60.0
# How long a Fork may wait for its answer: the zygote forks at once; past this it is taken for stuck.
FORK_TIMEOUT = 10.0


class ForkRefused(OSError):
    """The zygote's fork of one launcher failed (the system refused it: a task limit, memory); the zygote serves
    on, and that start is tried exec'd."""


class LauncherProcess(Protocol):
    """What a worker's client uses of the process it started: a Popen, or a launcher the zygote forked."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdout(self) -> IO[bytes] | None: ...

    @property
    def stderr(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ZygoteProcess:
    """A launcher the zygote forked (``LauncherProcess``). Its exit code comes from the zygote (``exited``)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout: IO[bytes] | None = None
        self.stderr: IO[bytes] | None = None
        self._pidfd: int | None = pidfd
        self.orphaned = False  # it ended because the zygote did (its parent-death signal), not by its own doing
        self._watched_by: asyncio.AbstractEventLoop | None = None  # (its pidfd, once the zygote is gone)
        self._ended = threading.Event()  # (wait() runs in a thread; the exit is learnt on the front's loop)

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None and self._pidfd is not None:
            with contextlib.suppress(OSError):  # (already ended, not yet reported)
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"launcher {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def ended_when_gone(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """The zygote died: no exit code will come. Killed by its parent-death signal, the launcher ends now; it is
        taken for ended (-SIGKILL) once its pidfd turns readable."""
        pidfd = self._pidfd
        if self.returncode is not None or pidfd is None:
            return
        if loop is None or loop.is_closed():
            self.exited(-signal.SIGKILL)
            return
        self._watched_by = loop
        loop.add_reader(pidfd, self.exited, -signal.SIGKILL)

    def exited(self, code: int) -> None:
        if self.returncode is not None:
            return
        self.returncode = code
        if self._pidfd is not None:
            if self._watched_by is not None:
                self._watched_by.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self._ended.set()


class Zygote:
    """The zygote process of one broker (one backend): ``start`` it, ``spawn`` launchers, ``stop`` it."""

    def __init__(self, backend: str, env: dict[str, str]) -> None:
        self.backend = backend
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None
        self.failed: str | None = None  # why workers start without it (None: it serves, or is loading)
        self._control: socket.socket | None = None
        self._ready: asyncio.Future[None] | None = None
        self._forks: deque[asyncio.Future[ZygoteProcess]] = deque()
        self._launchers: dict[int, ZygoteProcess] = {}
        self._lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Start the zygote (on the front's loop); it loads in the background."""
        self._loop = loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        front, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # Its stderr is the front's (the broker's log: only the zygote's own lines, never a worker's); a session
            # of its own, as every launcher's: a terminal's ^C is the front's to handle. It dies with the front.
            self.process = subprocess.Popen(
                [*python_argv(), "gpubroker.broker.zygote", "--backend", self.backend, "--fd", str(child.fileno())],
                env=self.env, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)
        except OSError as exc:
            front.close()
            self.give_up(f"it could not be started: {exc}")
            return
        finally:
            child.close()
        front.setblocking(False)
        self._control = front
        loop.add_reader(front.fileno(), self._readable)
        loop.call_later(READY_TIMEOUT, self._late)

    async def usable(self) -> bool:
        """Whether workers start from the zygote now, waiting while it loads."""
        if self.failed is not None or self._ready is None:
            return False
        with contextlib.suppress(asyncio.CancelledError):  # (cancelled by give_up: it failed meanwhile)
            await asyncio.shield(self._ready)
        return self.failed is None

    async def spawn(self, argv: list[str], pass_fds: list[int]) -> ZygoteProcess:
        """Fork a launcher that runs ``argv`` (the sandbox launcher's command line) with ``pass_fds`` at their
        numbers, its stdout and stderr on new pipes (the process's ``stdout``, ``stderr``). OSError when the
        zygote cannot (it is then given up: the caller starts the launcher itself); ForkRefused (an OSError) when
        the system refused this one fork (the zygote serves on)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pipes: list[int] = []
        try:
            async with self._lock:  # (Forked answers the Forks in order)
                if self._control is None or self._loop is None:
                    raise OSError(f"the workers' zygote is not running ({self.failed})")
                answer: asyncio.Future[ZygoteProcess] = self._loop.create_future()
                self._forks.append(answer)
                try:
                    socket.send_fds(self._control, [encode(Fork())], [theirs.fileno()])
                except BlockingIOError:  # (it reads nothing: stuck, but its launchers may be serving)
                    self._forks.remove(answer)
                    self.give_up("it reads no more of the front's messages")
                    raise
                except OSError as exc:
                    self._forks.remove(answer)
                    self._dead(f"a fork could not be asked for: {exc}")
                    raise
                theirs.close()
                try:
                    process = await asyncio.wait_for(asyncio.shield(answer), FORK_TIMEOUT)
                except TimeoutError:
                    self.give_up(f"a fork took more than {FORK_TIMEOUT:g} s")
                    raise OSError("the workers' zygote did not fork") from None
                except asyncio.CancelledError:
                    if answer.cancelled():  # (given up meanwhile)
                        raise OSError(f"the workers' zygote ended ({self.failed})") from None
                    # The zygote still answers this Fork, in its turn, to nobody: a ForkFailed set on a pending
                    # answer nobody reads would be logged as an exception never retrieved.
                    answer.cancel()
                    raise
            out_read, out_write = os.pipe()
            pipes += [out_read, out_write]
            err_read, err_write = os.pipe()
            pipes += [err_read, err_write]
            try:
                socket.send_fds(mine, [encode(Launch(argv, list(pass_fds)))], [out_write, err_write, *pass_fds])
            except OSError:
                process.kill()
                raise
            process.stdout = open(out_read, "rb")  # noqa: SIM115  (the output reader's transport owns it)
            pipes.remove(out_read)
            process.stderr = open(err_read, "rb")  # noqa: SIM115
            pipes.remove(err_read)
            return process
        finally:
            mine.close()
            theirs.close()
            for fd in pipes:
                with contextlib.suppress(OSError):
                    os.close(fd)

    async def stop(self, timeout: float = 5.0) -> None:
        """End the zygote (its launchers end with it: their parent-death signal)."""
        self.give_up("the broker stops", quiet=True)
        self._close()
        if self.process is not None and self.process.poll() is None:
            try:
                await asyncio.to_thread(self.process.wait, timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                await asyncio.to_thread(self.process.wait)

    # -- its messages (on the front's loop) -------------------------------------------------------------------------

    def _readable(self) -> None:
        assert self._control is not None
        try:
            message, fds, _flags, _addr = socket.recv_fds(self._control, MAX_ZYGOTE_MESSAGE, 1)
        except BlockingIOError:
            return
        except OSError as exc:
            self._dead(f"its socket failed: {exc}")
            return
        if not message:
            code = self.process.poll() if self.process is not None else None
            self._dead(f"it exited ({code})" if code is not None else "it closed its socket")
            return
        try:
            reply = decode_from_zygote(message)
            if isinstance(reply, Forked) != bool(fds):
                raise ValueError(f"{type(reply).__name__} with {len(fds)} descriptors")
        except ValueError as exc:
            for fd in fds:
                os.close(fd)
            self._dead(f"it sent what is no message of its ({exc})")
            return
        if isinstance(reply, Ready):
            assert self._ready is not None
            if not self._ready.done():
                self._ready.set_result(None)
                log.info("workers start from the zygote (pid %d, loaded in %.2f s)", reply.pid, reply.seconds)
        elif isinstance(reply, Forked):
            if not self._forks:  # (a fork given up on, answered late: nobody runs it)
                late = self._launchers[reply.pid] = ZygoteProcess(reply.pid, fds[0])
                late.kill()
                return
            # Registered here, before any Exited of it can be read (the zygote reports the fork first).
            launcher = self._launchers[reply.pid] = ZygoteProcess(reply.pid, fds[0])
            answer = self._forks.popleft()
            if not answer.done():
                answer.set_result(launcher)
        elif isinstance(reply, ForkFailed):
            if self._forks:
                answer = self._forks.popleft()
                if not answer.done():
                    answer.set_exception(ForkRefused(f"the workers' zygote could not fork a launcher: {reply.reason}"))
        elif isinstance(reply, Exited):
            ended = self._launchers.pop(reply.pid, None)
            if ended is not None:
                ended.exited(reply.code)

    def _late(self) -> None:
        if self._ready is not None and not self._ready.done() and self.failed is None:
            self._dead(f"it was not ready within {READY_TIMEOUT:g} s")

    def give_up(self, why: str, quiet: bool = False) -> None:
        """Start workers without the zygote from now on (``why``, for the log). It lives on while launchers it
        forked run (they die with it), until ``stop``."""
        if self.failed is not None:
            return
        self.failed = why
        if not quiet:
            log.warning("workers start without the zygote from now on: %s", why)
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
        for answer in self._forks:
            answer.cancel()
        self._forks.clear()

    def _dead(self, why: str) -> None:
        """The zygote is gone or cannot be trusted: so are its launchers."""
        self.give_up(why)
        self._close()

    def _close(self) -> None:
        if self._control is not None:
            if self._loop is not None:
                with contextlib.suppress(ValueError, RuntimeError):
                    self._loop.remove_reader(self._control.fileno())
            self._control.close()
            self._control = None
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.kill()
        # Its launchers die with it (their parent-death signal), and nobody reports their exits: each is taken for
        # ended once its pidfd says so (another process, the host's init, reaps it).
        for launcher in self._launchers.values():
            launcher.orphaned = launcher.returncode is None
            launcher.ended_when_gone(self._loop)
        self._launchers.clear()
