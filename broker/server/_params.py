"""Client requests -> the worker's parameters: the session's handles resolved, views and ranges checked."""

from __future__ import annotations

from typing import Any

from gpubroker.client import InvalidArgument, OutOfRange
from gpubroker.v1 import broker_pb2 as pb

from ..sessions import Session

__all__ = ["WorkerParams", "check_copy_range"]

_MAX_DIMS = 3


def check_copy_range(buf: list[Any], offset: int, size: int) -> None:
    """Refuse a streamed copy before any chunk moves: ``buf`` is [handle, allocation size, view offset]."""
    if offset < 0 or size < 0:
        raise InvalidArgument(f"copy offset and size must be >= 0, got {offset} and {size}")
    if buf[2] + offset + size > buf[1]:
        raise OutOfRange(f"copy of {size} bytes at offset {offset} runs past the end of the buffer "
                         f"({buf[1] - buf[2]} bytes from the view's start)")


def _dims(values: Any, what: str) -> list[int]:
    dims = list(values)
    if not 1 <= len(dims) <= _MAX_DIMS:
        raise InvalidArgument(f"{what} needs 1 to 3 extents, got {len(dims)}")
    return dims


class WorkerParams:
    """The worker parameters of each device call, shared by the gRPC handlers, batches and the fast path."""

    def _buffer_ref(self, session: Session, ref: pb.BufferRef) -> list[Any]:
        entry = session.resolve(ref.handle, "buf")
        if ref.offset > entry.size:
            raise OutOfRange(f"buffer view offset {ref.offset} is past the end of its {entry.size}-byte allocation")
        return [entry.backend, entry.size, ref.offset]

    def _stream(self, session: Session, handle: str) -> str | None:
        return session.resolve(handle, "stream").backend if handle else None

    # The worker parameters of each command that may also travel in a batch.
    def _memset_params(self, session: Session, request: pb.MemsetRequest) -> dict[str, Any]:
        return {"buf": self._buffer_ref(session, request.buffer), "offset": request.offset, "size": request.size,
                "value": request.value, "stream": self._stream(session, request.stream)}

    def _d2d_params(self, session: Session, request: pb.CopyDeviceToDeviceRequest) -> dict[str, Any]:
        return {"src": self._buffer_ref(session, request.src), "dst": self._buffer_ref(session, request.dst),
                "size": request.size, "src_offset": request.src_offset, "dst_offset": request.dst_offset,
                "stream": self._stream(session, request.stream)}

    def _launch_params(self, session: Session, request: pb.LaunchKernelRequest) -> dict[str, Any]:
        kernel = session.resolve(request.kernel, "kernel")
        args: list[list[Any]] = []
        for arg in request.args:
            kind = arg.WhichOneof("kind")
            if kind == "buffer":
                args.append(["b", *self._buffer_ref(session, arg.buffer)])
            elif kind == "scalar":
                args.append(["s", arg.scalar.dtype, arg.scalar.value])
            else:
                raise InvalidArgument(f"kernel arg {len(args)} is empty")
        return {"kernel": kernel.backend, "name": kernel.name, "grid": _dims(request.grid, "grid"),
                "block": _dims(request.block, "block"), "shared_mem": request.shared_mem,
                "stream": self._stream(session, request.stream), "args": args}
