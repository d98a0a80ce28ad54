"""Every device call the array namespace makes, recorded without a device: the proof that a refactor of
``client/array`` changed no kernel source, launch, upload or library call.

A fake GpuCompute (``TraceGpu``) answers ``device_info`` as a CUDA device or an OpenCL one (with or without double
precision, with several work-group limits) and records what it is asked: each compiled source in full, each
launch (kernel, grid, block and every argument: a buffer by its size and offset, a number by its dtype and value),
each upload's bytes, memsets and library calls. Each *case* drives the kernels (``Context.kernels``), the gather
(``_gather.gather``) or the namespace (``xp``) through a broad set of operations, dtypes, shapes, strided views and
reductions on a fresh context, and its trace is digested; ``test_kernel_trace.py`` compares the digests with the
ones checked in (``kernel_trace.json``).

    python -m tests.client.array.kernel_trace --write    # record the digests anew (after an intended change)
    python -m tests.client.array.kernel_trace --dump DIR # each case's whole trace, as files to diff
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import itertools
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from gpubroker.client import Buffer, GpuBrokerError, Kernel
from gpubroker.client.array import namespace
from gpubroker.client.array._context import Context
from gpubroker.client.array._gather import IndexOperand, gather
from gpubroker.client.array._op_table import ELEMENTWISE_OPS

DIGESTS = Path(__file__).with_name("kernel_trace.json")

DTYPES = [np.dtype(n) for n in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                "float32", "float64", "complex64", "complex128")]

# The devices a trace is taken on: (backend, max_threads_per_block, multiprocessor_count, has fp64).
DEVICES = {
    "cuda": ("cuda", 1024, 132, True),
    "opencl": ("opencl", 4096, 2, True),
    "opencl-nofp64": ("opencl", 256, 16, False),
    "opencl-small": ("opencl", 64, 1, True),
}


class TraceGpu:
    """A GpuCompute that runs nothing and writes down every call (a read from the device gives bytes 1, 0, 0, ...)."""

    def __init__(self, device: str) -> None:
        backend, threads, units, fp64 = DEVICES[device]
        self._info = SimpleNamespace(backend=backend, id=0, name=f"trace-{device}", memory_quota=None,
                                     max_threads_per_block=threads, multiprocessor_count=units)
        self._fp64 = fp64
        self._handles = itertools.count()
        self.log: list[str] = []

    def device_info(self) -> Any:
        return self._info

    def allocate_memory(self, size: int) -> Buffer:
        return Buffer(f"m{next(self._handles)}", size)

    def free_memory(self, buf: Buffer) -> None:
        pass  # when a dead array's memory is freed depends on the collector, not on the code under test

    def copy_h2d(self, src: Any, buf: Buffer, offset: int = 0, **_: Any) -> None:
        data = np.ascontiguousarray(src).reshape(-1).view(np.uint8).tobytes()
        shown = data.hex() if len(data) <= 512 else hashlib.sha256(data).hexdigest()
        self.log.append(f"h2d {_buf(buf)} +{offset} {len(data)}B {shown}")

    def copy_d2h(self, buf: Buffer, dst: Any, offset: int = 0, **_: Any) -> None:
        self.log.append(f"d2h {_buf(buf)} +{offset} {np.asarray(dst).nbytes}B")
        host = np.asarray(dst).reshape(-1).view(np.uint8)
        host[:] = 0
        host[:1] = 1  # a count read is 1, a mask's first element True

    def memset(self, buf: Buffer, value: int, size: int | None = None, offset: int = 0, **_: Any) -> None:
        self.log.append(f"memset {_buf(buf)} {value} {size} +{offset}")

    def compile_kernel(self, source: str, name: str, options: Sequence[str] = ()) -> Kernel:
        if not self._fp64 and "cl_khr_fp64" in source:
            self.log.append(f"compile {name} refused (no fp64)")
            raise GpuBrokerError("no double precision on this device")
        self.log.append(f"compile {name} {list(options)}\n{source}")
        return Kernel(f"k{next(self._handles)}", name)

    def execute_kernel(self, kernel: Kernel, grid: Any, block: Any, args: Sequence[Any], **_: Any) -> None:
        self.log.append(f"launch {kernel.name} grid={grid} block={block} " + " ".join(_arg(a) for a in args))

    def run_library(self, op: str, inputs: Sequence[Any], outputs: Sequence[Any], params: Any, **_: Any) -> None:
        refs = [f"{_buf(r.buffer)}:{r.dtype}{list(r.shape)}" for r in (*inputs, *outputs)]
        self.log.append(f"library {op} {refs} {sorted(dict(params).items())}")


def _buf(buf: Buffer) -> str:
    return f"buf[{buf.size}]@{buf.offset}"


def _arg(value: Any) -> str:
    if isinstance(value, Buffer):
        return _buf(value)
    if isinstance(value, np.generic):
        return f"{value.dtype.name}:{value.item()!r}"
    return f"{type(value).__name__}:{value!r}"


def _attempt(log: list[str], what: str, fn: Callable[..., object], *args: Any) -> None:
    """Run ``fn(*args)``, its error (class and message) recorded as part of the trace."""
    log.append(f"-- {what}")
    try:
        fn(*args)
    except (TypeError, ValueError, IndexError, OverflowError, NotImplementedError, KeyError, BufferError,
            GpuBrokerError) as exc:
        log.append(f"raised {type(exc).__name__}: {exc}")


# -- cases through the kernels ------------------------------------------------------------------------------------
def _views(ctx: Context, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Any:
    return ctx.empty(shape, dtype)[1]


def _layouts(ctx: Context, dtype: np.dtype[Any]) -> Iterator[tuple[str, Any]]:
    """Views of one dtype in the layouts the planner tells apart, every one of shape (6, 70)."""
    base = _views(ctx, dtype, (6, 70))
    yield "contiguous", base
    big = _views(ctx, dtype, (70, 6))
    yield "transposed", dataclasses.replace(big, shape=(6, 70), strides=(1, 6))
    yield "repeated", dataclasses.replace(base, strides=(0, 0), offset=3)
    yield "row-broadcast", dataclasses.replace(base, strides=(0, 1), offset=70)
    wide = _views(ctx, dtype, (12, 140))
    yield "every-other", dataclasses.replace(wide, shape=(6, 70), strides=(280, -2), offset=139)


def case_elementwise(device: str, fn: str) -> Iterator[str]:
    gpu = TraceGpu(device)
    ctx = Context(gpu)
    op = ELEMENTWISE_OPS[fn]
    for dtype in DTYPES:
        kinds = op.args or ("T",) * op.arity
        ins = [_views(ctx, np.dtype(np.bool_) if k == "bool" else dtype, (6, 70)) for k in kinds]
        out_dtype = np.dtype(np.bool_) if op.result == "bool" else (
            np.dtype(np.float32 if dtype.itemsize == 8 else np.float64) if op.result == "real" and dtype.kind == "c"
            else dtype)
        out = _views(ctx, out_dtype, (6, 70))
        _attempt(gpu.log, f"{fn} {dtype}", ctx.kernels.elementwise, fn, out, ins, dtype)
    # the layouts and the default compute dtype, on float32 and int16 operands
    for dtype in (np.dtype(np.float32), np.dtype(np.int16)):
        for names in itertools.product([name for name, _ in _layouts(ctx, dtype)], repeat=min(op.arity, 2)):
            views = dict(_layouts(ctx, dtype))
            ins = [views[n] for n in names]
            if op.args:
                ins = [_views(ctx, np.dtype(np.bool_), (6, 70)), *ins, views["contiguous"]][:op.arity]
            while len(ins) < op.arity:
                ins.append(views["contiguous"])
            for out_name in ("contiguous", "transposed"):
                out = dict(_layouts(ctx, np.dtype(np.float64)))[out_name]
                _attempt(gpu.log, f"{fn} {dtype} {names} -> {out_name}",
                         ctx.kernels.elementwise, fn, out, ins)
    # 0-d, 1-d, size-1 dimensions, a 5-d broadcast and an index past 32 bits
    f32 = np.dtype(np.float32)
    scalar = _views(ctx, f32, ())
    vec = _views(ctx, f32, (9,))
    ins = [scalar] * op.arity
    if op.args:
        ins[0] = _views(ctx, np.dtype(np.bool_), ())
    _attempt(gpu.log, f"{fn} 0-d", ctx.kernels.elementwise, fn, _views(ctx, f32, ()), ins, f32)
    five = dataclasses.replace(_views(ctx, f32, (2, 1, 3, 1, 4)), strides=(0, 0, 4, 0, 1))
    ins = [five, *[vec] * (op.arity - 1)] if op.arity == 1 else [five] * op.arity
    if op.args:
        ins[0] = dataclasses.replace(_views(ctx, np.dtype(np.bool_), (2, 1, 3, 1, 4)), strides=(12, 0, 4, 0, 1))
    _attempt(gpu.log, f"{fn} 5-d", ctx.kernels.elementwise, fn, _views(ctx, f32, (2, 1, 3, 1, 4)), ins, f32)
    huge = dataclasses.replace(vec, shape=(2**31 + 3, 2), strides=(1, 2**31 + 3))
    ins = [huge] * op.arity
    if op.args:
        ins[0] = dataclasses.replace(_views(ctx, np.dtype(np.bool_), (9,)), shape=(2**31 + 3, 2), strides=(2, 1))
    _attempt(gpu.log, f"{fn} huge", ctx.kernels.elementwise, fn, dataclasses.replace(
        vec, shape=(2**31 + 3, 2), strides=(2, 1)), ins, f32)
    # a repeat: a cached plan launches with no compile and no upload
    _attempt(gpu.log, f"{fn} huge again", ctx.kernels.elementwise, fn, dataclasses.replace(
        vec, shape=(2**31 + 3, 2), strides=(2, 1)), ins, f32)
    yield from gpu.log


def case_promotions(device: str) -> Iterator[str]:
    """Mixed operand dtypes (the default compute dtype promotes them) and explicit compute dtypes."""
    gpu = TraceGpu(device)
    ctx = Context(gpu)
    for fn in ("add", "multiply", "equal", "less", "maximum", "pow", "atan2", "bitwise_and", "logical_and",
               "floor_divide", "remainder", "abs", "real", "sign"):
        for a, b in itertools.product(DTYPES, repeat=2):
            arity = ELEMENTWISE_OPS[fn].arity
            ins = [_views(ctx, a, (5, 3)), _views(ctx, b, (5, 3))][:arity]
            for out_dtype in (a, np.dtype(np.float64), np.dtype(np.bool_)):
                out = _views(ctx, out_dtype, (5, 3))
                _attempt(gpu.log, f"{fn} {a} {b} -> {out_dtype}", ctx.kernels.elementwise, fn, out, ins)
        for compute in DTYPES:
            ins = [_views(ctx, DTYPES[3], (7,)), _views(ctx, DTYPES[9], (7,))][:ELEMENTWISE_OPS[fn].arity]
            _attempt(gpu.log, f"{fn} in {compute}",
                     ctx.kernels.elementwise, fn, _views(ctx, compute, (7,)), ins, compute)
    _attempt(gpu.log, "no such op", ctx.kernels.elementwise, "nope", _views(ctx, DTYPES[9], (2,)), [])
    _attempt(gpu.log, "wrong arity",
             ctx.kernels.elementwise, "add", _views(ctx, DTYPES[9], (2,)), [_views(ctx, DTYPES[9], (2,))])
    yield from gpu.log


def case_copies(device: str) -> Iterator[str]:
    """``copy`` (astype's cast) between every pair of dtypes, contiguous and strided; scalar arguments."""
    gpu = TraceGpu(device)
    ctx = Context(gpu)
    for src, dst in itertools.product(DTYPES, repeat=2):
        _attempt(gpu.log, f"copy {src} -> {dst}",
                 ctx.kernels.copy, _views(ctx, dst, (4, 5)), _views(ctx, src, (4, 5)))
        s = _views(ctx, src, (5, 4))
        _attempt(gpu.log, f"copy {src} -> {dst} strided", ctx.kernels.copy,
            _views(ctx, dst, (4, 5)), dataclasses.replace(s, shape=(4, 5), strides=(1, 4)))
    ins = [_views(ctx, DTYPES[9], (8,))]
    for scalars in ([np.float32(2.5)], [np.int64(3)], [np.float64(-1.0), np.float32(0.5)]):
        _attempt(gpu.log, f"scalars {scalars}", ctx.kernels.elementwise,
            "copy", _views(ctx, DTYPES[9], (8,)), ins, DTYPES[9], scalars)
    yield from gpu.log


def case_fill_arange(device: str) -> Iterator[str]:
    gpu = TraceGpu(device)
    ctx = Context(gpu)
    for dtype in DTYPES:
        values: list[Any] = [0, 1, True, False, -2.5, 1.5 - 2j, 2**40] if dtype.kind != "b" else [True, False, 0]
        for value in values:
            _attempt(gpu.log, f"fill {dtype} {value!r}", ctx.kernels.fill, _views(ctx, dtype, (3, 5)), value)
        strided = dataclasses.replace(_views(ctx, dtype, (6, 10)), shape=(3, 5), strides=(20, 2), offset=1)
        _attempt(gpu.log, f"fill {dtype} strided", ctx.kernels.fill, strided, 1)
        _attempt(gpu.log, f"fill {dtype} 0-d", ctx.kernels.fill, _views(ctx, dtype, ()), 1)
        _attempt(gpu.log, f"fill {dtype} empty", ctx.kernels.fill, _views(ctx, dtype, (0, 3)), 1)
        for start, step in ((3, 2), (0.5, -0.25), (0, 1)):
            _attempt(gpu.log, f"arange {dtype} {start} {step}",
                     ctx.kernels.arange, _views(ctx, dtype, (7,)), start, step)
        every_other = dataclasses.replace(_views(ctx, dtype, (14,)), shape=(7,), strides=(-2,), offset=13)
        _attempt(gpu.log, f"arange {dtype} strided", ctx.kernels.arange, every_other, 1, 3)
        _attempt(gpu.log, f"arange {dtype} repeat", ctx.kernels.arange, every_other, 1, 3)
    for dtype in (np.dtype(np.float64), np.dtype(np.complex128), np.dtype(np.float32), np.dtype(np.int8)):
        gpu.log.append(f"supports {dtype}: {ctx.kernels.supports(dtype)}")
    yield from gpu.log


REDUCE_FNS = ("sum", "prod", "max", "min", "all", "any", "argmax", "argmin", "sumsq", "count")


def _reduce_out(fn: str, x: np.dtype[Any]) -> list[np.dtype[Any]]:
    if fn in ("argmax", "argmin", "count"):
        return [np.dtype(np.int64)]
    if fn in ("all", "any"):
        return [np.dtype(np.bool_)]
    if fn in ("sum", "prod"):
        return [x, np.dtype(np.int64), np.dtype(np.float64), np.dtype(np.uint64), np.dtype(np.complex64)]
    return [x]


def case_reduce(device: str, fn: str) -> Iterator[str]:
    gpu = TraceGpu(device)
    ctx = Context(gpu)
    for dtype in DTYPES:
        for out_dtype in _reduce_out(fn, dtype):
            x = _views(ctx, dtype, (6, 70))
            center = _views(ctx, dtype, (6,)) if fn == "sumsq" else None
            _attempt(gpu.log, f"{fn} {dtype} -> {out_dtype}",
                     ctx.kernels.reduce, fn, _views(ctx, out_dtype, (6,)), x, (1,), center)
    f32 = np.dtype(np.float32)
    out_dtype = _reduce_out(fn, f32)[0]
    shapes: list[tuple[str, tuple[int, ...], tuple[int, ...] | None, tuple[int, ...], int]] = [
        # (what, x shape, x strides (None: contiguous), axes, x offset)
        ("rows", (6, 70), None, (1,), 0),
        ("columns", (6, 70), None, (0,), 0),
        ("all", (6, 70), None, (0, 1), 0),
        ("middle of 3-d", (4, 5, 6), None, (1,), 0),
        ("outer two of 3-d", (4, 5, 6), None, (0, 1), 0),
        ("ends of 3-d", (4, 5, 6), None, (0, 2), 0),
        ("transposed rows", (6, 70), (1, 6), (1,), 0),
        ("flipped", (6, 70), (-70, -1), (1,), 419),
        ("repeated", (6, 70), (0, 1), (0,), 0),
        ("short rows", (1000, 10), None, (1,), 0),
        ("one long row", (300_001,), None, (0,), 0),
        ("few long rows", (3, 200_000), None, (1,), 0),
        ("long strided", (200_000, 3), None, (0,), 0),
        ("size-1 axes", (1, 70, 1), None, (0, 1), 0),
        ("past 32 bits", (3, 2**31 + 1), None, (1,), 0),
        ("many outputs past 32 bits", (2**31 + 1, 2), None, (1,), 0),
        ("nothing reduced", (6, 70), None, (), 0),
    ]
    for what, shape, strides, axes, offset in shapes:
        x = _views(ctx, f32, shape)
        if strides is not None:
            x = dataclasses.replace(x, strides=strides, offset=offset)
        kept = tuple(s for k, s in enumerate(shape) if k not in axes)
        center = _views(ctx, f32, kept) if fn == "sumsq" else None
        for out_name in ("contiguous", "strided"):
            out = _views(ctx, out_dtype, kept)
            if out_name == "strided" and kept:
                wide = _views(ctx, out_dtype, (*kept[:-1], kept[-1] * 2))
                out = dataclasses.replace(wide, shape=kept, strides=(*wide.strides[:-1], 2), offset=1)
            _attempt(gpu.log, f"{fn} {what} -> {out_name}",
                     ctx.kernels.reduce, fn, out, x, axes, center)
        _attempt(gpu.log, f"{fn} {what} again", ctx.kernels.reduce, fn, out, x, axes, center)
    _attempt(gpu.log, f"{fn} wrong shape",
             ctx.kernels.reduce, fn, _views(ctx, out_dtype, (5,)), _views(ctx, f32, (6, 70)), (1,))
    _attempt(gpu.log, f"{fn} empty output",
             ctx.kernels.reduce, fn, _views(ctx, out_dtype, (0,)), _views(ctx, f32, (0, 70)), (1,))
    yield from gpu.log


def case_reduce_unknown(device: str) -> Iterator[str]:
    gpu = TraceGpu(device)
    ctx = Context(gpu)
    _attempt(gpu.log, "mean", ctx.kernels.reduce, "mean", _views(ctx, DTYPES[9], (6,)),
                                                         _views(ctx, DTYPES[9], (6, 70)), (1,))
    yield from gpu.log


def case_gather(device: str) -> Iterator[str]:
    gpu = TraceGpu(device)
    ctx = Context(gpu)
    for dtype in (DTYPES[0], DTYPES[2], DTYPES[3], DTYPES[4], DTYPES[12]):
        src = _views(ctx, dtype, (6, 70))
        _attempt(gpu.log, f"copy {dtype}", gather, ctx, _views(ctx, dtype, (6, 70)), src)
        _attempt(gpu.log, f"transpose {dtype}", gather,
            ctx, _views(ctx, dtype, (70, 6)), dataclasses.replace(src, shape=(70, 6), strides=(1, 70)))
        deep = dataclasses.replace(_views(ctx, dtype, (2,) * 10), strides=tuple(2**k for k in range(10)))
        _attempt(gpu.log, f"10-d {dtype}", gather, ctx, _views(ctx, dtype, (2,) * 10), deep)
        for index_dtype in (DTYPES[1], DTYPES[4], DTYPES[8]):
            idx = _views(ctx, index_dtype, (5,))
            operand = IndexOperand(dataclasses.replace(idx, shape=(6, 5), strides=(0, 1)), 1, 70)
            _attempt(gpu.log, f"take {dtype} by {index_dtype}", gather,
                ctx, _views(ctx, dtype, (6, 5)), dataclasses.replace(src, shape=(6, 5), strides=(70, 0)), [operand])
    f32 = DTYPES[9]
    _attempt(gpu.log, "sizes differ", gather, ctx, _views(ctx, f32, (3,)), _views(ctx, DTYPES[4], (3,)))
    _attempt(gpu.log, "rank differs", gather, ctx, _views(ctx, f32, (3,)), _views(ctx, f32, (3, 1)))
    _attempt(gpu.log, "empty", gather, ctx, _views(ctx, f32, (0,)), _views(ctx, f32, (0,)))
    yield from gpu.log


# -- cases through the namespace ----------------------------------------------------------------------------------
def case_namespace_names(device: str) -> Iterator[str]:
    """What ``xp`` holds: every name, its kind and signature (bound creation functions lose their ``ctx``)."""
    xp: Any = namespace(TraceGpu(device))
    for owner, obj in (("xp", xp), ("xp.linalg", xp.linalg), ("xp.fft", xp.fft)):
        for name in sorted(dir(obj)):
            if name.startswith("__") and name not in ("__array_api_version__", "__array_namespace_info__"):
                continue
            value = getattr(obj, name)
            if name.startswith("_"):
                yield f"{owner}.{name} {type(value).__name__}"
                continue
            try:
                signature = str(inspect.signature(value)) if callable(value) else (
                    repr(value) if isinstance(value, (str, float, np.dtype, type(None))) else "")
            except (TypeError, ValueError):
                signature = "?"
            yield f"{owner}.{name} {type(value).__name__} {signature}"


# Operations through the namespace (" ; " between them), each evaluated on its own (its error recorded) with the
# arrays of case_namespace: f float32 (4, 6), d of the default real dtype (4, 6), i int32 (4, 6), u uint8 (6,),
# b bool (4, 6), z complex64 (6,).
EXPRESSIONS = """
f + 1 ; 2 * f ; f - i ; i // 3 ; i % 4 ; f / 2 ; f ** 2 ; -f ; +i ; abs(z) ; ~u ; u << 2 ; i >> 1 ; b & True ; b | b
b ^ b ; f @ f.T ; f < 2 ; f <= i ; f > 1.5 ; f >= 0 ; f == f.T.T ; f != 3 ; z == z ; f + 1.5 ; i + 7 ; u + 300
z * 1j ; b + True ; i.__iadd__(1.5) ; inplace(f, i, z) ; f[1:3, ::2] + 1 ; f[::-1, 2] * 2 ; f[None, ..., 1] - 1
f.T + f.T ; f.mT * 1 ; d[-1] + 1 ; xp.sin(f) ; xp.exp(f) ; xp.sqrt(f) ; xp.log1p(f) ; xp.tanh(f) ; xp.round(f)
xp.ceil(f) ; xp.sign(f) ; xp.isnan(f) ; xp.signbit(f) ; xp.square(f) ; xp.reciprocal(f) ; xp.exp(z) ; xp.log(z)
xp.sqrt(z) ; xp.sinh(z) ; xp.acos(z) ; xp.atanh(z) ; xp.real(z) ; xp.imag(z) ; xp.conj(z) ; xp.abs(z) ; xp.sign(z)
xp.atan2(f, d) ; xp.copysign(f, d) ; xp.hypot(f, d) ; xp.logaddexp(f, d) ; xp.maximum(f, d) ; xp.minimum(f, i)
xp.nextafter(f, d) ; xp.pow(f, d) ; xp.remainder(f, d) ; xp.where(b, f, 0.0) ; xp.where(b, i, d) ; xp.where(b, 1, i)
xp.clip(f, 1.0, 5.0) ; xp.clip(i, min=2) ; xp.clip(i, max=2**40) ; xp.clip(f, d, None) ; xp.clip(u, 1, 3)
xp.clip(f) ; xp.bitwise_and(f, f) ; xp.add(i, "x") ; xp.sum(f) ; xp.sum(i, axis=0) ; xp.sum(u, dtype=xp.int16)
xp.prod(f, axis=1) ; xp.max(i, axis=(0, 1)) ; xp.min(f, axis=-1, keepdims=True) ; xp.mean(f, axis=0)
xp.var(f, correction=1) ; xp.std(d, axis=1, keepdims=True) ; xp.argmax(f) ; xp.argmin(i, axis=0, keepdims=True)
xp.argmax(f, keepdims=True) ; xp.count_nonzero(b, axis=1) ; xp.all(b) ; xp.any(b, axis=0) ; xp.sum(z)
xp.max(xp.zeros((0,))) ; xp.sum(f.T, axis=1) ; xp.mean(f[:, ::2]) ; xp.var(f[::-1], axis=0) ; xp.zeros((3, 4))
xp.ones(5, dtype=xp.int8) ; xp.full((2, 2), 7) ; xp.full(3, 2.5j) ; xp.empty((2,)) ; xp.eye(4, 5, k=1)
xp.eye(3, k=-1, dtype=xp.bool) ; xp.arange(10) ; xp.arange(0.5, 3.0, 0.25) ; xp.arange(5, 0, -1, dtype=xp.uint8)
xp.linspace(0, 1, 11) ; xp.linspace(0, 1, 4, endpoint=False) ; xp.linspace(0j, 1 + 1j, 3) ; xp.zeros_like(f)
xp.ones_like(b) ; xp.full_like(i, -1) ; xp.empty_like(z) ; xp.asarray([1, 2, 3]) ; xp.asarray([[1.5, 2.5]])
xp.asarray(True) ; xp.asarray([1j]) ; xp.asarray(f, dtype=xp.float64) ; xp.asarray(f, dtype=xp.int16)
xp.asarray(f, copy=True) ; xp.from_dlpack(np.ones(3)) ; xp.asarray(2**70) ; xp.tril(f) ; xp.triu(f, k=1)
xp.meshgrid(u, u[:3]) ; xp.meshgrid(u, u, indexing="ij") ; xp.astype(f, xp.int8) ; xp.astype(f, xp.bool)
xp.astype(f, xp.complex128) ; xp.astype(f, xp.float32) ; xp.astype(z, xp.complex128) ; xp.astype(z, xp.float32)
xp.astype(b, xp.float32, copy=False) ; xp.reshape(f, (6, 4)) ; xp.reshape(f.T, (24,)) ; xp.concat([f, d])
xp.concat([f, f], axis=None) ; xp.stack([f, f], axis=1) ; xp.flip(f) + 0 ; xp.roll(f, 2, axis=1)
xp.roll(f, (1, -1), axis=(0, 1)) ; xp.repeat(f, 2, axis=0) ; xp.repeat(u, xp.asarray(np.array([1, 0, 2, 1, 1, 3])))
xp.tile(u, (2, 2)) ; xp.squeeze(f[None], axis=0) + 0 ; xp.expand_dims(f, axis=1) + 0 ; xp.moveaxis(f, 0, 1) + 0
xp.broadcast_arrays(f, u[:1]) ; xp.broadcast_to(u, (2, 6)) + 0 ; xp.unstack(f)[1] + 0 ; xp.permute_dims(f, (1, 0)) + 0
f[xp.asarray(np.array([0, 2]))] ; f[:, xp.asarray(np.array([5, 0, 1]))] ; f[1, xp.asarray([0])]
f[xp.asarray(np.array([0, 1])), xp.asarray(np.array([2, 3]))] ; xp.take(f, xp.asarray(np.array([3, 1])), axis=1)
xp.take_along_axis(f, xp.asarray(np.zeros((4, 2), np.int64)), axis=1) ; f[b] ; f[..., 0] + 0 ; f[4] ; setitems(f, i, b)
xp.matmul(f, f.T) ; xp.tensordot(f, f, axes=([1], [1])) ; xp.vecdot(f, f) ; xp.sort(f, axis=0)
xp.argsort(i, descending=True) ; xp.cumulative_sum(i, axis=1) ; xp.cumulative_prod(f, axis=0, include_initial=True)
xp.unique_values(i) ; xp.unique_all(u) ; xp.unique_counts(f) ; xp.unique_inverse(b) ; xp.nonzero(b)
xp.searchsorted(u, u) ; xp.diff(f, n=2, axis=0) ; xp.diff(b) ; xp.diff(u, prepend=u) ; xp.linalg.vector_norm(f)
xp.linalg.vector_norm(f, ord=1, axis=0) ; xp.linalg.vector_norm(f, ord=xp.inf) ; xp.linalg.vector_norm(f, ord=0)
xp.linalg.vector_norm(f, ord=3) ; xp.linalg.matrix_norm(f) ; xp.linalg.matrix_norm(f, ord=1)
xp.linalg.matrix_norm(f, ord=-xp.inf) ; xp.linalg.matrix_norm(f, ord="nuc") ; xp.linalg.outer(u, u)
xp.linalg.trace(f) ; xp.linalg.diagonal(f, offset=1) + 0 ; xp.linalg.cross(f[:, :3], f[:, 3:])
xp.linalg.matrix_power(f[:4, :4], 0) ; xp.linalg.matrix_power(f[:4, :4], 3) ; xp.linalg.matrix_power(d[:, :4], -1)
xp.linalg.solve(f[:, :4], f[:, :2]) ; xp.linalg.svdvals(f) ; xp.linalg.inv(d[:, :4]) ; xp.linalg.det(f[:, :4])
xp.linalg.slogdet(d[:, :4]) ; xp.linalg.qr(f) ; xp.linalg.eigh(d[:, :4]) ; xp.linalg.pinv(f) ; xp.linalg.matrix_rank(f)
xp.linalg.cholesky(d[:, :4]) ; xp.linalg.svd(f) ; xp.fft.fft(z) ; xp.fft.rfft(f, axis=0) ; xp.fft.irfftn(z[None])
xp.fft.fftfreq(8) ; xp.fft.rfftfreq(7, d=0.5) ; xp.fft.fftshift(f) ; xp.fft.ifftshift(f, axes=(0,))
xp.fft.fftn(xp.astype(f, xp.complex64)) ; xp.fft.hfft(z) ; xp.fft.ihfft(f[0]) ; np.asarray(f.T) ; bool(b[0, 0])
float(d[1, 1]) ; int(i[0, 1]) ; repr(u) ; np.asarray(f[::2]) ; f.__dlpack__() ; xp.result_type(f, 1.5)
xp.__array_namespace_info__().dtypes() ; xp.__array_namespace_info__().default_dtypes() ; xp.iinfo(xp.int16)
xp.can_cast(xp.int8, xp.float32) ; xp.finfo(xp.float32) ; xp.isdtype(xp.int8, "integral") ; f.__array_namespace__()
"""


def _inplace(xp: Any, f: Any, i: Any, z: Any) -> None:
    g = xp.asarray(f, copy=True)
    g += 1
    g *= f
    g -= 2.5
    g /= f
    g **= 2
    g @= xp.eye(6, dtype=xp.float32)
    j = xp.asarray(i, copy=True)
    j //= 2
    j %= 3
    j &= 7
    j |= 1
    j ^= 2
    j <<= 1
    j >>= 1
    g[1:3] += g[0:2]  # overlapping: computed aside
    zz = xp.asarray(z, copy=True)
    zz *= 1j


def _setitems(xp: Any, f: Any, i: Any, b: Any) -> None:
    g = xp.asarray(f, copy=True)
    g[0] = 1.5
    g[1:3, ::2] = xp.asarray(np.ones((2, 3), np.float32))
    g[:, 0] = i[:, 1]
    g[b] = 0.0
    g[b[:, 0]] = g[0]
    g[...] = g.T.T
    g[2] = [1, 2, 3, 4, 5, 6]
    j = xp.asarray(i, copy=True)
    j[j > 3] = xp.asarray(np.arange(0, dtype=np.int32))


def case_namespace(device: str) -> Iterator[str]:
    gpu = TraceGpu(device)
    xp: Any = namespace(gpu)
    real = xp.__array_namespace_info__().default_dtypes()["real floating"]  # float32 without double precision
    f = xp.asarray(np.arange(24, dtype=np.float32).reshape(4, 6))
    env = {"xp": xp, "np": np, "f": f, "d": xp.asarray(np.arange(24, dtype=real).reshape(4, 6)),
           "i": xp.asarray(np.arange(24, dtype=np.int32).reshape(4, 6)), "u": xp.asarray(np.arange(6, dtype=np.uint8)),
           "b": xp.asarray(np.arange(24).reshape(4, 6) % 3 == 0),
           "z": xp.asarray((np.arange(6) + 1j).astype(np.complex64))}
    env["inplace"] = lambda *a: _inplace(xp, *a)
    env["setitems"] = lambda *a: _setitems(xp, *a)
    for line in EXPRESSIONS.strip().split("\n"):
        for expression in line.split(" ; "):
            _attempt(gpu.log, expression, eval, expression, env)
    yield from gpu.log


# -- the cases, digested ------------------------------------------------------------------------------------------
def cases() -> dict[str, Callable[[], Iterator[str]]]:
    table: dict[str, Callable[[], Iterator[str]]] = {}
    for device in DEVICES:
        for fn in sorted(ELEMENTWISE_OPS):
            table[f"{device}/elementwise/{fn}"] = lambda d=device, f=fn: case_elementwise(d, f)
        for fn in REDUCE_FNS:
            table[f"{device}/reduce/{fn}"] = lambda d=device, f=fn: case_reduce(d, f)
        table[f"{device}/reduce/unknown"] = lambda d=device: case_reduce_unknown(d)
        table[f"{device}/promotions"] = lambda d=device: case_promotions(d)
        table[f"{device}/copies"] = lambda d=device: case_copies(d)
        table[f"{device}/fill-arange"] = lambda d=device: case_fill_arange(d)
        table[f"{device}/gather"] = lambda d=device: case_gather(d)
        table[f"{device}/namespace"] = lambda d=device: case_namespace(d)
    table["names"] = lambda: case_namespace_names("opencl")
    return table


def trace(case: Callable[[], Iterator[str]]) -> str:
    return "\n".join(case()) + "\n"


def digests() -> dict[str, str]:
    return {name: hashlib.sha256(trace(case).encode()).hexdigest()[:24] for name, case in cases().items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write the digests to {DIGESTS.name}")
    parser.add_argument("--dump", metavar="DIR", help="write each case's whole trace under DIR")
    args = parser.parse_args(argv)
    if args.dump:
        root = Path(args.dump)
        for name, case in cases().items():
            path = root / f"{name}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(trace(case))
        return 0
    found = digests()
    if args.write:
        DIGESTS.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        return 0
    expected = json.loads(DIGESTS.read_text())
    changed = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
    print("\n".join(changed) or "every case's trace is unchanged")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
