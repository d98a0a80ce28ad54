"""The front's channel to a process of its own (the acceptor process, the TLS relay processes): a Unix
SOCK_SEQPACKET socketpair carrying one typed message a packet (its boundaries kept by the socket), with at most
one descriptor attached (SCM_RIGHTS). The front's end is served on its event loop: what the socket does not take
at once waits, in order, until it does."""

from __future__ import annotations

import array
import asyncio
import collections
import ctypes
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Final

__all__ = ["FD_SPACE", "ChildChannel", "die_with_parent", "start_child", "take_fds"]

log = logging.getLogger("gpubroker.server")

FD_SPACE: Final = socket.CMSG_SPACE(array.array("i", [0]).itemsize)  # ancillary room for one descriptor
_PR_SET_PDEATHSIG: Final = 1


class ChildChannel:
    """The front's end of a process's channel, on the front's loop: ``on_read`` is called when a message may be
    read (``sock.recvmsg``); ``on_broken`` once, with why, when a message cannot be written (the process is gone).
    ``name`` names the process in the log."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, name: str,
                 on_read: Callable[[], None], on_broken: Callable[[str], None]) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.name = name
        self._loop = loop
        self._on_broken = on_broken
        self._unsent: collections.deque[tuple[bytes, int | None]] = collections.deque()
        self._writing = False
        self._closed = False
        loop.add_reader(sock.fileno(), on_read)

    def send(self, payload: bytes, fd: int | None) -> None:
        """Send a message (with ``fd``, which is then closed here) now, or as soon as the socket takes it."""
        if self._closed:
            if fd is not None:
                os.close(fd)
            return
        self._unsent.append((payload, fd))
        self._flush()

    def _flush(self) -> None:
        while self._unsent and not self._closed:
            payload, fd = self._unsent[0]
            try:
                if fd is None:
                    self.sock.send(payload)
                else:
                    self.sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            except (BlockingIOError, InterruptedError):
                if not self._writing:
                    self._writing = True
                    self._loop.add_writer(self.sock.fileno(), self._flush)
                return
            except OSError as exc:
                if exc.errno != errno.EMSGSIZE:
                    self._on_broken(f"cannot write to it ({exc.strerror})")
                    return
                # (a message past the socket's buffer: that message alone is lost, not the process)
                log.error("%s: a message of %d bytes is too large for its channel: dropped", self.name,
                          len(payload))
            self._unsent.popleft()
            if fd is not None:
                os.close(fd)
        if self._writing and not self._closed:
            self._writing = False
            self._loop.remove_writer(self.sock.fileno())

    def receive(self, limit: int) -> tuple[bytes, list[int], bool] | None:
        """The next message, the descriptors it brought (the caller's to close) and whether some were cut off
        (MSG_CTRUNC); an empty message at the process's end. None: nothing to read now, or the channel failed
        (``on_broken`` called)."""
        if self._closed:
            return None
        try:
            payload, ancdata, flags, _ = self.sock.recvmsg(limit, FD_SPACE)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            self._on_broken(f"cannot read from it ({exc.strerror})")
            return None
        return payload, take_fds(ancdata), bool(flags & socket.MSG_CTRUNC)

    def close(self) -> None:
        """Stop serving the channel and close it; descriptors of unsent messages are closed."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self.sock.fileno())
        if self._writing:
            self._loop.remove_writer(self.sock.fileno())
        self.sock.close()
        for _, fd in self._unsent:
            if fd is not None:
                os.close(fd)
        self._unsent.clear()


def start_child(module: str, args: list[str], pass_fds: tuple[int, ...] = (),
                send_buffer: int = 0) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start ``python -m module --channel FD --parent PID *args`` and give the front's end of its channel (not yet
    served: wrap it in a ChildChannel on the loop). subprocess (vfork + exec), as the workers are started: never a
    fork of a process full of threads. Its stdout and stderr are the front's: it writes nothing but a traceback on
    a bug. ``pass_fds``: further descriptors it inherits; ``send_buffer``: each end's SO_SNDBUF (0: the default),
    as large as the largest message."""
    front, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        if send_buffer:
            for end in (front, child):
                end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        argv = [sys.executable, "-s", "-P", "-m", module, "--channel", str(child.fileno()), "--parent",
                str(os.getpid()), *args]
        process = subprocess.Popen(argv, pass_fds=[child.fileno(), *pass_fds], stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    except BaseException:
        front.close()
        raise
    finally:
        child.close()
    return process, front


def take_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors a message brought (SCM_RIGHTS), now the receiver's to close."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            found = array.array("i")
            found.frombytes(data[:len(data) - len(data) % found.itemsize])
            fds.extend(found)
    return fds


def die_with_parent(parent: int) -> None:
    """In the child: be killed when the front (``parent``) dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
               ctypes.c_ulong(0), ctypes.c_ulong(0))
    if os.getppid() != parent:  # (the front died before the prctl took)
        raise SystemExit(0)
