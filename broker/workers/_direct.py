"""Direct links: a same-host client's device calls served by its worker, with no hop through the front.

The front authenticates a fast-path connection, then hands its socket to the tenant's worker, bound to one
session. The client names its objects by the handles the front gave it; the front told the worker those aliases
when it created the objects. Device work needs the tenant's turn on the device, which only the front's scheduler
gives: the worker asks for a lease (``want``), runs direct calls while it holds one, and hands it back when the
front revokes it (another tenant's turn, or the scheduler's periodic accounting). Frames are
``[id, op, params]``; replies ``[id, 0, result]`` or ``[id, 1, error]``.
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpubroker.client import (
    Buffer,
    FailedPrecondition,
    GpuBrokerError,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
)

from ._frames import FrameClosed, recv_frame, send_frame

__all__ = ["CONTROL", "DirectLinks", "Aliases"]

log = logging.getLogger("gpubroker.worker")

# The request id of lease messages between the front and the worker (replies to requests have ids >= 1).
CONTROL = -1
# A client that stops reading its replies, or sends half a frame, loses its link after this long.
_LINK_TIMEOUT = 10.0
_DIRECT_OPS = ("launch", "memset", "copy_d2d", "synchronize", "batch")
# Each link serves one call at a time, so this also bounds a session's direct calls in flight. Past it, new
# connections stay with the front, whose per-session limits then apply.
MAX_LINKS_PER_SESSION = 8
_VIEWS_MAX = 4096  # cached Buffer views of (session, buffer, offset); cleared whole when full


class Aliases:
    """Per session: the client's handle for each buffer, kernel and stream -> the worker's own object."""

    def __init__(self) -> None:
        self.by_session: dict[str, dict[str, tuple[Any, ...]]] = {}

    def add(self, session: str, alias: Any, entry: tuple[Any, ...]) -> None:
        if isinstance(alias, str) and alias:
            self.by_session.setdefault(session, {})[alias] = entry

    def drop_handle(self, session: str, kind: str, handle: str) -> None:
        table = self.by_session.get(session)
        if table:
            for alias in [a for a, e in table.items() if e[0] == kind and getattr(e[1], "handle", e[1]) == handle]:
                del table[alias]

    def forget(self, session: str) -> None:
        self.by_session.pop(session, None)

    def lookup(self, session: str, alias: Any, kind: str) -> tuple[Any, ...]:
        entry = self.by_session.get(session, {}).get(alias) if type(alias) is str else None
        if entry is None or entry[0] != kind:
            raise NotFound(f"no {kind} {alias!r} in this session")
        return entry


@dataclass
class _Link:
    sock: socket.socket
    session: str


class DirectLinks:
    """The worker's direct client links and its lease on the device."""

    def __init__(self, aliases: Aliases, run: Callable[[str, str, dict[str, Any]], Any],
                 send_front: Callable[[list[Any]], None], backend: Any,
                 scalar: Callable[[Any, Any], Any]) -> None:
        self.aliases = aliases
        self._run = run  # WorkerServer.handle
        self._send_front = send_front
        self._backend = backend
        self._scalar = scalar
        # Closes the backend's device-time segments when a batch ends (the CUDA backend's event marks).
        self._end_batch = getattr(backend, "flush_device_time", None)
        self._views: dict[tuple[str, str, int], Buffer] = {}
        self.links: dict[int, _Link] = {}
        self.version = 0  # bumped whenever a link comes or goes, so the serve loop re-reads the set
        self.fatal = False  # a direct call corrupted the context: the worker must exit
        self.holding = False  # the front granted this worker the tenant's turn
        self.contended = False  # others wait for the device: give the turn back after each call
        self._asked = False
        self._waiting: deque[tuple[_Link, Any]] = deque()

    # -- links -------------------------------------------------------------------------------------
    def attach(self, sock: socket.socket, session: str) -> int:
        if sum(1 for link in self.links.values() if link.session == session) >= MAX_LINKS_PER_SESSION:
            raise ResourceExhausted(f"this session already has {MAX_LINKS_PER_SESSION} direct links, the limit")
        sock.settimeout(_LINK_TIMEOUT)
        link = _Link(sock, session)
        self.links[sock.fileno()] = link
        self.version += 1
        send_frame(sock, [0, 0, {"direct": True}])  # the client's hello is answered from here on
        return sock.fileno()

    def close_session(self, session: str) -> None:
        for fd, link in list(self.links.items()):
            if link.session == session:
                self._drop(fd)
        self._waiting = deque(w for w in self._waiting if w[0].session != session)

    def _drop(self, fd: int) -> None:
        link = self.links.pop(fd, None)
        if link is not None:
            self.version += 1
            link.sock.close()

    # -- the lease ---------------------------------------------------------------------------------
    def on_control(self, op: str) -> None:
        if op == "grant":
            self.holding, self._asked, self.contended = True, False, False
            while self._waiting and self.holding and not self.fatal:
                link, frame = self._waiting.popleft()
                self._serve(link, frame)
        elif op == "yield":
            self.contended = True
            if not self._waiting:
                self._release()
        elif op == "revoke":
            self._release()
        if self._waiting and not self.holding:
            self._ask()

    def _release(self) -> None:
        if self.holding:
            self.holding = False
            self._send_front([CONTROL, "released", None])

    def _ask(self) -> None:
        if not self._asked:
            self._asked = True
            self._send_front([CONTROL, "want", None])

    # -- requests ----------------------------------------------------------------------------------
    def readable(self, fd: int) -> None:
        """A frame is arriving on a link: run it now if this worker holds the turn, else queue it and ask."""
        link = self.links.get(fd)
        if link is None:
            return
        try:
            frame = recv_frame(link.sock)
        except (FrameClosed, OSError, ValueError):
            self._drop(fd)
            return
        if not self.holding or self._waiting:
            self._waiting.append((link, frame))
            self._ask()
            return
        self._serve(link, frame)
        if self.contended:
            self._release()  # others wait: each call is one turn, as it would be through the front

    def _serve(self, link: _Link, frame: Any) -> None:
        if link.sock.fileno() not in self.links:
            return  # dropped while its frame waited
        req_id: Any = 0
        try:
            req_id, op, params = frame
            if op not in _DIRECT_OPS or not isinstance(params, dict):
                raise InvalidArgument(f"unknown direct operation {op!r}")
            reply = [req_id, 0, self._run_direct(link.session, op, params)]
        except GpuBrokerError as exc:
            self.fatal = self.fatal or bool(exc.details.get("fatal"))
            reply = [req_id, 1, exc.to_wire()]
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            reply = [req_id, 1, InvalidArgument(f"malformed direct request: {type(exc).__name__}").to_wire()]
        except Exception as exc:  # a bug: report it, keep the worker
            log.exception("direct %r failed", frame[1] if isinstance(frame, list) and len(frame) > 1 else frame)
            reply = [req_id, 1, Internal(f"{type(exc).__name__}: {exc}").to_wire()]
        try:
            send_frame(link.sock, reply)
        except OSError:
            self._drop(link.sock.fileno())

    def _run_direct(self, session: str, op: str, p: dict[str, Any]) -> Any:
        if op == "launch":
            return self._launch(session, p)
        if op != "batch":
            return self._run(op, session, self.translate(session, op, p))
        commands = p["commands"]
        launch = self._launch
        try:
            for i, (seq, what, params) in enumerate(commands):
                try:
                    if what == "launch":
                        launch(session, params)
                    elif what in ("memset", "copy_d2d", "synchronize"):
                        self._run(what, session, self.translate(session, what, params))
                    else:
                        raise InvalidArgument(f"{what!r} cannot be batched")
                except GpuBrokerError as exc:
                    self.fatal = self.fatal or bool(exc.details.get("fatal"))
                    return {"done": i, "error": {"seq": seq, "command": self._describe(session, what, params),
                                                 "code": exc.code, "message": exc.message,
                                                 "type": type(exc).__name__}}
                except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
                    return {"done": i, "error": {"seq": seq, "command": str(what), "code": "INVALID_ARGUMENT",
                                                 "message": f"malformed command: {type(exc).__name__}",
                                                 "type": "InvalidArgument"}}
        finally:
            if self._end_batch is not None and not self.fatal:
                self._end_batch()  # the host may now go idle: that gap must not count as device time
        return {"done": len(commands), "error": None}

    def _describe(self, session: str, op: Any, p: Any) -> str:
        if op == "launch":
            try:
                return f"launch of {self.aliases.lookup(session, p['kernel'], 'kernel')[2]!r}"
            except (GpuBrokerError, TypeError, KeyError):
                return "launch"
        return str(op)

    def _launch(self, session: str, p: dict[str, Any]) -> None:
        """The hot path: straight to the backend, which checks the launch against the kernel and the device."""
        table = self.aliases.by_session.get(session) or {}
        entry = table.get(p["kernel"]) if type(p["kernel"]) is str else None
        if entry is None or entry[0] != "kernel":
            raise NotFound(f"no kernel {p['kernel']!r} in this session")
        args: list[object] = []
        views = self._views
        for arg in p["args"]:
            if arg[0] == "b":
                key = (session, arg[1], arg[2])
                view = views.get(key) if type(arg[1]) is str and type(arg[2]) is int else None
                if view is None or arg[1] not in table:
                    handle, size, offset = self._buf(session, arg[1:])
                    view = Buffer(handle, size, offset)
                    if len(views) >= _VIEWS_MAX:
                        views.clear()
                    views[key] = view
                args.append(view)
            elif arg[0] == "s":
                args.append(self._scalar(arg[1], arg[2]))
            else:
                raise InvalidArgument(f"kernel arg {len(args)} is empty")
        stream = p.get("stream")
        self._backend.execute_kernel(entry[1], p["grid"], p["block"], args,  # the backend checks the dims
                                     p["shared_mem"], self.aliases.lookup(session, stream, "stream")[1]
                                     if stream else None)

    # -- client handles -> worker parameters (the front's translation, done here) --------------------
    def _buf(self, session: str, ref: Any) -> list[Any]:
        alias, offset = ref
        _, handle, size = self.aliases.lookup(session, alias, "buf")
        if type(offset) is not int or offset < 0:
            raise InvalidArgument(f"buffer view offset must be an int >= 0, got {offset!r}")
        if offset > size:
            raise OutOfRange(f"buffer view offset {offset} is past the end of its {size}-byte allocation")
        return [handle, size, offset]

    def _stream(self, session: str, alias: Any) -> str | None:
        return self.aliases.lookup(session, alias, "stream")[1].handle if alias else None

    def translate(self, session: str, op: str, p: dict[str, Any]) -> dict[str, Any]:
        """A call's parameters as the front would have sent them (the worker's handles, sizes from its table)."""
        if op == "memset":
            return {"buf": self._buf(session, p["buf"]), "offset": p["offset"], "size": p["size"],
                    "value": p["value"], "stream": self._stream(session, p.get("stream"))}
        if op == "copy_d2d":
            return {"src": self._buf(session, p["src"]), "dst": self._buf(session, p["dst"]), "size": p["size"],
                    "src_offset": p["src_offset"], "dst_offset": p["dst_offset"],
                    "stream": self._stream(session, p.get("stream"))}
        if op == "synchronize":
            return {"stream": self._stream(session, p.get("stream"))}
        raise FailedPrecondition(f"{op!r} cannot be sent directly")
