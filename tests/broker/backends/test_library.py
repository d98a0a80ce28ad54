"""run_library on the in-process backends (PoCL; CUDA with -m cuda): every op of the table against NumPy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from gpubroker.broker.backends import open_backend
from gpubroker.client import (
    LIBRARY_OPS,
    ArrayRef,
    GpuCompute,
    InvalidArgument,
    library_outputs,
)
from tests.library_calls import allocate, run_op, upload

Arr = np.ndarray[Any, Any]
rng = np.random.default_rng(14)


@pytest.fixture(scope="module")
def gpu(backend: str) -> Iterator[GpuCompute]:
    device = open_backend(backend)
    yield device
    device.close()


def real(*shape: int, dtype: str = "float64") -> Arr:
    return rng.standard_normal(shape).astype(dtype)


def cplx(*shape: int, dtype: str = "complex128") -> Arr:
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def spd(*shape: int, dtype: str = "float64") -> Arr:
    """A stack of symmetric (Hermitian) positive definite matrices."""
    x = cplx(*shape, dtype=dtype) if dtype.startswith("complex") else real(*shape, dtype=dtype)
    n = shape[-1]
    return (x @ np.conj(np.swapaxes(x, -1, -2)) + n * np.eye(n)).astype(dtype)


def tol(dtype: Any) -> dict[str, float]:
    single = np.dtype(dtype) in (np.float32, np.complex64)
    return {"rtol": 2e-4, "atol": 2e-4} if single else {"rtol": 1e-9, "atol": 1e-9}


def close(got: Arr, want: Arr) -> None:
    assert got.dtype == np.asarray(want).dtype or np.asarray(want).dtype.kind == got.dtype.kind
    assert got.shape == np.shape(want)
    np.testing.assert_allclose(got, want, **tol(got.dtype))


def mT(x: Arr) -> Arr:
    return np.conj(np.swapaxes(x, -1, -2))


# -- ops whose result is unique: compared with NumPy's own function --------------------------------
Case = tuple[str, list[Arr], dict[str, object], Callable[..., Any]]
a34 = real(3, 4, 5, dtype="float32")
spd64 = spd(3, 4, 4)
square = real(2, 5, 5) + 5 * np.eye(5)
tall = real(3, 6, 4)
rank2 = (real(7, 2) @ real(2, 5)).astype("float64")
unsorted = np.array([[3.0, 1, 2, 1, np.nan], [0, -1, 5, 5, 2]])
ties = np.array([2, 1, 2, 1, 3, 2], dtype="int16")
with_nan = np.array([3.0, np.nan, 1, 3, np.nan, -0.0, 0.0, 1])

EXACT: list[Case] = [
    ("matmul", [a34, real(5, 2, dtype="float32")], {}, lambda a, b: a @ b),
    ("matmul", [real(2, 1, 3, 4), real(5, 4, 6)], {}, lambda a, b: a @ b),
    ("matmul", [np.arange(12, dtype="int32").reshape(4, 3), np.arange(6, dtype="int32").reshape(3, 2)], {},
     lambda a, b: a @ b),
    ("matmul", [cplx(3, 2, dtype="complex64"), cplx(2, 4, dtype="complex64")], {}, lambda a, b: a @ b),
    ("matmul", [real(3, 0), real(0, 4)], {}, lambda a, b: a @ b),
    ("matmul", [real(0, 2, 3), real(3, 4)], {}, lambda a, b: a @ b),
    ("linalg.cholesky", [spd64], {}, np.linalg.cholesky),
    ("linalg.cholesky", [spd64], {"upper": True}, lambda x: mT(np.linalg.cholesky(x))),
    ("linalg.cholesky", [spd(2, 3, 3, dtype="complex64")], {}, np.linalg.cholesky),
    ("linalg.det", [square], {}, np.linalg.det),
    ("linalg.det", [real(2, 0, 0)], {}, np.linalg.det),
    ("linalg.det", [cplx(4, 4)], {}, np.linalg.det),
    ("linalg.eigvalsh", [spd(3, 5, 5, dtype="float32")], {}, np.linalg.eigvalsh),
    ("linalg.inv", [square], {}, np.linalg.inv),
    ("linalg.inv", [square.astype("float32")], {}, np.linalg.inv),
    ("linalg.pinv", [tall], {}, np.linalg.pinv),
    ("linalg.pinv", [rank2], {"rtol": 0.5}, lambda x: np.linalg.pinv(x, rtol=0.5)),
    ("linalg.pinv", [real(3, 0)], {}, np.linalg.pinv),
    ("linalg.slogdet", [square], {}, lambda x: list(np.linalg.slogdet(x))),
    ("linalg.slogdet", [cplx(2, 3, 3, dtype="complex64")], {}, lambda x: list(np.linalg.slogdet(x))),
    ("linalg.solve", [square, real(5)], {}, lambda a, b: np.linalg.solve(a, b)),
    ("linalg.solve", [square, real(2, 5, 3)], {}, np.linalg.solve),
    ("linalg.solve", [square, real(5, 3)], {}, np.linalg.solve),
    ("linalg.svdvals", [tall], {}, np.linalg.svdvals),
    ("linalg.svdvals", [real(0, 3)], {}, np.linalg.svdvals),
    ("linalg.matrix_rank", [np.stack([rank2, real(7, 5)])], {}, np.linalg.matrix_rank),
    ("linalg.matrix_rank", [rank2], {"rtol": 0.9}, lambda x: np.linalg.matrix_rank(x, rtol=0.9)),
    ("linalg.matrix_rank", [real(0, 4)], {}, lambda x: np.int64(0)),
    ("fft.fft", [cplx(3, 8, dtype="complex64")], {}, np.fft.fft),
    ("fft.fft", [cplx(6, 2)], {"n": 9, "axis": 0, "norm": "ortho"}, lambda x: np.fft.fft(x, 9, 0, "ortho")),
    ("fft.fft", [cplx(0, 4)], {}, np.fft.fft),
    ("fft.ifft", [cplx(10)], {"n": 4, "norm": "forward"}, lambda x: np.fft.ifft(x, 4, norm="forward")),
    ("fft.rfft", [real(4, 9, dtype="float32")], {}, np.fft.rfft),
    ("fft.irfft", [cplx(3, 5)], {}, np.fft.irfft),
    ("fft.irfft", [cplx(3, 5)], {"n": 7}, lambda x: np.fft.irfft(x, 7)),
    ("fft.hfft", [cplx(6, dtype="complex64")], {}, np.fft.hfft),
    ("fft.ihfft", [real(2, 7)], {"axis": 0}, lambda x: np.fft.ihfft(x, axis=0)),
    ("fft.fftn", [cplx(3, 4, 5)], {}, np.fft.fftn),
    ("fft.fftn", [cplx(3, 4, 5)], {"s": [6, -1], "axes": [0, 2]},
     lambda x: np.fft.fftn(x, s=[6, 5], axes=[0, 2])),
    ("fft.ifftn", [cplx(4, 4, dtype="complex64")], {"norm": "ortho"}, lambda x: np.fft.ifftn(x, norm="ortho")),
    ("fft.rfftn", [real(4, 6, 5)], {"axes": [1, 0]}, lambda x: np.fft.rfftn(x, axes=[1, 0])),
    ("fft.irfftn", [cplx(4, 6, 5)], {"s": [4, 9]},  # the last len(s) axes
     lambda x: np.fft.irfftn(x, s=[4, 9], axes=[1, 2])),
    ("fft.irfftn", [cplx(4, 6)], {}, np.fft.irfftn),
    ("sort", [unsorted], {}, lambda x: np.sort(x)),
    ("sort", [unsorted], {"axis": 0, "descending": True}, lambda x: np.flip(np.sort(x, axis=0), axis=0)),
    ("sort", [np.array([True, False, True])], {}, np.sort),
    ("sort", [np.zeros((2, 0), dtype="uint8")], {}, np.sort),
    ("argsort", [ties], {}, lambda x: np.argsort(x, kind="stable")),
    # Stable descending keeps equal elements in their original order: the 2s at 0, 2, 5.
    ("argsort", [ties], {"descending": True}, lambda x: np.array([4, 0, 2, 5, 1, 3])),
    ("argsort", [unsorted.T.copy()], {"axis": 0, "descending": True, "stable": False},
     lambda x: (x.shape[0] - 1) - np.flip(np.argsort(np.flip(x, 0), axis=0, kind="stable"), 0)),
    ("searchsorted", [np.array([1.0, 2, 2, 5]), np.array([[0.0, 2], [5, 9]])], {},
     lambda a, b: np.searchsorted(a, b)),
    ("searchsorted", [np.array([1, 2, 2, 5], "int32"), np.array([2, 5], "int32")], {"side": "right"},
     lambda a, b: np.searchsorted(a, b, side="right")),
    ("cumulative_sum", [np.arange(12, dtype="int8").reshape(3, 4)], {"axis": 1},
     lambda x: np.cumulative_sum(x, axis=1, dtype="int64")),
    ("cumulative_sum", [real(5)], {"include_initial": True}, lambda x: np.cumulative_sum(x, include_initial=True)),
    ("cumulative_sum", [np.array([True, False, True])], {}, lambda x: np.cumulative_sum(x, dtype="int64")),
    ("cumulative_sum", [real(3, 4, dtype="float32")], {"axis": 0, "include_initial": True, "dtype": "float64"},
     lambda x: np.cumulative_sum(x, axis=0, include_initial=True, dtype="float64")),
    ("cumulative_prod", [np.arange(1, 7, dtype="uint16").reshape(2, 3)], {"axis": -1, "include_initial": True},
     lambda x: np.cumulative_prod(x, axis=-1, include_initial=True, dtype="uint64")),
    ("cumulative_prod", [real(0, 3)], {"axis": 0, "include_initial": True},
     lambda x: np.ones((1, 3))),
    ("count_unique", [with_nan], {}, lambda x: np.int64(5)),  # -0.0 == 0.0; each NaN distinct
    ("count_unique", [np.zeros(0, "int32")], {}, lambda x: np.int64(0)),
    ("unique_values", [with_nan], {"count": 5}, np.unique_values),
    ("unique_counts", [ties.reshape(2, 3)], {"count": 3}, lambda x: list(np.unique_counts(x))),
    ("unique_inverse", [ties.reshape(3, 2)], {"count": 3}, lambda x: list(np.unique_inverse(x))),
    ("unique_all", [with_nan.reshape(2, 4)], {"count": 5}, lambda x: list(np.unique_all(x))),
    ("unique_all", [np.zeros((0, 2), "float32")], {"count": 0}, lambda x: list(np.unique_all(x))),
    ("unique_values", [np.array(7, "uint32")], {"count": 1}, lambda x: np.array([7], "uint32")),
    ("nonzero", [np.array([[0, 1, 0], [2, 0, 3]])], {"count": 3}, lambda x: np.stack(np.nonzero(x))),
    ("nonzero", [np.zeros(4, bool)], {"count": 0}, lambda x: np.zeros((1, 0), "int64")),
    ("compress", [real(3, 4), real(3, 4) > 0], {"count": 0}, None),  # count filled in below
    ("compress", [real(3, 4), np.array([True, False, True])], {"count": 2}, lambda x, m: x[m]),
]
# The compress case's count is the data's.
_x, _m = EXACT[-2][1]
EXACT[-2] = ("compress", [_x, _m], {"count": int(_m.sum())}, lambda x, m: x[m])


@pytest.mark.parametrize(("op", "arrays", "params", "reference"), EXACT,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(EXACT)])
def test_op_matches_numpy(gpu: GpuCompute, op: str, arrays: list[Arr], params: dict[str, object],
                          reference: Callable[..., Any]) -> None:
    got = run_op(gpu, op, arrays, params)
    want = reference(*arrays)
    wants = want if isinstance(want, list) else [want]
    assert len(got) == len(wants)
    for g, w in zip(got, wants, strict=True):
        w = np.asarray(w)
        if g.dtype.kind in "iub":
            assert g.shape == w.shape
            np.testing.assert_array_equal(g, w)
        else:
            close(g, w)


def test_every_op_is_tested() -> None:
    tested = {case[0] for case in EXACT} | {"linalg.eigh", "linalg.qr", "linalg.svd"}
    assert tested == set(LIBRARY_OPS)


# -- factorizations, unique up to signs or phases: checked by their defining properties --------------------
@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64", "complex128"])
def test_eigh(gpu: GpuCompute, dtype: str) -> None:
    x = spd(2, 5, 5, dtype=dtype)
    values, vectors = run_op(gpu, "linalg.eigh", [x])
    assert values.dtype == np.dtype(dtype).type(0).real.dtype and vectors.dtype == dtype
    close(values, np.linalg.eigvalsh(x))
    close(x @ vectors, vectors * values[..., None, :])


@pytest.mark.parametrize("mode", ["reduced", "complete"])
@pytest.mark.parametrize("shape", [(3, 6, 4), (4, 6), (2, 0)])
def test_qr(gpu: GpuCompute, mode: str, shape: tuple[int, ...]) -> None:
    x = real(*shape)
    q, r = run_op(gpu, "linalg.qr", [x], {"mode": mode})
    q_ref, r_ref = np.linalg.qr(x, mode=mode)
    assert q.shape == q_ref.shape and r.shape == r_ref.shape
    close(q @ r, x)
    close(mT(q) @ q, np.broadcast_to(np.eye(q.shape[-1]), q.shape[:-2] + (q.shape[-1],) * 2))
    np.testing.assert_array_equal(np.tril(r, -1), 0)


@pytest.mark.parametrize("full_matrices", [True, False])
@pytest.mark.parametrize(("shape", "dtype"), [((3, 6, 4), "float64"), ((5, 3), "complex64"), ((3, 0), "float32")])
def test_svd(gpu: GpuCompute, full_matrices: bool, shape: tuple[int, ...], dtype: str) -> None:
    x = cplx(*shape, dtype=dtype) if dtype.startswith("complex") else real(*shape, dtype=dtype)
    u, s, vh = run_op(gpu, "linalg.svd", [x], {"full_matrices": full_matrices})
    u_ref, s_ref, vh_ref = np.linalg.svd(x, full_matrices=full_matrices)
    assert (u.shape, s.shape, vh.shape) == (u_ref.shape, s_ref.shape, vh_ref.shape)
    close(s, s_ref)
    k = s.shape[-1]
    close((u[..., :k] * s[..., None, :]) @ vh[..., :k, :], x)


# -- refusals ---------------------------------------------------------------------------------------
def refs(gpu: GpuCompute, op: str, arrays: list[Arr], params: dict[str, object] | None = None
         ) -> tuple[list[ArrayRef], list[ArrayRef]]:
    buffers: list[Any] = []
    inputs = [upload(gpu, a, buffers) for a in arrays]
    outputs = [allocate(gpu, d, s, buffers) for d, s in library_outputs(op, [(r.dtype, r.shape) for r in inputs],
                                                                        params)]
    return inputs, outputs


def test_data_dependent_sizes_are_checked(gpu: GpuCompute) -> None:
    x = np.array([1.0, 2, 2, 3])
    with pytest.raises(InvalidArgument, match=r"^unique_values: the result has 3 element\(s\), the outputs are "
                                              r"sized for 2"):
        run_op(gpu, "unique_values", [x], {"count": 2})
    with pytest.raises(InvalidArgument, match=r"^nonzero: the result has 4"):
        run_op(gpu, "nonzero", [x], {"count": 1})
    with pytest.raises(InvalidArgument, match=r"^compress: the result has 1"):
        run_op(gpu, "compress", [x, x > 2.5], {"count": 4})
    close(run_op(gpu, "unique_values", [x], {"count": 3})[0], np.array([1.0, 2, 3]))  # the backend still works


def test_calls_are_checked_against_the_table_and_the_buffers(gpu: GpuCompute) -> None:
    x = real(4, 4)
    inputs, outputs = refs(gpu, "linalg.inv", [x])
    (out,) = outputs
    for bad_outputs, message in [
        ([ArrayRef(out.buffer, "float32", (4, 4))], r"output 0 must be float64 of shape \(4, 4\), got float32"),
        ([ArrayRef(out.buffer, "float64", (2, 4))], "output 0 must be float64"),
        ([], "writes 1 output"),
        ([ArrayRef(out.buffer.at(8), "float64", (4, 4))], "outputs\\[0\\] .* overruns its"),
        ([ArrayRef(out.buffer, "float128", (4, 4))], r"outputs\[0\] has an unknown dtype"),
        ([ArrayRef(out.buffer, "float64", (4, -4))], r"outputs\[0\] shape \(4, -4\) must hold ints >= 0"),
        (["not an array"], r"outputs\[0\] must be an ArrayRef"),
    ]:
        with pytest.raises(InvalidArgument, match=f"^linalg.inv: {message}"):
            gpu.run_library("linalg.inv", inputs, bad_outputs)
    for op, params, message in [
        ("linalg.inv", {"upper": True}, "^linalg.inv: unknown param 'upper'"),
        ("linalg.cholesky", {"upper": 1}, "^linalg.cholesky: param 'upper' must be a bool"),
        ("linalg.pinv", {"rtol": float("nan")}, "^linalg.pinv: param 'rtol' must be a finite float"),
        ("linalg.qr", {"mode": "r"}, "^linalg.qr: param 'mode' must be one of"),
        ("linalg.det ", {}, "^unknown library op 'linalg.det '"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            gpu.run_library(op, inputs, outputs, params)
    with pytest.raises(InvalidArgument, match=r"^linalg.inv: x must be a stack of square matrices"):
        gpu.run_library("linalg.inv", [ArrayRef(inputs[0].buffer, "float64", (2, 8))], outputs)
    gpu.run_library("linalg.inv", inputs, outputs)  # the good call still runs
    # A call whose dtypes, shapes and params passed before is remembered (wire/library.py's _CALLS_SEEN): only its
    # buffers are checked again, as strictly as the first time.
    with pytest.raises(InvalidArgument, match=r"^linalg.inv: outputs\[0\] .* overruns its"):
        gpu.run_library("linalg.inv", inputs, [ArrayRef(out.buffer.at(8), "float64", (4, 4))])
    with pytest.raises(InvalidArgument, match=r"^linalg.inv: inputs\[0\] must be an ArrayRef"):
        gpu.run_library("linalg.inv", [ArrayRef("not a buffer", "float64", (4, 4))], outputs)  # type: ignore[arg-type]
    gpu.run_library("linalg.inv", inputs, outputs)
    gpu.synchronize()


def test_singular_matrix(gpu: GpuCompute, backend: str) -> None:
    singular = np.ones((3, 3))
    if backend == "opencl":  # LAPACK reports it; cuSOLVER (through CuPy) answers NaN, which the standard allows
        with pytest.raises(InvalidArgument, match=r"^linalg.inv: Singular matrix"):
            run_op(gpu, "linalg.inv", [singular])
    else:
        assert not np.isfinite(run_op(gpu, "linalg.inv", [singular])[0]).all()


def test_on_a_stream(gpu: GpuCompute) -> None:
    stream = gpu.create_stream()
    a, b = real(8, 8), real(8, 3)
    (got,) = run_op(gpu, "matmul", [a, b], stream=stream)
    close(got, a @ b)
    gpu.destroy_stream(stream)


def test_library_time_is_device_time(gpu: GpuCompute) -> None:
    take = gpu.take_device_time  # type: ignore[attr-defined]  # every backend has it; GpuCompute does not
    take()
    x = real(256, 256)
    run_op(gpu, "linalg.svd", [x])
    assert take() > 0.0


def test_an_empty_result_still_checks_a_data_dependent_size(gpu: GpuCompute) -> None:
    with pytest.raises(InvalidArgument, match=r"^nonzero: the result has 2 element\(s\), the outputs are sized for 0"):
        run_op(gpu, "nonzero", [np.array([0, 1, 1])], {"count": 0})
    with pytest.raises(InvalidArgument, match=r"^compress: the result has 1 element\(s\)"):
        run_op(gpu, "compress", [np.array([0, 1, 1]), np.array([True, False, False])], {"count": 0})
