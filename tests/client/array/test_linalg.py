"""matmul, tensordot, vecdot and the linalg extension on an in-process PoCL namespace, against NumPy."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from tests.array_backends import ARRAY_BACKENDS, namespace_on

RNG = np.random.default_rng(14)


@pytest.fixture(scope="module", params=ARRAY_BACKENDS)
def xp(request: pytest.FixtureRequest) -> Any:
    """The namespace on each backend (this module's tests run on CUDA too, under ``-m cuda``)."""
    return namespace_on(request.param)


def rand(*shape: int, dtype: str = "float64") -> np.ndarray[Any, Any]:
    if np.dtype(dtype).kind == "c":
        return (RNG.standard_normal(shape) + 1j * RNG.standard_normal(shape)).astype(dtype)
    if np.dtype(dtype).kind in "iu":
        return RNG.integers(0, 7, shape).astype(dtype)
    return RNG.standard_normal(shape).astype(dtype)


def spd(*shape: int, dtype: str = "float64") -> np.ndarray[Any, Any]:
    """Symmetric (Hermitian) positive-definite matrices of ``shape`` (..., n, n)."""
    a = rand(*shape, dtype=dtype)
    return (a @ np.conj(np.swapaxes(a, -1, -2)) + shape[-1] * np.eye(shape[-1])).astype(dtype)


def close(got: Any, want: Any, rtol: float = 1e-9, atol: float = 1e-9) -> None:
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# -- matmul ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("shape1", "shape2"), [
    ((3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)), ((2, 1, 3, 4), (5, 4, 2)), ((4,), (2, 4, 3)),
    ((2, 3, 4), (4,)), ((3, 0), (0, 2)), ((0, 3), (3, 2)),
])
def test_matmul_shapes_and_values(xp: Any, shape1: tuple[int, ...], shape2: tuple[int, ...]) -> None:
    a, b = rand(*shape1), rand(*shape2)
    close(xp.matmul(xp.asarray(a), xp.asarray(b)), np.matmul(a, b))


@pytest.mark.parametrize(("dtype1", "dtype2"), [("float32", "float32"), ("float32", "float64"),
                                                ("int32", "int32"), ("int8", "int64"), ("complex64", "complex64")])
def test_matmul_dtypes(xp: Any, dtype1: str, dtype2: str) -> None:
    a, b = rand(5, 6, dtype=dtype1), rand(6, 3, dtype=dtype2)
    want = np.matmul(a, b)
    close(xp.asarray(a) @ xp.asarray(b), want, rtol=1e-5, atol=1e-5)


def test_matmul_of_views(xp: Any) -> None:
    a = rand(6, 5)
    x = xp.asarray(a)
    close(x.mT @ x, a.T @ a)
    close(xp.matrix_transpose(x), a.T)
    close(x[::2] @ x[1::2].mT, a[::2] @ a[1::2].T)


def test_matmul_errors(xp: Any) -> None:
    with pytest.raises(ValueError):
        xp.matmul(xp.asarray(rand(3, 4)), xp.asarray(rand(3, 4)))
    with pytest.raises(ValueError):
        xp.matmul(xp.asarray(1.0), xp.asarray(rand(3)))
    with pytest.raises(ValueError):
        xp.matmul(xp.asarray(rand(2, 3, 4)), xp.asarray(rand(3, 4, 2)))  # batch 2 against 3
    with pytest.raises(TypeError):
        xp.matmul(xp.asarray(np.ones((2, 2), bool)), xp.asarray(np.ones((2, 2), bool)))
    with pytest.raises(ValueError):
        xp.matrix_transpose(xp.asarray(rand(3)))


@pytest.mark.parametrize(("shape1", "shape2", "axes"), [
    ((3, 4, 5), (4, 5, 2), 2), ((3, 4), (4, 5), 1), ((2, 3), (4,), 0), ((3, 4, 5), (5, 3), ([0, 2], [1, 0])),
    ((3, 4, 5), (5, 4), ([-1, -2], [0, 1])), ((2, 3), (3, 2), 0),
])
def test_tensordot(xp: Any, shape1: tuple[int, ...], shape2: tuple[int, ...], axes: Any) -> None:
    a, b = rand(*shape1), rand(*shape2)
    close(xp.tensordot(xp.asarray(a), xp.asarray(b), axes=axes), np.tensordot(a, b, axes=axes))
    close(xp.linalg.tensordot(xp.asarray(a), xp.asarray(b), axes=axes), np.tensordot(a, b, axes=axes))


def test_tensordot_errors(xp: Any) -> None:
    a, b = xp.asarray(rand(3, 4)), xp.asarray(rand(5, 4))
    with pytest.raises(ValueError):
        xp.tensordot(a, b, axes=1)
    with pytest.raises(ValueError):
        xp.tensordot(a, b, axes=-1)
    with pytest.raises(ValueError):
        xp.tensordot(a, b, axes=([1], [1, 0]))


@pytest.mark.parametrize(("shape1", "shape2", "axis"), [((5,), (5,), -1), ((3, 5), (5,), -1), ((4, 3), (2, 4, 3), -2),
                                                        ((2, 1, 3), (4, 3), -1)])
def test_vecdot(xp: Any, shape1: tuple[int, ...], shape2: tuple[int, ...], axis: int) -> None:
    a, b = rand(*shape1, dtype="complex128"), rand(*shape2, dtype="complex128")
    want = np.sum(np.conj(a) * b, axis=axis)
    close(xp.vecdot(xp.asarray(a), xp.asarray(b), axis=axis), want)
    close(xp.linalg.vecdot(xp.asarray(a.real), xp.asarray(b.real), axis=axis), np.sum(a.real * b.real, axis=axis))


def test_vecdot_errors(xp: Any) -> None:
    with pytest.raises(ValueError):
        xp.vecdot(xp.asarray(rand(3)), xp.asarray(rand(4)))
    with pytest.raises(ValueError):
        xp.vecdot(xp.asarray(rand(3)), xp.asarray(rand(3)), axis=0)


def test_vecdot_keeps_the_integer_dtype(xp: Any) -> None:
    a, b = rand(4, 3, dtype="int16"), rand(3, dtype="int16")
    close(xp.vecdot(xp.asarray(a), xp.asarray(b)), np.sum(a * b, axis=-1, dtype="int16"))


# -- factorizations and solvers --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "complex128", "float32"])
@pytest.mark.parametrize("stack", [(), (2, 3)])
def test_factorizations(xp: Any, dtype: str, stack: tuple[int, ...]) -> None:
    tol = 1e-4 if dtype == "float32" else 1e-9
    a = spd(*stack, 4, 4, dtype=dtype)
    x = xp.asarray(a)
    close(xp.linalg.cholesky(x), np.linalg.cholesky(a), tol, tol)
    upper = np.asarray(xp.linalg.cholesky(x, upper=True))
    close(np.conj(np.swapaxes(upper, -1, -2)) @ upper, a, tol, tol * 10)
    close(xp.linalg.det(x), np.linalg.det(a), tol, tol)
    close(xp.linalg.inv(x), np.linalg.inv(a), tol, tol)
    sign, logabs = xp.linalg.slogdet(x)
    want_sign, want_logabs = np.linalg.slogdet(a)
    close(sign, want_sign, tol, tol)
    close(logabs, want_logabs, tol, tol)
    values, vectors = xp.linalg.eigh(x)
    close(values, np.linalg.eigvalsh(a), tol, tol)
    recon = (np.asarray(vectors) * np.asarray(values)[..., None, :]) @ np.conj(np.swapaxes(np.asarray(vectors), -1, -2))
    close(recon.astype(dtype), a, tol, tol * 100)
    close(xp.linalg.eigvalsh(x), np.linalg.eigvalsh(a), tol, tol)


@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (2, 4, 4)])
def test_svd_qr_pinv_rank(xp: Any, shape: tuple[int, ...]) -> None:
    a = rand(*shape)
    x = xp.asarray(a)
    u, s, vh = xp.linalg.svd(x, full_matrices=False)
    assert tuple(xp.linalg.svd(x).U.shape) == np.linalg.svd(a).U.shape
    close(s, np.linalg.svd(a, compute_uv=False))
    close(np.asarray(u) * np.asarray(s)[..., None, :] @ np.asarray(vh), a)
    close(xp.linalg.svdvals(x), np.linalg.svd(a, compute_uv=False))
    q, r = xp.linalg.qr(x)
    close(np.asarray(q) @ np.asarray(r), a)
    qc, rc = xp.linalg.qr(x, mode="complete")
    assert qc.shape == np.linalg.qr(a, mode="complete").Q.shape
    close(np.asarray(qc) @ np.asarray(rc), a)
    close(xp.linalg.pinv(x), np.linalg.pinv(a))
    close(xp.linalg.matrix_rank(x), np.linalg.matrix_rank(a).astype("int64"))


def test_matrix_rank_and_pinv_with_rtol(xp: Any) -> None:
    a = np.diag([4.0, 2.0, 1e-3])
    x = xp.asarray(a)
    assert int(np.asarray(xp.linalg.matrix_rank(x))) == 3
    assert int(np.asarray(xp.linalg.matrix_rank(x, rtol=0.01))) == 2
    stacked = xp.asarray(np.stack([a, a]))
    assert np.asarray(xp.linalg.matrix_rank(stacked, rtol=xp.asarray([0.01, 1e-6]))).tolist() == [2, 3]
    close(xp.linalg.pinv(x, rtol=0.01), np.diag([0.25, 0.5, 0.0]))
    close(xp.linalg.pinv(xp.asarray(np.stack([a, a])), rtol=xp.asarray([0.01, 1e-6])),
          np.stack([np.diag([0.25, 0.5, 0.0]), np.linalg.inv(a)]))


@pytest.mark.parametrize(("shape1", "shape2"), [((4, 4), (4,)), ((4, 4), (4, 2)), ((3, 4, 4), (3, 4, 2)),
                                                ((3, 4, 4), (4, 2)), ((4, 4), (2, 4, 3))])
def test_solve(xp: Any, shape1: tuple[int, ...], shape2: tuple[int, ...]) -> None:
    a, b = spd(*shape1), rand(*shape2)
    got = np.asarray(xp.linalg.solve(xp.asarray(a), xp.asarray(b)))
    if b.ndim == 1:
        close(got, np.linalg.solve(a, b))
    else:
        close(a @ got, np.broadcast_to(b, (a @ got).shape), 1e-9, 1e-9)


def test_linalg_type_and_shape_errors(xp: Any) -> None:
    ints = xp.asarray(np.eye(3, dtype="int64"))
    for fn in (xp.linalg.inv, xp.linalg.det, xp.linalg.cholesky, xp.linalg.svd, xp.linalg.eigh, xp.linalg.qr,
               xp.linalg.matrix_norm, xp.linalg.vector_norm):
        with pytest.raises(TypeError):
            fn(ints)
    with pytest.raises(ValueError):
        xp.linalg.inv(xp.asarray(rand(3, 4)))
    with pytest.raises(ValueError):
        xp.linalg.det(xp.asarray(rand(3)))
    with pytest.raises(ValueError):
        xp.linalg.qr(xp.asarray(rand(3, 3)), mode="r")


# -- composed ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("shape1", "shape2", "axis"), [((3,), (3,), -1), ((4, 3), (3,), -1), ((3, 2), (5, 3, 2), -2),
                                                        ((2, 3), (2, 3), -1)])
def test_cross(xp: Any, shape1: tuple[int, ...], shape2: tuple[int, ...], axis: int) -> None:
    a, b = rand(*shape1), rand(*shape2)
    close(xp.linalg.cross(xp.asarray(a), xp.asarray(b), axis=axis), np.cross(a, b, axis=axis))
    ai, bi = rand(*shape1, dtype="int32"), rand(*shape2, dtype="int32")
    close(xp.linalg.cross(xp.asarray(ai), xp.asarray(bi), axis=axis), np.cross(ai, bi, axis=axis))
    with pytest.raises(ValueError):
        xp.linalg.cross(xp.asarray(rand(4)), xp.asarray(rand(4)))


@pytest.mark.parametrize("offset", [0, 1, -2, 5])
def test_diagonal_and_trace(xp: Any, offset: int) -> None:
    a = rand(2, 4, 5)
    close(xp.linalg.diagonal(xp.asarray(a), offset=offset), np.diagonal(a, offset, -2, -1))
    close(xp.linalg.trace(xp.asarray(a), offset=offset), np.trace(a, offset, -2, -1))
    ai = rand(4, 4, dtype="int8")
    close(xp.linalg.trace(xp.asarray(ai), offset=offset), np.trace(ai, offset, dtype="int64"))
    close(xp.linalg.trace(xp.asarray(ai), offset=offset, dtype=xp.int16), np.trace(ai, offset, dtype="int16"))


def test_outer(xp: Any) -> None:
    a, b = rand(4), rand(3, dtype="float32")
    close(xp.linalg.outer(xp.asarray(a), xp.asarray(b)), np.outer(a, b))
    with pytest.raises(ValueError):
        xp.linalg.outer(xp.asarray(rand(2, 2)), xp.asarray(b))


@pytest.mark.parametrize("ord", [2, 1, 0, 3, 0.5, math.inf, -math.inf])
@pytest.mark.parametrize("axis", [None, 1, (0, 2), -1])
def test_vector_norm(xp: Any, ord: float, axis: Any) -> None:
    a = rand(2, 3, 4)
    a[0, 0, 0] = 0
    axes = tuple(range(a.ndim)) if axis is None else (axis,) if isinstance(axis, int) else axis
    axes = tuple(ax % a.ndim for ax in axes)
    rest = [d for d in range(a.ndim) if d not in axes]
    flat = np.transpose(a, rest + list(axes)).reshape(*[a.shape[d] for d in rest], -1)
    want = np.linalg.norm(flat, ord=ord, axis=-1)  # numpy takes two axes as a matrix norm: flatten them first
    close(xp.linalg.vector_norm(xp.asarray(a), axis=axis, ord=ord), want)
    got = np.asarray(xp.linalg.vector_norm(xp.asarray(a), axis=axis, ord=ord, keepdims=True))
    assert got.ndim == 3


@pytest.mark.parametrize("ord", [2, 1, math.inf])
def test_vector_norm_of_complex_is_real(xp: Any, ord: float) -> None:
    a = rand(3, 4, dtype="complex64")
    got = xp.linalg.vector_norm(xp.asarray(a), axis=-1, ord=ord)
    assert got.dtype == xp.float32
    np.testing.assert_allclose(np.asarray(got), np.linalg.norm(a, ord=ord, axis=-1), rtol=1e-5)


@pytest.mark.parametrize("ord", ["fro", "nuc", 1, -1, 2, -2, math.inf, -math.inf])
def test_matrix_norm(xp: Any, ord: Any) -> None:
    a = rand(3, 4, 5)
    close(xp.linalg.matrix_norm(xp.asarray(a), ord=ord), np.linalg.norm(a, ord=ord, axis=(-2, -1)))
    close(xp.linalg.matrix_norm(xp.asarray(a), ord=ord, keepdims=True),
          np.linalg.norm(a, ord=ord, axis=(-2, -1), keepdims=True))


@pytest.mark.parametrize("n", [0, 1, 2, 5, -1, -3])
def test_matrix_power(xp: Any, n: int) -> None:
    a = spd(2, 3, 3) / 4
    close(xp.linalg.matrix_power(xp.asarray(a), n), np.linalg.matrix_power(a, n), 1e-8, 1e-8)
