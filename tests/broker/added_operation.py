"""An operation added the way docs/architecture/adding-an-operation.md says, in the four places it names, without a
line of gpubroker changed: ``checksum``, the sum of a device view's bytes (each an unsigned byte).

In the tree each piece is written into its module; here each is registered through the same mechanism from
outside: the command is a subclass of ``Command`` (defining it registers it, with its traits), the handler is
registered with ``@handles``, and the backend method and the SDK's method are set on their classes (the only
difference: a file in the tree would define them in the class body). tests/broker/test_adding_an_operation.py
imports this module in the test's own process and, through a ``sitecustomize`` on PYTHONPATH, in a real broker's
front and workers, and runs the operation end to end on every transport.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

from gpubroker.broker.backends._opencl import OpenCLBackend
from gpubroker.broker.worker._executor import Executor, handles
from gpubroker.broker.worker._handles import SessionObjects
from gpubroker.client import RemoteGpu
from gpubroker.client._wire import buf_ref, stream_handle
from gpubroker.wire.commands import BufRef, Command, NonNegative, OptionalStream
from gpubroker.wire.errors import InvalidArgument
from gpubroker.wire.types import Buffer, Stream


# -- 1. the command (src/gpubroker/wire/commands.py) -----------------------------------------------------------------
class Checksum(Command, tag="test_checksum", frozen=True):
    """The sum of ``size`` bytes of a view from its start, each as an unsigned byte; the Ack's result is the sum."""

    # Its traits (the defaults: a link may carry it, and it is device work, so it waits for the tenant's turn).
    result = Annotated[int, msgspec.Meta(ge=0)]  # the front decodes a worker's answer as this and nothing else
    buf: BufRef
    size: NonNegative
    stream: OptionalStream = ""

    def describe(self) -> str:
        return f"checksum of {self.size} bytes"

    def check_result(self, result: int) -> None:
        if result > 255 * self.size:
            raise ValueError(f"a checksum of {result} for {self.size} bytes")


# -- 2. the worker's handler (src/gpubroker/broker/worker/_executor.py) ----------------------------------------------
@handles(Checksum)
def _checksum(executor: Executor, objs: SessionObjects, cmd: Checksum) -> int:
    # (in the tree GpuCompute, the backend's type here, declares the method: no type: ignore)
    return int(executor.backend.checksum(objs.view(*cmd.buf), cmd.size, objs.stream(cmd.stream)))  # type: ignore[attr-defined]


# -- 3. the backend (src/gpubroker/broker/backends/, and GpuCompute in src/gpubroker/wire/compute.py) ----------------
def _backend_checksum(self: OpenCLBackend, buf: Buffer, size: int, stream: Stream | None = None) -> int:
    """The sum of ``size`` bytes of ``buf`` from its start, each as an unsigned byte (checked in-process too)."""
    if size < 0:
        raise InvalidArgument(f"checksum size must be >= 0, got {size}")
    data = np.empty(size, dtype=np.uint8)
    self.copy_d2h(buf, data, 0, stream)  # (OutOfRange past the view)
    return int(data.sum(dtype=np.uint64))


OpenCLBackend.checksum = _backend_checksum  # type: ignore[attr-defined]


# -- ... and the SDK's method (src/gpubroker/client/_remote.py RemoteGpu) ---------------------------------------------
def _remote_checksum(self: RemoteGpu, buf: Buffer, size: int, stream: Stream | None = None) -> int:
    if size < 0:
        raise InvalidArgument(f"checksum size must be >= 0, got {size}")
    result: int = self.transport.call(Checksum(buf_ref(buf), size, stream_handle(stream)))
    return result


RemoteGpu.checksum = _remote_checksum  # type: ignore[attr-defined]
