"""The worker's operations: one device context for one tenant, and which session owns each handle.

It knows nothing of gRPC. Requests are ``[id, op, session, params]``; replies ``[id, 0, result]`` or
``[id, 1, error]`` (the loop is in _process.py).
"""

from __future__ import annotations

import logging
import os
import socket
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from gpubroker.client import (
    Buffer,
    GpuBrokerError,
    GpuCompute,
    Internal,
    InvalidArgument,
    Kernel,
    Module,
    ModuleFormat,
    NotFound,
    Stream,
)

from ._direct import Aliases, DirectLinks
from ._frames import send_frame
from ._peer import PeerImports, PeerOps
from ._segments import SegmentTable

__all__ = ["EXIT_FATAL", "WorkerServer"]

log = logging.getLogger("gpubroker.worker")
EXIT_FATAL = 3

_KINDS = ("buf", "module", "kernel", "stream", "segment")
_BATCHABLE = ("launch", "memset", "copy_d2d", "synchronize")
# Value objects rebuilt from wire refs are cached: a frozen dataclass costs more to build than a lookup.
# Past this many entries a cache is simply cleared (ownership is checked on every use, never cached).
_CACHE_MAX = 4096
_DTYPES: dict[str, np.dtype[Any]] = {}  # scalar dtype names already accepted
_SCALAR_VALUES: dict[tuple[str, bytes], np.generic] = {}  # numpy scalars are immutable: safe to share


def _scalar(dtype: str, raw: bytes) -> np.generic:
    key = (dtype, raw)
    try:
        return _SCALAR_VALUES[key]  # the same few scalars (sizes, factors) come with launch after launch
    except (KeyError, TypeError):
        pass
    value = _make_scalar(dtype, raw)
    if type(dtype) is str and type(raw) is bytes:
        if len(_SCALAR_VALUES) >= _CACHE_MAX:
            _SCALAR_VALUES.clear()
        _SCALAR_VALUES[key] = value
    return value


def _make_scalar(dtype: str, raw: bytes) -> np.generic:
    dt = _DTYPES.get(dtype) if type(dtype) is str else None
    if dt is None:
        try:
            dt = np.dtype(dtype)
        except Exception:  # TypeError mostly; ValueError, SyntaxError and others for some strings numpy half-parses
            raise InvalidArgument(f"unknown scalar dtype {dtype!r}") from None
        if dt.kind not in "iuf" or dt.itemsize > 8:
            raise InvalidArgument(f"scalar of dtype {dtype!r} must be an int or float of {dt.itemsize} bytes")
        if type(dtype) is str and len(_DTYPES) < 64:
            _DTYPES[dtype] = dt
    if len(raw) != dt.itemsize:
        raise InvalidArgument(f"scalar of dtype {dtype!r} must be an int or float of {dt.itemsize} bytes")
    scalar: np.generic[Any] = np.frombuffer(raw, dtype=dt)[0]
    return scalar


class WorkerServer(PeerOps):
    """Dispatches front requests to a backend and tracks which session owns each handle."""

    def __init__(self, backend: GpuCompute, front: socket.socket | None = None) -> None:
        self.backend = backend
        self.front = front
        # Same-host clients' direct links, which name objects by the handles the front gave them.
        self.aliases = Aliases()
        self.links = DirectLinks(self.aliases, self.handle, self._send_front, backend, _scalar)
        self.owned: dict[str, dict[str, set[str]]] = defaultdict(lambda: {k: set() for k in _KINDS})
        self.kernel_module: dict[str, str] = {}
        self.segments = SegmentTable(backend)  # shared-memory segments; main() attaches the fd channel
        self.peer_imports = PeerImports()  # other devices' allocations opened for CopyPeer (workers/_peer.py)
        self.fatal = False  # a batched command corrupted the context: exit after replying
        self._buffers: dict[tuple[str, int, int], Buffer] = {}
        self._kernels: dict[tuple[str, str], Kernel] = {}
        self._streams: dict[str, Stream] = {}
        # Closes the backend's device-time segments when a batch ends (the CUDA backend's event marks).
        self._end_batch = getattr(backend, "flush_device_time", None)
        self._batch_ops = {op: getattr(self, f"op_{op}") for op in _BATCHABLE}  # no getattr per command

    def _send_front(self, frame: list[Any]) -> None:
        if self.front is not None:
            send_frame(self.front, frame)

    # -- ownership ---------------------------------------------------------------------------------
    def _own(self, session: str, kind: str, handle: str) -> str:
        if handle not in self.owned[session][kind]:
            raise NotFound(f"unknown {kind} handle")
        return handle

    def _buffer(self, session: str, ref: list[Any]) -> Buffer:
        handle, size, view_offset = ref
        if handle not in self.owned[session]["buf"]:
            raise NotFound("unknown buf handle")
        key = (handle, size, view_offset)
        try:
            return self._buffers[key]
        except (KeyError, TypeError):  # TypeError: an unhashable ref; int() below reports it
            buf = Buffer(handle, int(size), int(view_offset))
        if type(size) is int and type(view_offset) is int:  # only exact keys: 1 == 1.0 == True hash alike
            if len(self._buffers) >= _CACHE_MAX:
                self._buffers.clear()
            self._buffers[key] = buf
        return buf

    def _stream(self, session: str, handle: str | None) -> Stream | None:
        if not handle:
            return None
        if handle not in self.owned[session]["stream"]:
            raise NotFound("unknown stream handle")
        stream = self._streams.get(handle)
        if stream is None:
            if len(self._streams) >= _CACHE_MAX:
                self._streams.clear()
            stream = self._streams[handle] = Stream(handle)
        return stream

    # -- operations --------------------------------------------------------------------------------
    def handle(self, op: str, session: str, p: dict[str, Any]) -> Any:
        method = getattr(self, f"op_{op}", None)
        if method is None:
            raise InvalidArgument(f"unknown worker operation {op!r}")
        return method(session, p)

    def op_ping(self, session: str, p: dict[str, Any]) -> Any:
        return os.getpid()

    def op_device_info(self, session: str, p: dict[str, Any]) -> Any:
        return asdict(self.backend.device_info())

    def op_allocate(self, session: str, p: dict[str, Any]) -> Any:
        size = int(p["size"])
        buf = self.backend.allocate_memory(size)
        self.owned[session]["buf"].add(buf.handle)
        self.aliases.add(session, p.get("alias"), ("buf", buf.handle, size))
        return buf.handle

    def op_free(self, session: str, p: dict[str, Any]) -> Any:
        handle = self._own(session, "buf", p["handle"])
        self.backend.free_memory(Buffer(handle, 0))
        self.owned[session]["buf"].discard(handle)
        self.aliases.drop_handle(session, "buf", handle)

    def op_memset(self, session: str, p: dict[str, Any]) -> Any:
        size = p["size"]
        self.backend.memset(self._buffer(session, p["buf"]), int(p["value"]), None if size < 0 else size,
                            int(p["offset"]), self._stream(session, p.get("stream")))

    def op_copy_d2d(self, session: str, p: dict[str, Any]) -> Any:
        self.backend.copy_d2d(self._buffer(session, p["src"]), self._buffer(session, p["dst"]), int(p["size"]),
                              int(p["src_offset"]), int(p["dst_offset"]), self._stream(session, p.get("stream")))

    def op_write(self, session: str, p: dict[str, Any]) -> Any:
        self.backend.copy_h2d(p["data"], self._buffer(session, p["buf"]), int(p["offset"]),
                              self._stream(session, p.get("stream")))

    def op_read(self, session: str, p: dict[str, Any]) -> Any:
        out = bytearray(int(p["size"]))
        self.backend.copy_d2h(self._buffer(session, p["buf"]), out, int(p["offset"]),
                              self._stream(session, p.get("stream")))
        return out  # packed as bin as it is: no copy to bytes first

    def op_load_module(self, session: str, p: dict[str, Any]) -> Any:
        try:
            fmt = ModuleFormat(p["format"])
        except ValueError:
            raise InvalidArgument(f"unknown module format {p['format']!r}") from None
        module = self.backend.load_module(p["image"], fmt, tuple(p.get("options", ())))
        self.owned[session]["module"].add(module.handle)
        return {"handle": module.handle, "kernel_names": list(module.kernel_names)}

    def op_get_kernel(self, session: str, p: dict[str, Any]) -> Any:
        module = self._own(session, "module", p["module"])
        kernel = self.backend.get_kernel(Module(module), str(p["name"]))
        self.owned[session]["kernel"].add(kernel.handle)
        self.kernel_module[kernel.handle] = module
        self.aliases.add(session, p.get("alias"), ("kernel", kernel, kernel.name))
        return kernel.handle

    def op_unload_module(self, session: str, p: dict[str, Any]) -> Any:
        module = self._own(session, "module", p["module"])
        self._unload(session, module)

    def _unload(self, session: str, module: str) -> None:
        # Every backend has it, but it is not part of the SDK's GpuCompute, the type open_backend returns
        self.backend.unload_module(Module(module))  # type: ignore[attr-defined]
        self.owned[session]["module"].discard(module)
        for kernel, owner in list(self.kernel_module.items()):
            if owner == module:
                del self.kernel_module[kernel]
                self.owned[session]["kernel"].discard(kernel)
                self.aliases.drop_handle(session, "kernel", kernel)

    def op_launch(self, session: str, p: dict[str, Any]) -> Any:
        handle = p["kernel"]
        if handle not in self.owned[session]["kernel"]:
            raise NotFound("unknown kernel handle")
        key = (handle, p.get("name", ""))
        kernel = self._kernels.get(key)
        if kernel is None:
            if len(self._kernels) >= _CACHE_MAX:
                self._kernels.clear()
            kernel = self._kernels[key] = Kernel(*key)
        args: list[object] = []
        for arg in p["args"]:
            kind = arg[0]
            if kind == "b":
                args.append(self._buffer(session, arg[1:]))
            elif kind == "s":
                args.append(_scalar(arg[1], arg[2]))
            else:
                raise InvalidArgument(f"unknown kernel arg kind {kind!r}")
        self.backend.execute_kernel(kernel, tuple(p["grid"]), tuple(p["block"]), args, int(p["shared_mem"]),
                                    self._stream(session, p.get("stream")))

    def op_create_stream(self, session: str, p: dict[str, Any]) -> Any:
        stream = self.backend.create_stream()
        self.owned[session]["stream"].add(stream.handle)
        self.aliases.add(session, p.get("alias"), ("stream", stream))
        return stream.handle

    def op_destroy_stream(self, session: str, p: dict[str, Any]) -> Any:
        handle = self._own(session, "stream", p["stream"])
        self.backend.destroy_stream(Stream(handle))
        self.owned[session]["stream"].discard(handle)
        self.aliases.drop_handle(session, "stream", handle)

    def op_synchronize(self, session: str, p: dict[str, Any]) -> Any:
        self.backend.synchronize(self._stream(session, p.get("stream")))

    def op_batch(self, session: str, p: dict[str, Any]) -> Any:
        """Run asynchronous commands in order; stop at the first failure and report it by sequence number."""
        ops = self._batch_ops
        commands = p["commands"]
        try:
            for i, (seq, op, what, params) in enumerate(commands):
                method = ops.get(op) if type(op) is str else None
                if method is None:
                    raise InvalidArgument(f"{op!r} cannot be batched")
                try:
                    method(session, params)
                except GpuBrokerError as exc:
                    if exc.details.get("fatal"):
                        self.fatal = True
                    return {"done": i, "error": {"seq": seq, "command": what, "code": exc.code,
                                                 "message": exc.message, "type": type(exc).__name__}}
        finally:
            if self._end_batch is not None and not self.fatal:
                self._end_batch()  # the host may now go idle: that gap must not count as device time
        return {"done": len(commands), "error": None}

    def op_take_device_time(self, session: str, p: dict[str, Any]) -> Any:
        """Device seconds used since the last take (the fair scheduler's charge); waits for queued work."""
        take = getattr(self.backend, "take_device_time", None)
        return float(take()) if take is not None else 0.0

    def op_register_segment(self, session: str, p: dict[str, Any]) -> Any:
        """Map the memfd the front sent on the fd channel with this request (same-host shared memory)."""
        seg = self.segments.register(p.get("token", b""), p.get("size"))
        self.owned[session]["segment"].add(seg)
        return seg

    def op_release_segment(self, session: str, p: dict[str, Any]) -> Any:
        seg = self._own(session, "segment", p["segment"])
        self.segments.release(seg)
        self.owned[session]["segment"].discard(seg)

    def op_copy_shared(self, session: str, p: dict[str, Any]) -> Any:
        """Copy between a mapped segment and device memory: the backend reads or writes the mapping directly."""
        buf, stream = self._buffer(session, p["buf"]), self._stream(session, p.get("stream"))
        seg = self._own(session, "segment", p["segment"])
        with self.segments.view(seg, int(p["segment_offset"]), int(p["size"])) as host:
            if p["to_device"]:
                self.backend.copy_h2d(host, buf, int(p["offset"]), stream)
            else:
                self.backend.copy_d2h(buf, host, int(p["offset"]), stream)

    def op_attach_direct(self, session: str, p: dict[str, Any]) -> Any:
        """Take over a client's authenticated fast-path socket (sent on the fd channel) for this session."""
        fd = self.segments.receive(bytes(p.get("token", b"")))
        sock = socket.socket(fileno=fd)
        if sock.family != socket.AF_UNIX:
            sock.close()
            raise InvalidArgument("a direct link must be a Unix socket")
        try:
            return self.links.attach(sock, session)
        except GpuBrokerError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise Internal(f"could not answer the client on its direct link: {exc}") from None

    def op_close_links(self, session: str, p: dict[str, Any]) -> Any:
        """Close the session's direct links (the token that opened them was revoked); the session stays."""
        self.links.close_session(session)
        return None

    def op_close_session(self, session: str, p: dict[str, Any]) -> Any:
        """Free everything the session owned; errors on one object do not stop the rest."""
        self.links.close_session(session)
        self.aliases.forget(session)
        self.close_peer_imports(session)
        owned = self.owned.pop(session, None)
        if owned is None:
            return 0
        for seg in owned["segment"]:  # unpin and unmap: a dead client's segments go with its lease
            self.segments.release(seg)
        freed = 0
        cleanups: list[tuple[Callable[[Any], object], Buffer | Stream]] = (
            [(self.backend.destroy_stream, Stream(h)) for h in owned["stream"]]
            + [(self.backend.free_memory, Buffer(h, 0)) for h in owned["buf"]])
        for fn, obj in cleanups:
            try:
                fn(obj)
                freed += 1
            except GpuBrokerError as exc:
                log.warning("close_session %s: %s", session, exc)
        for module in owned["module"]:
            self.owned[session]["module"].add(module)
            self._unload(session, module)
        self.owned.pop(session, None)
        return freed
