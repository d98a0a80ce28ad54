"""Fuzz the broker's raw local sockets besides the framed link's batches (``_link.py``): segment connections on
"<socket>.fast" (a hello asking for ``segments``, then registrations with hostile descriptors) and the gRPC socket.

Each case writes hostile bytes, then half-closes its end: the broker must answer only well-formed frames with a
documented status, and close the connection (never hang on it, never crash). Registrations that succeed are
released again, so the session's handle count must come back to zero.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

import msgpack
from hypothesis import strategies as st

from gpubroker.client._shm import create_segment_fd
from gpubroker.wire.addresses import unix_path
from gpubroker.wire.commands import new_handle

__all__ = ["RawFuzzer"]

Draw = Callable[..., Any]
_HEADER = struct.Struct("!I")

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=16),
                     st.binary(max_size=16))
# msgpack-able junk: what a confused or hostile client might send where a request belongs.
junk = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=8)


def frame(obj: Any) -> bytes:
    payload: bytes = msgpack.packb(obj, use_bin_type=True)
    return _HEADER.pack(len(payload)) + payload


def unframe(data: bytes) -> list[Any]:
    """The whole frames in ``data`` (a trailing partial frame means the broker cut a reply short: an error)."""
    frames, pos = [], 0
    while pos < len(data):
        if pos + _HEADER.size > len(data):
            raise AssertionError(f"a torn reply header: {data[pos:]!r}")
        (length,) = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + length
        if end > len(data):
            raise AssertionError(f"a torn reply of {length} bytes ({len(data) - pos - _HEADER.size} came)")
        frames.append(msgpack.unpackb(data[pos + _HEADER.size:end], raw=False, strict_map_key=False))
        pos = end
    return frames


class RawFuzzer:
    """``segments_case`` and ``grpc_case`` each run one hypothesis-drawn case against the broker."""

    def __init__(self, target: str, token: str, session: str, observe: Callable[[str, str, str], Any],
                 timeout: float = 10.0) -> None:
        path = unix_path(target)
        assert path, f"the raw fuzzer needs a unix: target, not {target!r}"
        self.path = path
        self.token = token
        self.session = session  # a live session of the tenant owning ``token``, with no handles
        self.observe = observe
        self.timeout = timeout
        self.cases = 0

    def _exchange(self, path: str, chunks: list[tuple[bytes, list[int]]]) -> bytes:
        """Send each chunk (with its fds), half-close, and read until the broker closes: it must, in time."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(path)
            for data, fds in chunks:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    try:
                        if fds:
                            socket.send_fds(sock, [data], fds)
                        else:
                            sock.sendall(data)
                    except PermissionError:  # descriptors before the hello was answered: the kernel refuses them
                        sock.sendall(data)  # (SO_PASSRIGHTS = 0 until then), so the bytes go alone
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            received = bytearray()
            while True:
                try:
                    got = sock.recv(1 << 16)
                except ConnectionResetError:
                    break
                except TimeoutError:
                    raise AssertionError(f"{path} neither answered nor closed within {self.timeout} s") from None
                if not got:
                    break
                received += got
            return bytes(received)
        finally:
            sock.close()
            self.cases += 1

    def _check_error(self, where: str, error: Any) -> None:
        if not isinstance(error, dict) or not isinstance(error.get("code"), str):
            raise AssertionError(f"{where}: malformed error {error!r}")
        self.observe(where, error["code"], str(error.get("message")))

    # -- segment connections on <socket>.fast -------------------------------------------------------
    def _segments_hello(self) -> bytes:
        return frame({"token": self.token, "session": self.session, "segments": 1})

    def segments_case(self, draw: Draw) -> int:
        """Returns how many segments it registered (and released again)."""
        opened: list[int] = []
        used: set[str] = set()
        chunks: list[tuple[bytes, list[int]]] = []
        try:
            # Mostly the hello that opens a segments connection; else one with a wrong token or session, junk, or
            # none at all (then what follows is judged as the hello).
            hello = draw(st.sampled_from(["good"] * 6 + ["token", "session", "junk", "none"]))
            if hello == "good":
                chunks.append((self._segments_hello(), []))
            elif hello in ("token", "session"):
                chunks.append((frame({"token": self.token if hello == "session" else "gpb_x_y", "segments": 1,
                                      "session": self.session if hello == "token" else "ses_nope"}), []))
            elif hello == "junk":
                chunks.append((frame(draw(junk)), self._fds(draw, opened)))
            for _ in range(draw(st.integers(1, 3))):
                kind = draw(st.sampled_from(["bytes", "junk", "register", "register", "release"]))
                fds = self._fds(draw, opened) if kind in ("register", "junk") else []
                if kind == "bytes":
                    chunks.append((draw(st.binary(max_size=48)), []))
                elif kind == "junk":
                    chunks.append((frame(draw(junk)), fds))
                elif kind == "register":
                    # The client names the segment (issue 13): a fresh handle, one already registered, or junk.
                    handle = draw(st.one_of(st.just(new_handle("segment")), st.just(new_handle("segment")),
                                            st.sampled_from(sorted(used) or ["g0"]), st.just(""),
                                            st.just("g" * 65), junk))
                    if isinstance(handle, str) and handle.startswith("g") and len(handle) == 17:
                        used.add(handle)
                    size = draw(st.one_of(st.sampled_from([4096, 4096, 1, 0, -1, 2**40, True]), junk))
                    chunks.append((frame(["register", handle, size]), fds))
                else:
                    chunks.append((frame(["release", draw(st.one_of(st.text(max_size=12), junk))]), []))
            replies = unframe(self._exchange(self.path + ".fast", chunks))
        finally:
            for fd in opened:
                os.close(fd)
        registered = []
        for reply in replies:
            if not (isinstance(reply, list) and len(reply) == 3 and reply[0] == 0 and reply[1] in (0, 1)):
                raise AssertionError(f"segments: a malformed reply {reply!r}")
            result = reply[2]
            if reply[1] == 1:
                self._check_error("segments", result)
            elif isinstance(result, dict) and set(result) == {"segment", "size"}:
                registered.append(result["segment"])
                self.observe("segments", "OK", "")
            elif result not in ({"released": True}, {"segments": 1}):
                raise AssertionError(f"segments: a malformed reply {reply!r}")
        if len(set(registered)) != len(registered):
            raise AssertionError(f"segments: one segment handle registered twice: {registered}")
        if registered:  # give them back, so the session's accounting returns to nothing
            no_fds: list[int] = []
            release = [(self._segments_hello(), no_fds),
                       *((frame(["release", seg]), no_fds) for seg in registered)]
            replies = unframe(self._exchange(self.path + ".fast", release))
            if replies[1:] != [[0, 0, {"released": True}]] * len(registered):
                raise AssertionError(f"segments: releasing segments it registered got {replies!r}")
        return len(registered)

    @staticmethod
    def _fds(draw: Draw, opened: list[int]) -> list[int]:
        """Descriptors to attach: memfds sealed or not, of the announced size or not, pipes, sockets, /dev/null."""
        fds = []
        for kind in draw(st.lists(st.sampled_from(["sealed", "sealed", "small", "unsealed", "pipe", "socket",
                                                   "devnull"]), max_size=5)):
            if kind in ("sealed", "small"):
                fd = create_segment_fd(4096 if kind == "sealed" else 16)
            elif kind == "unsealed":
                fd = os.memfd_create("fuzz-unsealed", os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, 4096)
            elif kind == "pipe":
                fd, other = os.pipe()
                opened.append(other)
            elif kind == "socket":
                a, b = socket.socketpair()
                fd, other = a.detach(), b.detach()
                opened.append(other)
            else:
                fd = os.open(os.devnull, os.O_RDWR)
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
            opened.append(fd)
            fds.append(fd)
        return fds

    # -- the gRPC socket --------------------------------------------------------------------------
    def grpc_case(self, draw: Draw) -> None:
        preface = draw(st.sampled_from([b"", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"GET / HTTP/1.1\r\n\r\n"]))
        self._exchange(self.path, [(preface + draw(st.binary(max_size=256)), [])])
        self.observe("grpc socket", "OK", "")
