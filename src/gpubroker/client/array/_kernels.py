"""Launching the generated kernels: each operation's launch is planned once per signature, compiled once per kernel,
and queued; nothing here waits for the device (compiling a new kernel is the one call that may take a round trip).

How a launch is planned: the operands' views are reduced to the fewest dimensions that address them the same way
(size-1 dimensions dropped, adjacent dimensions merged where every operand's strides allow). One dimension whose
operands are each contiguous or a single repeated element takes the *contiguous* kernel (index ``i`` directly);
anything else takes the *strided* kernel of that many dimensions, which reads the shape and every operand's
strides from a small int64 "meta" array on the device. A plan (kernel, launch size, meta buffer) is cached per
(operation, dtypes, shape, strides), so a loop of same-shaped operations generates, compiles and uploads nothing:
a launch is a dictionary lookup and ``execute_kernel``. The sources come from ``_kernel_source`` (the kernel
families' templates), the operations from ``_op_table`` and ``_reductions``.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from gpubroker.client import GpuBrokerError, GpuCompute, Kernel
from gpubroker.client.array._csource import FP64, PRELUDE
from gpubroker.client.array._dtypes import promote
from gpubroker.client.array._kernel_source import elementwise_source, generated_source, reduce_source
from gpubroker.client.array._memory import Memory, Storage
from gpubroker.client.array._op_table import ELEMENTWISE_OPS, result_dtype
from gpubroker.client.array._reductions import REDUCTIONS
from gpubroker.client.array._views import View, contiguous_strides

__all__ = ["Kernels"]

_PLANS_MAX: Final = 256  # cached launch plans (each may hold a meta buffer on the device)
_SMALL_INDEX: Final = 2**31  # below this many elements the strided kernels decompose indices in 32 bits


@dataclass(slots=True)
class _Plan:
    kernel: Kernel
    grid: int
    block: int
    tail: list[Any]  # the args after the operands': [meta buffer,] element count(s)
    meta: Storage | None  # keeps the meta buffer alive while the plan is cached
    partials: View | None = None  # a split reduction's first pass writes here (see Kernels.reduce)
    partials_storage: Storage | None = None
    # A split reduction that finishes in its one launch (_kernel_source._finish): its outputs' tickets, zero
    # between launches.
    tickets: Storage | None = None


def collapse(shape: tuple[int, ...], strides: Sequence[tuple[int, ...]]) -> tuple[list[int], list[list[int]]]:
    """The fewest dimensions addressing every operand as ``shape`` and ``strides`` do: size-1 dimensions dropped,
    neighbours merged where each operand's outer stride is its inner stride times the inner extent."""
    dims: list[int] = []
    per: list[list[int]] = [[] for _ in strides]
    for k, extent in enumerate(shape):
        if extent == 1:
            continue
        if dims and all(p[-1] == s[k] * extent for p, s in zip(per, strides, strict=True)):
            dims[-1] *= extent
            for p, s in zip(per, strides, strict=True):
                p[-1] = s[k]
            continue
        dims.append(extent)
        for p, s in zip(per, strides, strict=True):
            p.append(s[k])
    return dims, per


class Kernels:
    """The generated kernels of one session: its compiled kernels and cached launch plans."""

    def __init__(self, gpu: GpuCompute, memory: Memory) -> None:
        self._gpu = gpu
        self._memory = memory
        self._lock = threading.Lock()
        self._compiled: dict[tuple[Any, ...], Kernel] = {}
        self._plans: OrderedDict[tuple[Any, ...], _Plan] = OrderedDict()
        self._names = itertools.count()
        self._fp64: bool | None = None
        info = gpu.device_info()
        self._cuda = info.backend == "cuda"
        block = 256
        while block > max(info.max_threads_per_block, 1):
            block //= 2
        self.block = block
        self._grid_cap = max(1, min(65535, max(info.multiprocessor_count, 1) * 32))
        # A split reduction's parts (one work-group each) over all its outputs: one wave of the device's groups
        # (2048 resident work-items per multiprocessor, 8 groups of 256), each part long. A full sum of 8192 x 4096
        # float32 on an H200 (132 SMs), kernel alone: 4224 parts 44.7 us, 2112 43.3, 1056 40.4, 528 45.0, 264 68.2.
        self._parts_cap = max(1, min(65535, max(info.multiprocessor_count, 1) * 8))
        self.compiles = 0  # how many kernels this object compiled (tests check that a repeat compiles none)

    # -- capabilities ------------------------------------------------------------------------------------------
    def supports(self, dtype: np.dtype[Any]) -> bool:
        """Whether the device computes in ``dtype`` (float64 and complex128 need fp64 on OpenCL: probed once)."""
        if self._cuda or dtype.kind not in "fc" or dtype.itemsize * (2 if dtype.kind == "f" else 1) < 16:
            return True
        if self._fp64 is None:
            try:
                src = FP64 + PRELUDE + "KERNEL void gb_probe(GLOBAL F64* o) { o[0] = sqrt(o[0]) + 1.0; }\n"
                self._gpu.compile_kernel(src, "gb_probe")
                self._fp64 = True
            except GpuBrokerError:
                self._fp64 = False
        return self._fp64

    # -- compiling ---------------------------------------------------------------------------------------------
    def _compile(self, key: tuple[Any, ...], make: Callable[[str], str]) -> Kernel:
        kernel = self._compiled.get(key)
        if kernel is None:
            name = f"gb_{next(self._names)}"
            source = make(name)
            kernel = self._gpu.compile_kernel(source, name)
            self.compiles += 1
            self._compiled[key] = kernel
        return kernel

    def _meta(self, values: list[int]) -> Storage:
        meta = np.asarray(values, dtype=np.int64)
        storage = self._memory.allocate(meta.nbytes)
        self._gpu.copy_h2d(meta, storage.buffer)
        return storage

    def _grid(self, n: int) -> int:
        return min(-(-n // self.block), self._grid_cap)

    def _lookup(self, key: tuple[Any, ...]) -> _Plan | None:
        """The cached plan for ``key`` (marked recently used), or None."""
        plan = self._plans.get(key)
        if plan is not None:
            try:
                self._plans.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile: the plan in hand still works
                pass
        return plan

    def _remember(self, key: tuple[Any, ...], plan: _Plan) -> _Plan:
        with self._lock:
            self._plans[key] = plan
            if len(self._plans) > _PLANS_MAX:
                self._plans.popitem(last=False)
        return plan

    # -- elementwise -------------------------------------------------------------------------------------------
    def elementwise(self, fn: str, out: View, inputs: Sequence[View], dtype: np.dtype[Any] | None = None,
                    scalars: Sequence[np.generic] = ()) -> None:
        """``out[i] = fn(inputs[0][i], ...)`` for every index of ``out.shape``; every input is already broadcast
        to ``out.shape`` (stride 0 where it repeats). ``dtype``: the dtype ``fn`` computes in (default: the
        output's where ``fn`` gives its operands' dtype, else the promoted inputs'); each input is converted to it
        as it is read (so a promotion costs no separate copy), and the value to ``out.dtype`` as it is stored."""
        key = (fn, dtype, out.dtype, out.shape, out.strides, *[(v.dtype, v.strides) for v in inputs])
        plan = self._lookup(key)
        if plan is None:
            if out.size == 0:
                return
            plan = self._plan_elementwise(key, fn, out, inputs, dtype, scalars)
        args: list[Any] = [out.buffer, np.int64(out.offset)]
        for v in inputs:
            args.append(v.buffer)
            args.append(np.int64(v.offset))
        args.extend(scalars)
        args.extend(plan.tail)
        self._gpu.execute_kernel(plan.kernel, plan.grid, plan.block, args)

    def _plan_elementwise(self, key: tuple[Any, ...], fn: str, out: View, inputs: Sequence[View],
                          dtype: np.dtype[Any] | None, scalars: Sequence[np.generic]) -> _Plan:
        op = ELEMENTWISE_OPS.get(fn)
        if op is None or op.arity != len(inputs):
            raise ValueError(f"no elementwise operation {fn!r} of {len(inputs)} operand(s)")
        compute = dtype
        if compute is None:
            typed = [v.dtype for v, a in zip(inputs, op.args or ("T",) * op.arity, strict=True) if a == "T"]
            if op.result == "same" and fn != "copy":
                compute = out.dtype
            else:
                compute = typed[0]
                for d in typed[1:]:
                    compute = promote(compute, d)
            if fn == "copy":
                compute = out.dtype
        value_dtype = result_dtype(fn, compute)
        arg_dtypes = [np.dtype(np.bool_) if a == "bool" else compute
                      for a in (op.args or ("T",) * op.arity)]
        dims, per = collapse(out.shape, [out.strides, *[v.strides for v in inputs]])
        n = out.size
        contiguous = len(dims) <= 1 and all(p[0] == 1 for p in per[:1]) if dims else True
        modes: tuple[str, ...] = ()
        if contiguous:
            modes = tuple("c" if not dims or p[0] == 1 else ("s" if p[0] == 0 else "x") for p in per[1:])
            contiguous = "x" not in modes
        small = n < _SMALL_INDEX
        variant: tuple[Any, ...] = ("c", modes) if contiguous else ("s", len(dims), small)
        ckey = ("ew", fn, compute, out.dtype, tuple(v.dtype for v in inputs), tuple(type(s) for s in scalars),
                variant)

        def make(name: str) -> str:
            return elementwise_source(name, fn, compute, value_dtype, out.dtype, [v.dtype for v in inputs],
                                      arg_dtypes, [np.asarray(s).dtype for s in scalars], variant)

        kernel = self._compile(ckey, make)
        tail: list[Any] = []
        meta = None
        if not contiguous:
            meta = self._meta([*dims, *[s for p in per for s in p]])
            tail.append(meta.buffer)
        tail.append(np.int64(n))
        return self._remember(key, _Plan(kernel, self._grid(n), self.block, tail, meta))

    # -- copies and fills --------------------------------------------------------------------------------------
    def copy(self, out: View, src: View) -> None:
        """``out[i] = cast(src[i])``: ``src`` broadcast to ``out.shape``, any dtype to any dtype (astype's rules)."""
        self.elementwise("copy", out, [src], out.dtype)

    def fill(self, out: View, value: bool | int | float | complex) -> None:
        """Every element of ``out`` set to ``value`` (converted to ``out.dtype``)."""
        dt = out.dtype
        scalars: list[np.generic]
        if dt.kind == "c":
            real = np.float32 if dt.itemsize == 8 else np.float64
            z = complex(value)
            scalars = [real(z.real), real(z.imag)]
            fn = "fill_c"
        elif dt.kind == "b":
            scalars = [np.uint8(1 if value else 0)]
            fn = "fill"
        else:
            scalars = [dt.type(value)]
            fn = "fill"
        self._generated(fn, out, scalars)

    def arange(self, out: View, start: int | float, step: int | float) -> None:
        """1-d ``out[i] = start + i * step`` (computed in double precision for floating dtypes where the device has
        it, else in single)."""
        dt = out.dtype
        scalars: list[np.generic]
        if dt.kind in "fc":
            real = np.float64 if self.supports(np.dtype(np.float64)) else np.float32
            scalars = [real(start), real(step)]
        else:
            scalars = [np.int64(start), np.int64(step)]
        self._generated("arange", out, scalars)

    def _generated(self, fn: str, out: View, scalars: list[np.generic]) -> None:
        """A kernel with no array inputs (fill, arange) over ``out``, contiguous or strided."""
        key = (fn, out.dtype, out.shape, out.strides, tuple(type(s) for s in scalars))
        plan = self._lookup(key)
        if plan is None:
            if out.size == 0:
                return
            plan = self._plan_generated(key, fn, out, scalars)
        args: list[Any] = [out.buffer, np.int64(out.offset), *scalars, *plan.tail]
        self._gpu.execute_kernel(plan.kernel, plan.grid, plan.block, args)

    def _plan_generated(self, key: tuple[Any, ...], fn: str, out: View, scalars: list[np.generic]) -> _Plan:
        n = out.size
        if fn == "arange":  # the value depends on the logical index: no collapsing beyond 1-d
            dims, per = ([n], [[out.strides[0]]]) if out.shape else ([], [[]])
        else:
            dims, per = collapse(out.shape, [out.strides])
        contiguous = not dims or (len(dims) == 1 and per[0][0] == 1)
        sdt = [np.asarray(s).dtype for s in scalars]
        variant = "c" if contiguous else len(dims)
        ckey = ("gen", fn, out.dtype, tuple(sdt), variant)

        def make(name: str) -> str:
            return generated_source(name, fn, out.dtype, sdt, None if contiguous else len(dims))

        kernel = self._compile(ckey, make)
        meta = None
        tail: list[Any] = []
        if not contiguous:
            meta = self._meta([*dims, *per[0]])
            tail.append(meta.buffer)
        tail.append(np.int64(n))
        return self._remember(key, _Plan(kernel, self._grid(n), self.block, tail, meta))

    # -- reductions --------------------------------------------------------------------------------------------
    def reduce(self, fn: str, out: View, x: View, axes: tuple[int, ...], center: View | None = None) -> None:
        """``out`` = ``fn`` ("sum", "prod", "max", "min", "all", "any", "argmax", "argmin", "sumsq", "count" (of
        nonzero elements)) of ``x`` over ``axes``; ``out.shape`` is ``x.shape`` without them. "sumsq" sums
        ``(x - center)**2`` where ``center`` has ``out``'s shape (the second pass of var). Sums and products
        accumulate in ``out.dtype``; argmax and argmin give the first occurrence's flat index over ``axes``
        (C order) as int64.

        One work-group per output element: its work-items stride over the reduced elements, each accumulating
        its share, and a tree in shared memory combines the partial values pairwise. Where there are few outputs
        and many elements each (a full ``sum``), each output's elements are split in parts, one work-group each,
        into a buffer of partial values that a second pass reduces: the whole device works, and float sums stay
        close to pairwise. Into a contiguous output (any fresh one), the last work-group of each output's parts
        does that second pass in the same launch: one kernel call, not two, which the client's per-call cost
        feels (a full ``sum``)."""
        cstrides = center.strides if center is not None else None
        key = ("reduce", fn, out.dtype, out.shape, out.strides, x.dtype, x.shape, x.strides, axes, cstrides,
               None if center is None else center.dtype)
        plan = self._lookup(key)
        if plan is None:
            if out.size == 0:
                return
            plan = self._plan_reduce(key, fn, out, x, axes, center)
        partials = plan.partials
        args: list[Any] = [out.buffer if partials is None else partials.buffer,
                           np.int64(out.offset if partials is None else 0), x.buffer, np.int64(x.offset)]
        if center is not None:
            args += [center.buffer, np.int64(center.offset)]
        args.extend(plan.tail)
        if plan.tickets is not None:  # the parts' values are combined in the same launch
            args += [out.buffer, np.int64(out.offset), plan.tickets.buffer]
        self._gpu.execute_kernel(plan.kernel, plan.grid, plan.block, args)
        if partials is not None and plan.tickets is None:
            second = REDUCTIONS[fn].partials  # the reduction of the partial values (a split reduction has one)
            assert second is not None
            self.reduce(second, out, partials, (len(out.shape),))

    def _plan_reduce(self, key: tuple[Any, ...], fn: str, out: View, x: View, axes: tuple[int, ...],
                     center: View | None) -> _Plan:
        if fn not in REDUCTIONS:
            raise ValueError(f"no reduction {fn!r}")
        kept = [k for k in range(len(x.shape)) if k not in axes]
        if tuple(x.shape[k] for k in kept) != out.shape:
            raise ValueError(f"reduction output shape {out.shape} is not {x.shape} without axes {axes}")
        kept_strides = [tuple(x.strides[k] for k in kept), out.strides]
        if center is not None:
            kept_strides.append(center.strides)
        kdims, kper = collapse(out.shape, kept_strides)
        rdims, rper = collapse(tuple(x.shape[k] for k in axes), [tuple(x.strides[k] for k in axes)])
        m = 1
        for k in axes:
            m *= x.shape[k]
        nout = out.size
        block = self.block  # a work-group as small as the reduced extent allows (a row of 10: one warp)
        while block > 32 and block // 2 >= m:
            block //= 2
        contiguous = not rdims or (len(rdims) == 1 and rper[0][0] == 1)  # element j at x's base + j
        parts = 1
        if REDUCTIONS[fn].partials is not None and m >= 32 * self.block:
            parts = min(-(-m // (8 * self.block)), max(1, self._parts_cap // nout))
        # A split reduction into a contiguous output (any fresh one) combines its parts in the same launch.
        finish = parts > 1 and out.strides == contiguous_strides(out.shape)
        variant = (len(kdims), len(rdims), m < _SMALL_INDEX and nout < _SMALL_INDEX, block, contiguous, finish)
        ckey = ("reduce", fn, out.dtype, x.dtype, None if center is None else center.dtype, variant)

        def make(name: str) -> str:
            return reduce_source(name, fn, out.dtype, x.dtype, None if center is None else center.dtype, variant)

        kernel = self._compile(ckey, make)
        partials = partials_storage = tickets = None
        if parts > 1:  # the first pass writes (out.shape..., parts) partial values, contiguous
            partials_storage = self._memory.allocate(nout * parts * out.dtype.itemsize)
            shape = (*out.shape, parts)
            partials = View(partials_storage.buffer, out.dtype, shape, contiguous_strides(shape), 0)
            kept_strides[1] = partials.strides[:-1]
            kdims, kper = collapse(out.shape, kept_strides)
        if finish:
            tickets = self._memory.allocate(4 * nout)
            self._gpu.memset(tickets.buffer, 0, 4 * nout)
        chunk = -(-m // parts)
        meta = self._meta([*kdims, *[s for p in kper for s in p], *rdims, *rper[0], 0])
        tail: list[Any] = [meta.buffer, np.int64(nout), np.int64(m), np.int64(parts), np.int64(chunk),
                           np.int64(1 if parts > 1 else 0)]
        grid = min(nout * parts, 65535)
        return self._remember(key, _Plan(kernel, grid, block, tail, meta, partials, partials_storage, tickets))
