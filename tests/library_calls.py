"""Running a library operation on host arrays through any GpuCompute (tests of run_library)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpubroker.client import ArrayRef, Buffer, GpuCompute, Stream, library_outputs

# Arrays start this far into their buffers, so every call also exercises buffer views.
OFFSET = 64


def upload(gpu: GpuCompute, array: np.ndarray[Any, Any], buffers: list[Buffer]) -> ArrayRef:
    array = np.ascontiguousarray(array)
    buf = gpu.allocate_memory(OFFSET + array.nbytes)
    buffers.append(buf)
    if array.nbytes:
        gpu.copy_h2d(array, buf, OFFSET)
    return ArrayRef(buf.at(OFFSET), array.dtype.name, array.shape)


def allocate(gpu: GpuCompute, dtype: str, shape: tuple[int, ...], buffers: list[Buffer]) -> ArrayRef:
    buf = gpu.allocate_memory(OFFSET + int(np.prod(shape)) * np.dtype(dtype).itemsize)
    buffers.append(buf)
    return ArrayRef(buf.at(OFFSET), dtype, shape)


def download(gpu: GpuCompute, ref: ArrayRef) -> np.ndarray[Any, Any]:
    out = np.empty(ref.shape, ref.dtype)
    if out.nbytes:
        gpu.copy_d2h(ref.buffer, out)
    return out


def run_op(gpu: GpuCompute, op: str, arrays: Sequence[np.ndarray[Any, Any]],
           params: Mapping[str, object] | None = None, stream: Stream | None = None) -> list[np.ndarray[Any, Any]]:
    """``op`` on ``arrays`` with outputs as ``library_outputs`` says; the outputs downloaded, the buffers freed."""
    buffers: list[Buffer] = []
    try:
        inputs = [upload(gpu, a, buffers) for a in arrays]
        specs = library_outputs(op, [(r.dtype, r.shape) for r in inputs], params)
        outputs = [allocate(gpu, dtype, shape, buffers) for dtype, shape in specs]
        gpu.run_library(op, inputs, outputs, params, stream)
        return [download(gpu, ref) for ref in outputs]
    finally:
        for buf in buffers:
            gpu.free_memory(buf)
