"""How the client names things on the wire: buffer views, streams and module formats."""

from __future__ import annotations

from typing import Any

from gpubroker.v1 import broker_pb2 as pb

from ._errors import InvalidArgument
from ._types import Buffer, ModuleFormat, Stream

__all__ = ["FORMATS", "direct_ref", "ref", "stream_handle"]

FORMATS = {
    ModuleFormat.CUDA_C: pb.MODULE_FORMAT_CUDA_C,
    ModuleFormat.OPENCL_C: pb.MODULE_FORMAT_OPENCL_C,
    ModuleFormat.PTX: pb.MODULE_FORMAT_PTX,
    ModuleFormat.CUBIN: pb.MODULE_FORMAT_CUBIN,
    ModuleFormat.FATBIN: pb.MODULE_FORMAT_FATBIN,
}


def ref(buf: Buffer) -> pb.BufferRef:
    if not isinstance(buf, Buffer):
        raise InvalidArgument(f"expected a Buffer, got {type(buf).__name__}")
    return pb.BufferRef(handle=buf.handle, offset=buf.offset)


def direct_ref(buf: Buffer) -> list[Any]:
    if not isinstance(buf, Buffer):
        raise InvalidArgument(f"expected a Buffer, got {type(buf).__name__}")
    return [buf.handle, buf.offset]


def stream_handle(stream: Stream | None) -> str:
    return stream.handle if stream is not None else ""
