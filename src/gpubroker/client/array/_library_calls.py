"""Library operations (``GpuCompute.run_library``) called with arrays, and the small view helpers their callers share.

A library operation takes C-contiguous inputs and writes outputs the caller allocates; ``call`` makes the inputs
contiguous (a copy kernel where they are not), asks the op table (``library_outputs``, the same table the worker
checks against) what the outputs are, allocates them and queues the operation. Nothing here waits for the device
except ``read_count`` and ``read_scalar``: the sizes that data-dependent shapes (unique, nonzero) need, and a 0-d
array passed where a library operation takes one number.

Temporaries (a contiguous copy, a cast) may die as soon as ``call`` returns: their memory goes back to the pool,
and whatever reuses it is queued after the library operation on the same stream, so it never overwrites an input
the operation has yet to read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpubroker.client import ArrayRef, library_outputs
from gpubroker.client.array._array import Array, contiguous, empty_array, to_host
from gpubroker.client.array._context import Context
from gpubroker.client.array._creation import astype

__all__ = ["as_ref", "call", "cast", "context_of", "normalize_axis", "read_count", "read_scalar"]


def context_of(*arrays: Array) -> Context:
    """The context every array lives on (ValueError if they live on different devices; TypeError for non-arrays)."""
    for x in arrays:
        if not isinstance(x, Array):
            raise TypeError(f"expected an array, got {type(x).__name__}")
    ctx = arrays[0]._ctx
    if any(x._ctx is not ctx for x in arrays[1:]):
        raise ValueError("arrays on different devices")
    return ctx


def cast(x: Array, dtype: np.dtype[Any]) -> Array:
    """``x`` in ``dtype``: itself if it already is, else a converted contiguous copy."""
    return x if x.dtype == dtype else astype(x, dtype)


def normalize_axis(axis: int, ndim: int, what: str = "axis") -> int:
    """``axis`` in ``[0, ndim)`` from ``[-ndim, ndim)``; NumPy's AxisError outside (both an IndexError and a
    ValueError, which is what callers of the standard's functions catch)."""
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{what} must be an integer, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise np.exceptions.AxisError(f"{what} {axis} is out of bounds for an array of {ndim} dimensions")
    return int(axis) % ndim


_DTYPE_NAMES: dict[np.dtype[Any], str] = {}


def dtype_name(dtype: np.dtype[Any]) -> str:
    """``dtype.name``, remembered (NumPy computes it in Python at each call: a few microseconds per array)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


def as_ref(x: Array) -> ArrayRef:
    """The library operation's handle on the contiguous ``x``: its buffer from its first element, dtype and shape."""
    v = x._view
    buffer = v.buffer.at(v.offset * v.dtype.itemsize) if v.offset else v.buffer  # (a fresh array starts at 0)
    return ArrayRef(buffer, dtype_name(v.dtype), v.shape)


def call(op: str, inputs: Sequence[Array], params: Mapping[str, object] | None = None) -> list[Array]:
    """Queue the library operation ``op`` on ``inputs`` (made contiguous) into fresh outputs, and return them.

    The outputs' dtypes and shapes are the op table's (``library_outputs``): the same check the worker makes, so a
    bad call fails here, before anything is queued, with the client's InvalidArgument.
    """
    ctx = context_of(*inputs)
    ready = [contiguous(x) for x in inputs]
    params = dict(params or {})
    specs = library_outputs(op, [(dtype_name(x.dtype), x.shape) for x in ready], params)
    outputs = [empty_array(ctx, tuple(shape), np.dtype(dtype)) for dtype, shape in specs]
    if any(o.size for o in outputs):  # else there is nothing to write (and no round trip to make)
        ctx.gpu.run_library(op, [as_ref(x) for x in ready], [as_ref(o) for o in outputs], params)
    return outputs


def read_scalar(x: Array) -> Any:
    """The value of the 0-d (or one-element) array ``x`` as a NumPy scalar, read to the host (it waits)."""
    return to_host(x).reshape(-1)[0]


def read_count(x: Array) -> int:
    """The value of the 0-d integer array ``x``, read to the host: the one wait of a data-dependent shape."""
    return int(read_scalar(x))
