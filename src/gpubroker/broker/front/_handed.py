"""Links handed to a worker: the front keeps a descriptor of each, and shuts it when the worker ends.

A worker runs its tenant's code, which can pass the descriptors the worker holds (its end of the session's other
links, of other sessions' links of the tenant) over a link to a client that accepts descriptors. A copy passed so
outlives the worker: a token's holder who took one before a rotation would keep, after the rotation retired the
worker, the worker's end of the other clients' links, to read what they send and to answer in the worker's name.
Shutting a socket acts on the socket, not on one descriptor of it: the front's copy, shut when the worker ends
(retired, crashed or stopped), ends every copy of it, wherever it went.

The front lets go of its copy once the link ends on its own: its client closed, or the worker shut it (the worker
shuts a link's socket before it closes it, since the front's copy would otherwise keep the client's end open). The
kernel reports the hang-up to one epoll set that the front's event loop watches, without a byte being read, and the
link's place in the front's counts is given back then: a worker that keeps links open costs the front a descriptor
each, up to the counts' caps (``max_links_per_tenant``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
from collections.abc import Callable
from dataclasses import dataclass

from gpubroker.broker.front.workers import WorkerClient

__all__ = ["HandedLinks"]

# A hang-up either way: the client closed (or shut its sending side), or both sides were shut.
_ENDED = select.EPOLLRDHUP | select.EPOLLHUP


@dataclass
class _Handed:
    sock: socket.socket
    worker: WorkerClient  # the worker that holds the link
    release: Callable[[], None]  # gives the link's place in the front's counts back


class HandedLinks:
    """The front's copies of the links its workers hold, by descriptor."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._held: dict[int, _Handed] = {}
        self._by_worker: dict[WorkerClient, set[int]] = {}
        self._watching = False

    def keep(self, worker: WorkerClient, fd: int, release: Callable[[], None]) -> None:
        """Keep ``fd`` (a descriptor of a link ``worker`` now serves, this object's to close) until the link ends
        or the worker does; ``release`` is called once then."""
        if worker.death is not None:  # (it died while the link was being handed over)
            self._end(_Handed(socket.socket(fileno=fd), worker, release))
            return
        try:
            self._epoll.register(fd, _ENDED)
        except OSError:  # (the host's epoll watches used up): the link goes on without the front's copy
            os.close(fd)
            release()
            return
        if not self._watching:
            asyncio.get_running_loop().add_reader(self._epoll.fileno(), self._hung_up)
            self._watching = True
        self._held[fd] = _Handed(socket.socket(fileno=fd), worker, release)
        links = self._by_worker.get(worker)
        if links is None:
            links = self._by_worker[worker] = set()
            worker.on_death.append(lambda: self._worker_ended(worker))
        links.add(fd)

    def _hung_up(self) -> None:
        for fd, _ in self._epoll.poll(0):
            self._let_go(fd, shut=False)

    def _worker_ended(self, worker: WorkerClient) -> None:
        for fd in self._by_worker.pop(worker, set()):
            self._let_go(fd, shut=True)

    def _let_go(self, fd: int, *, shut: bool) -> None:
        handed = self._held.pop(fd, None)
        if handed is None:
            return
        with contextlib.suppress(OSError):
            self._epoll.unregister(fd)
        links = self._by_worker.get(handed.worker)
        if links is not None:
            links.discard(fd)
        if shut:
            self._end(handed)
        else:
            handed.sock.close()
            handed.release()

    @staticmethod
    def _end(handed: _Handed) -> None:
        with contextlib.suppress(OSError):
            handed.sock.shutdown(socket.SHUT_RDWR)
        handed.sock.close()
        handed.release()

    def close(self) -> None:
        """End every link still held (the broker stops: its workers go with it)."""
        for fd in list(self._held):
            self._let_go(fd, shut=True)
        if self._watching:
            with contextlib.suppress(RuntimeError):  # (the loop already closed)
                asyncio.get_running_loop().remove_reader(self._epoll.fileno())
            self._watching = False
        self._epoll.close()
