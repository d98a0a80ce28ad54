"""The generated kernels (``Kernels``) on the in-process PoCL device: casts, fills, aranges, strided and
broadcast operands, reductions, the compile and plan caches, and the generated source."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from gpubroker.broker.backends import open_backend
from gpubroker.client.array._context import Context
from gpubroker.client.array._csource import ctype, source
from gpubroker.client.array._kernels import collapse
from gpubroker.client.array._op_table import ELEMENTWISE_OPS
from gpubroker.client.array._reductions import REDUCTIONS
from gpubroker.client.array._views import View

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64",
          "complex64", "complex128"]


@pytest.fixture(scope="module")
def ctx() -> Iterator[Context]:
    gpu = open_backend("opencl")
    try:
        yield Context(gpu)
    finally:
        gpu.close()


def upload(ctx: Context, data: np.ndarray[Any, Any]) -> tuple[Any, View]:
    data = np.ascontiguousarray(data)
    storage, view = ctx.empty(data.shape, data.dtype)
    if data.size:
        ctx.gpu.copy_h2d(data, storage.buffer)
    return storage, view


def download(ctx: Context, view: View) -> np.ndarray[Any, Any]:
    """The elements of a contiguous ``view`` (offset 0)."""
    out = np.empty(view.shape, view.dtype)
    if out.size:
        ctx.gpu.copy_d2h(view.buffer, out)
    return out


def test_fill_every_dtype(ctx: Context) -> None:
    for name in DTYPES:
        dt = np.dtype(name)
        value: Any = {"b": True, "c": 1.5 - 2j, "f": -2.25}.get(dt.kind, 7)
        _storage, view = ctx.empty((5, 3), dt)
        ctx.kernels.fill(view, value)
        np.testing.assert_array_equal(download(ctx, view), np.full((5, 3), value, dt), err_msg=name)


@pytest.mark.parametrize(("src", "dst"), [("float32", "int32"), ("int64", "float32"), ("float64", "complex64"),
                                          ("complex128", "float32"), ("int16", "bool"), ("bool", "float64"),
                                          ("complex64", "bool"), ("uint8", "int8"), ("int32", "uint64"),
                                          ("float32", "float32")])
def test_copy_casts_like_astype(ctx: Context, src: str, dst: str) -> None:
    data = (np.arange(-6, 6).reshape(3, 4) * 1.5).astype(src)
    if np.dtype(dst).kind == "u" and np.dtype(src).kind != "b":
        data = np.abs(data)
    _s, view = upload(ctx, data)
    _o, out = ctx.empty((3, 4), np.dtype(dst))
    ctx.kernels.copy(out, view)
    expected = data.real.astype(dst) if np.dtype(src).kind == "c" and np.dtype(dst).kind not in "cb" \
        else data.astype(dst)
    np.testing.assert_array_equal(download(ctx, out), expected)


def test_copy_strided_broadcast_and_offset_views(ctx: Context) -> None:
    data = np.arange(60, dtype=np.int32).reshape(3, 4, 5)
    _s, v = upload(ctx, data)
    cases = [
        (View(v.buffer, v.dtype, (5, 4, 3), (1, 5, 20), 0), data.transpose(2, 1, 0)),
        (View(v.buffer, v.dtype, (3, 2, 5), (20, 10, 1), 5), data[:, 1::2, :]),
        (View(v.buffer, v.dtype, (4, 5), (-5, -1), 59), data[2, ::-1, ::-1]),
        (View(v.buffer, v.dtype, (2, 4, 5), (0, 5, 1), 20), np.broadcast_to(data[1], (2, 4, 5))),
        (View(v.buffer, v.dtype, (), (), 7), data.reshape(-1)[7]),
    ]
    for view, expected in cases:
        _o, out = ctx.empty(expected.shape, np.dtype(np.int64))
        ctx.kernels.copy(out, view)
        np.testing.assert_array_equal(download(ctx, out), expected.astype(np.int64))
    # a strided destination: every other column of a (3, 8) array
    _d, dest = ctx.empty((3, 8), np.dtype(np.float32))
    ctx.kernels.fill(dest, 0.0)
    ctx.kernels.copy(View(dest.buffer, dest.dtype, (3, 4), (8, 2), 1), View(v.buffer, v.dtype, (3, 4), (20, 1), 0))
    expected = np.zeros((3, 8), np.float32)
    expected[:, 1::2] = data[:, 0, :4]
    np.testing.assert_array_equal(download(ctx, dest), expected)


def test_arange(ctx: Context) -> None:
    for name in ("int8", "uint16", "int64", "float32", "float64"):
        _s, view = ctx.empty((7,), np.dtype(name))
        ctx.kernels.arange(view, 3, 2)
        np.testing.assert_array_equal(download(ctx, view), np.arange(3, 17, 2, dtype=name))
    _s, view = ctx.empty((5,), np.dtype(np.float32))
    ctx.kernels.arange(view, 0.5, -0.25)
    np.testing.assert_allclose(download(ctx, view), 0.5 - 0.25 * np.arange(5))


def test_empty_outputs_launch_nothing(ctx: Context) -> None:
    kernels = ctx.kernels
    before = kernels.compiles, len(kernels._plans)
    _s, empty = ctx.empty((0, 4), np.dtype(np.float32))
    kernels.fill(empty, 1.0)
    kernels.copy(empty, empty)
    kernels.elementwise("sin", empty, [empty])
    _x, x = ctx.empty((0, 4), np.dtype(np.float32))
    kernels.reduce("sum", View(empty.buffer, empty.dtype, (0,), (1,)), x, (1,))
    assert (kernels.compiles, len(kernels._plans)) == before


def test_a_second_call_compiles_and_uploads_nothing(ctx: Context) -> None:
    kernels = ctx.kernels
    data = np.arange(24, dtype=np.float32).reshape(4, 6)
    _s, v = upload(ctx, data)
    transposed = View(v.buffer, v.dtype, (6, 4), (1, 6), 0)
    _o, out = ctx.empty((6, 4), np.dtype(np.float32))
    kernels.elementwise("add", out, [transposed, transposed])
    compiled, planned = kernels.compiles, len(kernels._plans)
    uploads = []
    original = ctx.gpu.copy_h2d

    def counting_copy(*args: Any, **kwargs: Any) -> None:
        uploads.append(args)
        original(*args, **kwargs)

    ctx.gpu.copy_h2d = counting_copy  # type: ignore[method-assign]
    try:
        for _ in range(3):
            kernels.elementwise("add", out, [transposed, transposed])
    finally:
        del ctx.gpu.copy_h2d
    assert (kernels.compiles, len(kernels._plans), uploads) == (compiled, planned, [])
    np.testing.assert_array_equal(download(ctx, out), data.T * 2)


def test_collapse_merges_what_addresses_alike() -> None:
    assert collapse((4, 5, 6), [(30, 6, 1), (30, 6, 1)]) == ([120], [[1], [1]])
    assert collapse((4, 1, 6), [(6, 6, 1), (0, 0, 1)]) == ([4, 6], [[6, 1], [0, 1]])
    assert collapse((4, 5, 6), [(30, 6, 1), (0, 0, 0)]) == ([120], [[1], [0]])
    assert collapse((4, 6), [(1, 4), (6, 1)]) == ([4, 6], [[1, 4], [6, 1]])
    assert collapse((1, 1), [(1, 1)]) == ([], [[]])


@pytest.mark.parametrize("dtype", ["int32", "uint8", "float32", "float64", "complex64"])
def test_reductions_every_function(ctx: Context, dtype: str) -> None:
    rng = np.random.default_rng(3)
    data = (rng.integers(0, 3, (6, 70)) + (1j if dtype.startswith("complex") else 0)).astype(dtype)
    _s, x = upload(ctx, data)
    for fn in REDUCTIONS:
        if fn in ("max", "min", "argmax", "argmin") and data.dtype.kind == "c":
            continue
        if fn == "sumsq":
            if data.dtype.kind != "f":
                continue
            center = data.mean(axis=1).astype(dtype)
            _c, cview = upload(ctx, center)
            expected: Any = ((data - center[:, None]) ** 2).sum(axis=1)
        else:
            cview = None
            expected = {"sum": lambda: data.sum(axis=1), "prod": lambda: data.prod(axis=1),
                        "max": lambda: data.max(axis=1), "min": lambda: data.min(axis=1),
                        "all": lambda: data.all(axis=1), "any": lambda: data.any(axis=1),
                        "argmax": lambda: data.argmax(axis=1), "argmin": lambda: data.argmin(axis=1),
                        "count": lambda: np.count_nonzero(data, axis=1)}[fn]()
        expected = np.asarray(expected)
        out_dtype = np.dtype(np.int64) if fn in ("argmax", "argmin", "count") else (
            np.dtype(bool) if fn in ("all", "any") else data.dtype)
        _o, out = ctx.empty((6,), out_dtype)
        ctx.kernels.reduce(fn, out, x, (1,), cview)
        np.testing.assert_allclose(download(ctx, out), expected.astype(out_dtype), rtol=1e-5, err_msg=fn)


def test_split_reduction_of_a_large_array(ctx: Context) -> None:
    data = np.random.default_rng(5).standard_normal(300_001).astype(np.float32)
    _s, x = upload(ctx, data)
    for fn, expected in (("sum", data.astype(np.float64).sum()), ("max", data.max()), ("min", data.min()),
                         ("argmax", data.argmax())):
        dt = np.dtype(np.int64) if fn == "argmax" else np.dtype(np.float32)
        _o, out = ctx.empty((), dt)
        ctx.kernels.reduce(fn, out, x, (0,))
        np.testing.assert_allclose(download(ctx, out), expected, rtol=1e-5, err_msg=fn)


def test_supports_reports_double_precision(ctx: Context) -> None:
    assert ctx.kernels.supports(np.dtype(np.float32))
    assert ctx.kernels.supports(np.dtype(np.int64))
    # PoCL on a CPU has cl_khr_fp64; the probe's answer is cached
    assert ctx.kernels.supports(np.dtype(np.float64)) is ctx.kernels.supports(np.dtype(np.complex128)) is True


def test_generated_source_targets_both_languages() -> None:
    text = source({"F32", "C64", "I64"}, "KERNEL void k(GLOBAL C64* o) { o[0] = C64_exp(o[0]); }\n")
    assert "#ifdef __OPENCL_VERSION__" in text and 'extern "C" __global__' in text
    assert "cl_khr_fp64" not in text  # only where a dtype needs double
    assert "C64_exp" in text and "C64_sqrt" not in text  # only the helpers the kernel uses
    assert "//" not in text.split("KERNEL void k")[0]  # the files' descriptions stay out of the source
    assert "cl_khr_fp64" in source({"F64"}, "KERNEL void k(GLOBAL F64* o) { o[0] = 1; }\n")


def test_operation_table_is_consistent() -> None:
    for name, op in ELEMENTWISE_OPS.items():
        assert op.result in ("same", "bool", "real"), name
        assert set(op.code) <= set("biufc"), name
        assert not op.args or len(op.args) == op.arity, name
        for template in op.code.values():
            used = {p for p in "abc" if "{" + p + "}" in template}
            assert used == set("abc"[:op.arity]) or name in ("imag", "isfinite", "isinf", "isnan"), name
    assert [ctype(np.dtype(d)) for d in DTYPES] == ["U8", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64",
                                                    "F32", "F64", "C64", "C128"]


@pytest.mark.cuda
def test_namespace_on_cuda() -> None:
    """The generated CUDA C compiles and computes what the OpenCL C does (run on a GPU: -m cuda)."""
    from gpubroker.client.array import namespace

    gpu = open_backend("cuda")
    try:
        xp = namespace(gpu)
        data = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
        x = xp.asarray(data)
        np.testing.assert_allclose(np.asarray(xp.exp(x.T) * 2.0 - x.T), np.exp(data.T) * 2 - data.T, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(xp.sum(x, axis=0)), data.sum(axis=0), rtol=1e-4)
        np.testing.assert_allclose(np.asarray(xp.var(x)), data.var(), rtol=1e-4)
        np.testing.assert_array_equal(np.asarray(xp.argmax(x, axis=1)), data.argmax(axis=1))
        z = (data + 1j * data[::-1]).astype(np.complex128)  # (complex64 until the cast: the reference takes z)
        np.testing.assert_allclose(np.asarray(xp.sqrt(xp.asarray(z))), np.sqrt(z), rtol=1e-12)
        i = xp.asarray(np.arange(-8, 8, dtype=np.int64))
        np.testing.assert_array_equal(np.asarray(i // 3), np.arange(-8, 8) // 3)
        np.testing.assert_array_equal(np.asarray(i % 0), np.zeros(16, np.int64))
    finally:
        gpu.close()


def test_through_a_broker_with_queued_commands(open_gpu: Any) -> None:
    """The same kernels through a real broker (the worker compiles and launches them); the array work queues
    (async_commands) and the host conversion waits for it."""
    from gpubroker.client.array import namespace

    gpu = open_gpu("alice", "link", async_commands=True)
    try:
        xp = namespace(gpu)
        data = np.arange(24, dtype=np.float32).reshape(4, 6)
        x = xp.asarray(data)
        y = xp.where(x.mT > 5.0, xp.sqrt(x.mT), -x.mT) + 1
        np.testing.assert_allclose(np.asarray(y), np.where(data.T > 5, np.sqrt(data.T), -data.T) + 1, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(xp.mean(x, axis=0)), data.mean(axis=0), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(xp.argmin(xp.abs(x - 3.5), axis=1)), [3, 0, 0, 0])
        b = xp.asarray(np.array([True, False, True]))
        np.testing.assert_array_equal(np.asarray(xp.logical_xor(b, True)), [False, True, False])
    finally:
        gpu.close()
