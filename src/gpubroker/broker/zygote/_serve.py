"""The zygote: load a worker's code once, then fork a sandbox launcher for each worker the front starts.

A sandboxed worker's start was two fresh interpreters in a row, the launcher and then (exec'd in the sandbox) the
worker, whose imports (NumPy, CuPy or pyopencl, the worker's own modules) took most of a tenant's first session.
This process, started by the front with the launcher's environment (the operator's, nothing of a tenant's), imports
all of that once (``worker.preload``), opening nothing: no device (CUDA forbids a fork after its initialization), no
file, no thread (the launcher must be single-threaded to unshare a user namespace, so the BLAS thread pools are
held to one thread). Then, for each ``Fork`` of the front, it forks a launcher that:

1. dies with the zygote (which dies with the front), leads a session of its own, and reads its ``Launch`` on the
   socket the front gave it (the zygote never sees a tenant's spec, token-derived cache key or descriptors, so no
   worker inherits another's from the zygote's memory);
2. puts its descriptors where the front's argv says (stdout and stderr are the front's pipes for this worker),
   takes the launcher's command line, and runs the launcher (``sandbox.run_launcher``) exactly as ``python -m
   gpubroker.broker.sandbox`` would: every layer of the sandbox is built the same way;
3. whose child, PID 1 in the sandbox, runs the worker in its own process (``worker.run``) instead of exec'ing a
   new interpreter: the command line and environment an exec would have given it, its random generators seeded
   afresh.

What the forked workers share with each other that exec'd ones did not: the zygote's address-space layout (its
libraries', heap's and stack's places, the stack canary). A worker can neither read nor write another's memory
(PID namespaces, no ptrace, seccomp), nor send it anything but through the front, so a layout known to one tenant
gains it nothing against another. What each costs the host: the zygote's pages stay shared (and charged to the
broker's cgroup) until a worker writes them.

The zygote reaps its launchers and reports each exit (``Exited``), since only a parent can read an exit status;
the front signals a launcher through the pidfd the zygote sent with ``Forked``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import gc
import os
import random
import select
import signal
import socket
import sys
import time
import traceback
from typing import NoReturn

from gpubroker.broker.sandbox import EXIT_SETUP_FAILED as _EXIT_SETUP_FAILED
from gpubroker.broker.sandbox import python_argv, run_launcher, set_command_line, set_dumpable
from gpubroker.broker.worker import preload, run
from gpubroker.wire.zygote import (
    MAX_LAUNCH_MESSAGE,
    MAX_ZYGOTE_MESSAGE,
    Exited,
    Forked,
    ForkFailed,
    Ready,
    decode_launch,
    decode_to_zygote,
    encode,
)

__all__ = ["main"]

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
EXIT_SETUP_FAILED: int = _EXIT_SETUP_FAILED
_WORKER_MODULE = "gpubroker.broker.worker"
_imported_environment: dict[str, str] = {}
ZYGOTE_OOM_SCORE_ADJ = -900
_oom_score_adj: str | None = None  # the front's, which each launcher takes back
_LAUNCHER_MODULE = "gpubroker.broker.sandbox"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpubroker-zygote")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--fd", type=int, required=True, help="the SOCK_SEQPACKET socket to the front")
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.fd)
    if not _dies_with(os.getppid()):  # (the front)
        return 1
    set_dumpable(False)  # (no same-uid process reads its memory, which every worker gets)
    _protect_from_oom()
    started = time.monotonic()
    before = dict(os.environ)
    preload(args.backend)
    # What the imports set in the environment (pyopencl: PYOPENCL_HOME) is the worker's process's own, not its
    # exec's: each worker gets it back at its start, and the launchers start from the environment as it was.
    _imported_environment.update({k: v for k, v in os.environ.items() if before.get(k) != v})
    os.environ.clear()
    os.environ.update(before)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        print(f"gpubroker zygote: {threads} threads after loading the worker's code; a launcher forked from it "
              "could not unshare its user namespace: workers start without the zygote", file=sys.stderr, flush=True)
        return 3
    # What exists now lives as long as the zygote: out of the collector's sight, so a launcher's or worker's
    # collections do not write (and so copy) every page of it.
    gc.freeze()
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)
    _send(control, encode(Ready(os.getpid(), round(time.monotonic() - started, 3))))
    poller = select.poll()
    poller.register(control, select.POLLIN)
    poller.register(wake_read, select.POLLIN)
    while True:
        for fd, _events in poller.poll():
            if fd == wake_read:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
                _reap(control)
            elif not _serve_one(control, (wake_read, wake_write)):
                return 0


def _dies_with(parent: int) -> bool:
    """Be killed when ``parent`` ends (PR_SET_PDEATHSIG); False if it has ended already (before the signal was
    set: this process was handed to another parent)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return os.getppid() == parent


def _protect_from_oom() -> None:
    """Every sandboxed worker's launcher dies with the zygote (its parent-death signal): the OOM killer should pick
    a worker, whose memory is its tenant's, before it. Lowered where the broker may (root); each launcher takes the
    front's value back (raising needs no privilege), so the workers are chosen as before."""
    global _oom_score_adj
    try:
        with open("/proc/self/oom_score_adj") as f:
            own = f.read().strip()
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(ZYGOTE_OOM_SCORE_ADJ))
    except OSError:  # (not permitted: it stays as the front)
        return
    _oom_score_adj = own


def _unprotect_from_oom() -> None:
    if _oom_score_adj is not None:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(_oom_score_adj)


def _send(control: socket.socket, message: bytes, fds: list[int] | None = None) -> None:
    if fds:
        socket.send_fds(control, [message], fds)
    else:
        control.send(message)


def _serve_one(control: socket.socket, wake: tuple[int, int]) -> bool:
    """Answer one message of the front; False once the front has closed its end (the zygote then exits)."""
    message, fds, _flags, _addr = socket.recv_fds(control, MAX_ZYGOTE_MESSAGE, 1)
    if not message:
        return False
    try:
        decode_to_zygote(message)  # (a Fork: the only message there is)
        if len(fds) != 1:
            raise ValueError(f"a fork came with {len(fds)} descriptors, not 1")
        try:
            pid = _fork_launcher(fds[0], control, wake)
        except OSError as exc:
            # The system refused the fork (EAGAIN past the broker's task limit, ENOMEM): that one start fails, and
            # the zygote serves on. Were it to exit, every launcher it forked would die with it, and with them
            # every tenant's running worker.
            _send(control, encode(ForkFailed(f"fork: {exc.strerror or exc}"[:160])))
            return True
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:  # (its child, not reaped yet: the pid is still this launcher's)
            os.kill(pid, signal.SIGKILL)
            _send(control, encode(ForkFailed(f"pidfd_open: {exc.strerror or exc}"[:160])))
            return True
        try:
            _send(control, encode(Forked(pid)), [pidfd])
        finally:
            os.close(pidfd)
    finally:
        for fd in fds:
            os.close(fd)
    return True


def _reap(control: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(control, encode(Exited(pid, os.waitstatus_to_exitcode(status))))


def _fork_launcher(channel: int, control: socket.socket, wake: tuple[int, int]) -> int:
    zygote = os.getpid()
    pid = os.fork()
    if pid != 0:
        return pid
    code = EXIT_SETUP_FAILED
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wake:
            os.close(fd)
        control.close()
        code = _launcher(channel, zygote)
    except BaseException:  # (the launcher's own failure: said on its stderr, the front's pipe for this worker)
        with contextlib.suppress(Exception):
            traceback.print_exc()
            sys.stderr.flush()
    os._exit(code)


def _launcher(channel: int, zygote: int) -> int:
    """In the forked launcher: take the front's ``Launch`` and run it; the exit code (the worker's, mirrored)."""
    if not _dies_with(zygote):
        return EXIT_SETUP_FAILED
    # A session and process group of its own, as the front's Popen(start_new_session=True) gave the launcher.
    os.setsid()
    _unprotect_from_oom()
    with socket.socket(fileno=channel) as sock:
        message, fds, _flags, _addr = socket.recv_fds(sock, MAX_LAUNCH_MESSAGE, 18)
    if not message:
        return EXIT_SETUP_FAILED  # (the front gave up on this start)
    request = decode_launch(message)
    if len(fds) != 2 + len(request.fds):
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a launch came with {len(fds)} descriptors for {2 + len(request.fds)}")
    _place(fds, [1, 2, *request.fds])
    argv = request.argv
    if _LAUNCHER_MODULE not in argv:
        raise ValueError("a launch that is not the sandbox launcher's command line")
    try:
        set_command_line(argv)
    except OSError as exc:  # (said in one line; the front then starts this worker exec'd, and gives the zygote up)
        print(f"gpubroker sandbox: cannot build the worker's sandbox: {exc}", file=sys.stderr, flush=True)
        return EXIT_SETUP_FAILED
    return int(run_launcher(argv[argv.index(_LAUNCHER_MODULE) + 1:], _start_worker))


def _place(fds: list[int], targets: list[int]) -> None:
    """Give each received descriptor its number (``targets``, as the front numbered them for its argv), stdin
    /dev/null; close the received copies."""
    above = max([*targets, *fds]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    if null != 0:
        os.dup2(null, 0, inheritable=True)
        os.close(null)


def _start_worker(argv: list[str], env: dict[str, str]) -> NoReturn:
    """In the sandbox (the launcher's child, every layer in place): be the worker ``argv`` names, as an exec of it
    would have been; any other program is exec'd."""
    prefix = [*python_argv(), _WORKER_MODULE]
    if argv[:len(prefix)] != prefix:
        os.execve(argv[0], argv, env)
    os.environ.clear()
    os.environ.update({**env, **_imported_environment})
    sys.argv = [_WORKER_MODULE, *argv[len(prefix):]]
    # The zygote's generators were seeded once, for every worker: each worker's own now.
    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    run(argv[len(prefix):])
