"""Statistical and utility functions against numpy, on the in-process PoCL namespace: axes, keepdims, dtypes,
NaN, empty and 0-d arrays, strided inputs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

RNG = np.random.default_rng(2024)


def check(actual: Any, expected: Any, rtol: float = 1e-5) -> None:
    got = np.asarray(actual)
    expected = np.asarray(expected)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    if got.dtype.kind in "fc":
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=1e-6, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, expected)


AXES = [None, 0, 1, -1, (0, 2), (2, 0), ()]


@pytest.mark.parametrize("name", ["sum", "prod", "max", "min", "mean", "var", "std"])
@pytest.mark.parametrize("axis", AXES)
def test_float_reductions_match_numpy(xp: Any, name: str, axis: Any) -> None:
    data = RNG.uniform(0.5, 1.5, (3, 5, 4)).astype(np.float32)
    x = xp.asarray(data)
    for keepdims in (False, True):
        expected = getattr(np, name)(data, axis=axis, keepdims=keepdims)
        check(getattr(xp, name)(x, axis=axis, keepdims=keepdims), np.asarray(expected, dtype=np.float32))


def test_sum_and_prod_dtypes(xp: Any) -> None:
    i8 = np.array([[100, 100, 100], [-5, 3, 2]], dtype=np.int8)
    check(xp.sum(xp.asarray(i8), axis=1), i8.sum(axis=1, dtype=np.int64))
    check(xp.sum(xp.asarray(i8.astype(np.uint16))), np.uint64(i8.astype(np.uint16).sum(dtype=np.uint64)))
    check(xp.sum(xp.asarray(i8), dtype=xp.int8), i8.sum(dtype=np.int8))
    check(xp.prod(xp.asarray(i8), axis=0), i8.prod(axis=0, dtype=np.int64))
    check(xp.sum(xp.asarray(np.array([True, True, False]))), np.int64(2))
    f = RNG.standard_normal(1000).astype(np.float32)
    check(xp.sum(xp.asarray(f), dtype=xp.float64), f.astype(np.float64).sum(), rtol=1e-12)
    c = (RNG.standard_normal(50) + 1j * RNG.standard_normal(50)).astype(np.complex64)
    check(xp.sum(xp.asarray(c)), c.sum(), rtol=1e-4)
    check(xp.prod(xp.asarray(c[:5])), c[:5].prod(), rtol=1e-4)


def test_float32_sum_is_accurate_on_many_elements(xp: Any) -> None:
    data = np.full(1 << 20, 0.1, dtype=np.float32)
    got = float(np.asarray(xp.sum(xp.asarray(data))))
    assert abs(got - 0.1 * (1 << 20)) < 1.0  # a sequential float32 sum is off by ~1e3


def test_var_takes_correction_and_is_stable(xp: Any) -> None:
    data = (1e4 + RNG.standard_normal((6, 50))).astype(np.float32)
    check(xp.var(xp.asarray(data), axis=1, correction=1), data.astype(np.float64).var(axis=1, ddof=1)
          .astype(np.float32), rtol=1e-3)
    check(xp.std(xp.asarray(data), correction=1.5), np.float32(data.astype(np.float64).std(ddof=1.5)), rtol=1e-3)
    one = xp.asarray(np.array([3.0], dtype=np.float32))
    assert np.isnan(np.asarray(xp.var(one, correction=1)))


def test_nan_propagates_in_max_min_and_arg_functions(xp: Any) -> None:
    data = np.array([[1.0, np.nan, 3.0, 3.0], [-1.0, -2.0, -2.0, 0.0]], dtype=np.float32)
    x = xp.asarray(data)
    check(xp.max(x, axis=1), np.max(data, axis=1))
    check(xp.min(x, axis=1), np.min(data, axis=1))
    check(xp.argmax(x, axis=1), np.argmax(data, axis=1))
    check(xp.argmin(x, axis=1), np.argmin(data, axis=1))
    check(xp.argmax(x), np.int64(np.argmax(data)))


@pytest.mark.parametrize("dtype", ["int8", "uint32", "int64", "float32"])
def test_arg_functions_give_the_first_occurrence(xp: Any, dtype: str) -> None:
    data = RNG.integers(0, 4, (7, 300)).astype(dtype)  # many ties
    x = xp.asarray(data)
    for axis in (0, 1, -1, None):
        check(xp.argmax(x, axis=axis), np.asarray(np.argmax(data, axis=axis)))
        check(xp.argmin(x, axis=axis), np.asarray(np.argmin(data, axis=axis)))
    check(xp.argmax(x, axis=0, keepdims=True), np.argmax(data, axis=0, keepdims=True))
    check(xp.argmin(x, keepdims=True), np.argmin(data, keepdims=True))
    check(xp.max(x, axis=1), data.max(axis=1))
    check(xp.min(x, axis=0), data.min(axis=0))


def test_reductions_of_strided_views(xp: Any) -> None:
    data = RNG.standard_normal((8, 6, 5)).astype(np.float32)
    x = xp.asarray(data)
    check(xp.sum(xp.permute_dims(x, (2, 0, 1)), axis=0), data.transpose(2, 0, 1).sum(axis=0))
    check(xp.sum(x[::2, 1:, ::-1], axis=(0, 2)), data[::2, 1:, ::-1].sum(axis=(0, 2)))
    check(xp.argmax(x[:, ::-1, 2], axis=1), np.argmax(data[:, ::-1, 2], axis=1))
    check(xp.mean(x[1::3], axis=(1, 2), keepdims=True), data[1::3].mean(axis=(1, 2), keepdims=True))


def test_empty_and_zero_dimensional(xp: Any) -> None:
    empty = xp.asarray(np.zeros((0, 3), dtype=np.float32))
    check(xp.sum(empty, axis=0), np.zeros(3, np.float32))
    check(xp.prod(empty), np.float32(1))
    check(xp.sum(empty, axis=1), np.zeros(0, np.float32))
    assert np.isnan(np.asarray(xp.mean(empty)))
    check(xp.all(empty), np.True_)
    check(xp.any(empty), np.False_)
    with pytest.raises(ValueError):
        xp.max(empty)
    with pytest.raises(ValueError):
        xp.argmin(empty, axis=0)
    check(xp.max(empty, axis=1), np.zeros(0, np.float32))
    scalar = xp.asarray(np.float32(2.5))
    check(xp.sum(scalar), np.float32(2.5))
    check(xp.max(scalar), np.float32(2.5))
    check(xp.argmax(scalar), np.int64(0))
    check(xp.sum(scalar, keepdims=True), np.float32(2.5))


def test_count_nonzero_all_any(xp: Any) -> None:
    data = RNG.integers(-1, 2, (4, 6)).astype(np.int16)
    x = xp.asarray(data)
    check(xp.count_nonzero(x), np.int64(np.count_nonzero(data)))
    check(xp.count_nonzero(x, axis=1, keepdims=True), np.count_nonzero(data, axis=1, keepdims=True).astype(np.int64))
    check(xp.all(x, axis=0), np.all(data, axis=0))
    check(xp.any(x == 1, axis=(0, 1), keepdims=True), np.any(data == 1, axis=(0, 1), keepdims=True))
    c = np.array([0j, 1j, 0j], dtype=np.complex64)
    check(xp.any(xp.asarray(c)), np.True_)
    check(xp.all(xp.asarray(c)), np.False_)


def test_diff(xp: Any) -> None:
    data = RNG.integers(-10, 10, (4, 6)).astype(np.int32)
    x = xp.asarray(data)
    check(xp.diff(x), np.diff(data))
    check(xp.diff(x, axis=0, n=2), np.diff(data, axis=0, n=2))
    check(xp.diff(x, n=0), data)
    check(xp.diff(x, n=7), np.diff(data, n=7))
    pre, app = data[:, :1], data[:, :2]
    check(xp.diff(x, prepend=xp.asarray(pre), append=xp.asarray(app)), np.diff(data, prepend=pre, append=app))
    b = data > 0
    check(xp.diff(xp.asarray(b)), np.diff(b))
    with pytest.raises(ValueError):
        xp.diff(xp.asarray(np.int32(1)))


def test_axis_and_dtype_errors(xp: Any) -> None:
    x = xp.asarray(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises((ValueError, IndexError)):
        xp.sum(x, axis=2)
    with pytest.raises((ValueError, IndexError)):
        xp.sum(x, axis=(0, 0))
    with pytest.raises(TypeError):
        xp.mean(xp.asarray(np.zeros(3, dtype=np.int32)))
    with pytest.raises(TypeError):
        xp.max(xp.asarray(np.zeros(3, dtype=np.complex64)))


def test_split_reductions_finish_in_one_launch_again_and_again(xp: Any) -> None:
    """Reductions of many elements into few outputs split each output's elements in parts, and the last part of
    each output to finish combines them (its ticket, set back to zero for the next launch). Two arrays alternate,
    so a result that was not written would show the other's value, left in the pooled buffer."""
    a = RNG.uniform(-1, 1, (3, 50_000))
    b = RNG.uniform(2, 3, (3, 50_000))
    ints = RNG.integers(-3, 4, 70_000).astype(np.int32)
    xa, xb, xi = xp.asarray(a), xp.asarray(b), xp.asarray(ints)
    for _ in range(3):
        for data, x in ((a, xa), (b, xb)):
            check(xp.sum(x, axis=1), data.sum(axis=1), rtol=1e-9)
            check(xp.sum(x), data.sum(), rtol=1e-9)
            check(xp.max(x, axis=1, keepdims=True), data.max(axis=1, keepdims=True))
            check(xp.var(x, axis=1), data.var(axis=1), rtol=1e-9)
        check(xp.sum(xi), ints.sum(dtype=np.int64))
        check(xp.count_nonzero(xi), np.asarray(np.count_nonzero(ints), dtype=np.int64))
        check(xp.all(xi != 9), np.asarray(True))
        check(xp.any(xi == 9), np.asarray(False))
