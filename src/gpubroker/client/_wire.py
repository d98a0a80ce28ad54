"""How the client names things in commands: buffer views, streams and module formats."""

from __future__ import annotations

from gpubroker.v1 import broker_pb2 as pb
from gpubroker.wire.commands import MAX_HANDLE
from gpubroker.wire.errors import InvalidArgument
from gpubroker.wire.types import Buffer, ModuleFormat, Stream

__all__ = ["FORMATS", "buf_ref", "handle", "stream_handle"]

FORMATS = {
    ModuleFormat.CUDA_C: pb.MODULE_FORMAT_CUDA_C,
    ModuleFormat.OPENCL_C: pb.MODULE_FORMAT_OPENCL_C,
    ModuleFormat.PTX: pb.MODULE_FORMAT_PTX,
    ModuleFormat.CUBIN: pb.MODULE_FORMAT_CUBIN,
    ModuleFormat.FATBIN: pb.MODULE_FORMAT_FATBIN,
}


def handle(value: object, what: str) -> str:
    """A handle as commands carry it: checked here, since a command the worker cannot decode fails its batch."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_HANDLE:
        raise InvalidArgument(f"a {what} handle is a str of 1 to {MAX_HANDLE} characters, got {value!r:.80}")
    return value


def buf_ref(buf: Buffer) -> tuple[str, int]:
    """A command's reference to a buffer view: (allocation handle, view offset)."""
    if not isinstance(buf, Buffer):
        raise InvalidArgument(f"expected a Buffer, got {type(buf).__name__}")
    if not isinstance(buf.offset, int) or buf.offset < 0:
        raise InvalidArgument(f"buffer view offset must be an int >= 0, got {buf.offset!r}")
    return handle(buf.handle, "buffer"), buf.offset


def stream_handle(stream: Stream | None) -> str:
    if stream is None:
        return ""
    if not isinstance(stream, Stream):
        raise InvalidArgument(f"stream must be a Stream or None, got {type(stream).__name__}")
    return handle(stream.handle, "stream")
