"""The GpuCompute Protocol: one interface, implemented in-process by backends and remotely by RemoteGpu."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from ._host import HostBuffer
from ._types import ArrayRef, Buffer, DeviceInfo, Event, Kernel, Module, ModuleFormat, Stream

__all__ = ["GpuCompute"]


@runtime_checkable
class GpuCompute(Protocol):
    """Device operations. Launches are asynchronous: their errors surface at the next synchronize.

    grid = blocks (work-groups) per dimension; block = threads per block. Kernel args are Buffers
    (a view made with ``Buffer.at`` passes a pointer into the allocation) or numpy scalars.
    """

    def initialize(self) -> None: ...

    def device_info(self) -> DeviceInfo: ...

    def allocate_memory(self, size: int) -> Buffer: ...

    def free_memory(self, buf: Buffer) -> None: ...

    def copy_h2d(self, src: HostBuffer, buf: Buffer, offset: int = 0,
                 stream: Stream | None = None) -> None:
        """Copy all of ``src`` into ``buf`` starting ``offset`` bytes into it; returns once ``src`` is consumed."""
        ...

    def copy_d2h(self, buf: Buffer, dst: HostBuffer, offset: int = 0,
                 stream: Stream | None = None) -> None:
        """Fill the writable ``dst`` from ``buf`` starting ``offset`` bytes into it; returns once ``dst`` is full."""
        ...

    def copy_d2d(self, src: Buffer, dst: Buffer, size: int, src_offset: int = 0, dst_offset: int = 0,
                 stream: Stream | None = None) -> None: ...

    def memset(self, buf: Buffer, value: int, size: int | None = None, offset: int = 0,
               stream: Stream | None = None) -> None:
        """Set ``size`` bytes (default: to the end) to the byte ``value``."""
        ...

    def compile_kernel(self, source: str, name: str, options: Sequence[str] = ()) -> Kernel: ...

    def load_module(self, image: str | bytes, format: ModuleFormat, options: Sequence[str] = ()) -> Module: ...

    def get_kernel(self, module: Module, name: str) -> Kernel: ...

    def execute_kernel(self, kernel: Kernel, grid: int | Sequence[int], block: int | Sequence[int],
                       args: Sequence[object], shared_mem: int = 0, stream: Stream | None = None) -> None: ...

    def run_library(self, op: str, inputs: Sequence[ArrayRef], outputs: Sequence[ArrayRef],
                    params: Mapping[str, object] | None = None, stream: Stream | None = None) -> None:
        """Run the library operation ``op`` (matmul, ``linalg.*``, ``fft.*``, sort, unique, ...: the table is
        ``gpubroker.client.LIBRARY_OPS``) on ``inputs``, writing ``outputs``; asynchronous like a launch (its errors
        may surface at the next synchronize).

        Every array is C-contiguous from its buffer view's offset. The caller allocates the outputs with exactly
        the dtypes and shapes ``gpubroker.client.library_outputs(op, [(dtype, shape), ...], params)`` gives; any
        other, an array that overruns its buffer, an unknown op or param, or input the op refuses (a singular
        matrix to ``linalg.inv`` where the library reports it) raise InvalidArgument naming the op. Params are
        ints, floats, bools, strs, None or lists of ints. Outputs must not overlap inputs.
        """
        ...

    def create_stream(self) -> Stream: ...

    def destroy_stream(self, stream: Stream) -> None: ...

    def synchronize(self, stream: Stream | None = None) -> None: ...

    def create_event(self) -> Event: ...

    def record_event(self, event: Event, stream: Stream | None = None) -> None:
        """Mark the point reached by the work queued so far on ``stream``; a later record moves the mark."""
        ...

    def wait_event(self, event: Event, stream: Stream | None = None) -> None:
        """Make ``stream``'s later work wait, on the device, for the event's mark; the host does not block. An
        event never recorded is complete."""
        ...

    def synchronize_event(self, event: Event) -> None:
        """Block the host until the event's mark is reached (at once if it was never recorded)."""
        ...

    def destroy_event(self, event: Event) -> None: ...

    def close(self) -> None: ...
