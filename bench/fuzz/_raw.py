"""Fuzz the broker's raw local sockets: "<socket>.fast" (front and direct links), "<socket>.shm", the gRPC socket.

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

__all__ = ["RawFuzzer"]

Draw = Callable[..., Any]
_HEADER = struct.Struct("!I")
_FAST_OPS = ["launch", "memset", "copy_d2d", "synchronize", "batch", "copy_shared", "nope", ""]

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=16),
                     st.binary(max_size=16))
# msgpack-able junk: what a confused or hostile client might send where a request belongs.
junk = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=8)


def frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
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
    """``fast_case``, ``shm_case`` and ``grpc_case`` each run one hypothesis-drawn case against the broker."""

    def __init__(self, target: str, token: str, session: str, observe: Callable[[str, str, str], Any],
                 timeout: float = 10.0) -> None:
        self.path = target[len("unix:"):]
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
                    if fds:
                        socket.send_fds(sock, [data], fds)
                    else:
                        sock.sendall(data)
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

    # -- <socket>.fast ----------------------------------------------------------------------------
    def fast_case(self, draw: Draw) -> None:
        mode = draw(st.sampled_from(["garbage", "bad_hello", "front", "front", "direct", "direct"]))
        chunks: list[bytes] = []
        if mode == "garbage":
            chunks.append(draw(st.binary(max_size=64)))
        elif mode == "bad_hello":
            chunks.append(frame(draw(st.one_of(junk, st.fixed_dictionaries(
                {"token": st.one_of(junk, st.just(self.token)), "session": st.one_of(junk, st.just(self.session))},
                optional={"direct": junk})))))
        else:
            hello = {"token": self.token, "session": self.session, **({"direct": True} if mode == "direct" else {})}
            chunks.append(frame(hello))
            for i in range(draw(st.integers(0, 4))):
                chunks.append(self._fast_request(draw, i + 1, direct=mode == "direct"))
        replies = unframe(self._exchange(self.path + ".fast", [(c, []) for c in chunks]))
        for reply in replies:
            if not (isinstance(reply, list) and len(reply) == 3 and reply[1] in (0, 1)):
                raise AssertionError(f".fast ({mode}): a malformed reply {reply!r}")
            if reply[1] == 1:
                self._check_error(f"fast {mode}", reply[2])
            else:
                self.observe(f"fast {mode}", "OK", "")
        if mode in ("front", "direct") and not replies:
            raise AssertionError(f".fast ({mode}): no answer to a valid hello")
        if mode == "bad_hello" and replies and replies[0][1] == 0:
            hello = msgpack.unpackb(chunks[0][_HEADER.size:], raw=False, strict_map_key=False)
            if not (isinstance(hello, dict) and hello.get("token") == self.token
                    and hello.get("session") == self.session):
                raise AssertionError(f".fast accepted the hello {hello!r}")

    def _fast_request(self, draw: Draw, req_id: int, direct: bool) -> bytes:
        kind = draw(st.sampled_from(["bytes", "junk", "request", "request", "request"]))
        if kind == "bytes":  # a length prefix and whatever follows (maybe a torn frame: the close ends it)
            body = draw(st.binary(max_size=48))
            return _HEADER.pack(draw(st.sampled_from([len(body), len(body) + 5, 2**31, 2**32 - 1]))) + body
        if kind == "junk":
            return frame(draw(junk))
        op = draw(st.sampled_from(_FAST_OPS))
        payload = draw(junk if direct else st.one_of(st.binary(max_size=48), junk))
        return frame([draw(st.one_of(st.just(req_id), junk)), op, payload])

    # -- <socket>.shm -----------------------------------------------------------------------------
    def shm_case(self, draw: Draw) -> int:
        """Returns how many segments it registered (and released again)."""
        opened: list[int] = []
        chunks: list[tuple[bytes, list[int]]] = []
        try:
            for _ in range(draw(st.integers(1, 3))):
                kind = draw(st.sampled_from(["bytes", "junk", "register", "register", "release"]))
                fds = self._fds(draw, opened) if kind in ("register", "junk") else []
                if kind == "bytes":
                    chunks.append((draw(st.binary(max_size=48)), []))
                elif kind == "junk":
                    chunks.append((frame(draw(junk)), fds))
                elif kind == "register":
                    message = {"token": draw(st.sampled_from([self.token] * 4 + ["", "gpb_x_y"])),
                               "session": draw(st.sampled_from([self.session] * 4 + ["", "ses_nope"])),
                               "size": draw(st.one_of(st.sampled_from([4096, 4096, 1, 0, -1, 2**40, True]), junk))}
                    chunks.append((frame(message), fds))
                else:
                    chunks.append((frame({"token": self.token, "session": self.session,
                                          "release": draw(st.one_of(st.text(max_size=12), junk))}), []))
            replies = unframe(self._exchange(self.path + ".shm", chunks))
        finally:
            for fd in opened:
                os.close(fd)
        registered = []
        for reply in replies:
            if not isinstance(reply, dict):
                raise AssertionError(f".shm: a malformed reply {reply!r}")
            if "error" in reply:
                self._check_error("shm", reply["error"])
            elif "segment" in reply:
                registered.append(reply["segment"])
                self.observe("shm", "OK", "")
            elif reply != {"released": True}:
                raise AssertionError(f".shm: a malformed reply {reply!r}")
        if registered:  # give them back, so the session's accounting returns to nothing
            release = [(frame({"token": self.token, "session": self.session, "release": seg}), [])
                       for seg in registered]
            for reply in unframe(self._exchange(self.path + ".shm", release)):
                if reply != {"released": True}:
                    raise AssertionError(f".shm: releasing a segment it registered got {reply!r}")
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
