"""Kernels generated from one operation table into CUDA C and OpenCL C, compiled once per signature and cached.

(Contract; owned by the kernels work. Every method queues device work on the context's GpuCompute and returns at
once; nothing here waits for the device.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ._context import Context, View

__all__ = ["Kernels"]


class Kernels:
    """The generated kernels of one context (one device session)."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    def supports(self, dtype: np.dtype[Any]) -> bool:
        """Whether the device computes in ``dtype`` (float64 and complex128 need fp64 on OpenCL: probed once)."""
        raise NotImplementedError

    def elementwise(self, fn: str, out: View, inputs: Sequence[View]) -> None:
        """``out[i] = fn(inputs[0][i], ...)`` for every index of ``out.shape``; every input is already broadcast
        to ``out.shape`` (stride 0 where it repeats) and of the dtype the operation table gives for ``fn``."""
        raise NotImplementedError

    def copy(self, out: View, src: View) -> None:
        """``out[i] = cast(src[i])``: ``src`` broadcast to ``out.shape``, any dtype to any dtype (astype's rules)."""
        raise NotImplementedError

    def fill(self, out: View, value: bool | int | float | complex) -> None:
        """Every element of ``out`` set to ``value`` (converted to ``out.dtype``)."""
        raise NotImplementedError

    def arange(self, out: View, start: int | float, step: int | float) -> None:
        """1-d ``out[i] = start + i * step`` (computed in double precision for floating dtypes)."""
        raise NotImplementedError

    def reduce(self, fn: str, out: View, x: View, axes: tuple[int, ...]) -> None:
        """``out`` = ``fn`` ("sum", "prod", "max", "min", "all", "any", "argmax", "argmin", ...) of ``x`` over
        ``axes``; ``out.shape`` is ``x.shape`` without them."""
        raise NotImplementedError
