"""sort, argsort, the unique functions, nonzero, searchsorted and the cumulative functions on an in-process PoCL
namespace, against NumPy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.array_backends import ARRAY_BACKENDS, namespace_on

RNG = np.random.default_rng(141414)


@pytest.fixture(scope="module", params=ARRAY_BACKENDS)
def xp(request: pytest.FixtureRequest) -> Any:
    """The namespace on each backend (this module's tests run on CUDA too, under ``-m cuda``)."""
    return namespace_on(request.param)


def same(got: Any, want: Any) -> None:
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "int16", "uint8", "float64"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_sort_and_argsort(xp: Any, dtype: str, axis: int) -> None:
    a = RNG.integers(0, 5, (6, 7)).astype(dtype)  # many ties: stability is visible in argsort
    x = xp.asarray(a)
    same(xp.sort(x, axis=axis), np.sort(a, axis=axis))
    same(xp.argsort(x, axis=axis), np.argsort(a, axis=axis, kind="stable").astype("int64"))
    same(xp.sort(x, axis=axis, descending=True), np.flip(np.sort(a, axis=axis), axis=axis))
    # stable descending: equal elements keep their original order
    want = np.flip(np.argsort(np.flip(a, axis=axis), axis=axis, kind="stable"), axis=axis)
    want = a.shape[axis] - 1 - want
    same(xp.argsort(x, axis=axis, descending=True), want.astype("int64"))


def test_sort_nan_last_and_errors(xp: Any) -> None:
    a = np.array([3.0, np.nan, -1.0, 2.0])
    same(xp.sort(xp.asarray(a)), np.sort(a))
    with pytest.raises(TypeError):
        xp.sort(xp.asarray(np.array([1j, 2j])))
    with pytest.raises(IndexError):
        xp.sort(xp.asarray(a), axis=1)


def test_sort_of_a_view_and_empty(xp: Any) -> None:
    a = RNG.standard_normal((4, 6))
    same(xp.sort(xp.asarray(a)[:, ::2]), np.sort(a[:, ::2]))
    same(xp.sort(xp.asarray(np.zeros((0, 3)))), np.zeros((0, 3)))


def test_unique_functions(xp: Any) -> None:
    a = np.array([[3, 1, 3], [2, 1, 7]], dtype="int32")
    x = xp.asarray(a)
    values, indices, inverse, counts = np.unique(a, return_index=True, return_inverse=True, return_counts=True)
    got = xp.unique_all(x)
    same(got.values, values)
    same(got.indices, indices.astype("int64"))
    same(got.inverse_indices, inverse.reshape(a.shape).astype("int64"))
    same(got.counts, counts.astype("int64"))
    got_counts = xp.unique_counts(x)
    same(got_counts.values, values)
    same(got_counts.counts, counts.astype("int64"))
    got_inverse = xp.unique_inverse(x)
    same(got_inverse.inverse_indices, inverse.reshape(a.shape).astype("int64"))
    same(xp.unique_values(x), values)


def test_unique_nans_are_distinct_and_empty(xp: Any) -> None:
    a = np.array([np.nan, 1.0, np.nan, 1.0, 0.5])
    got = np.asarray(xp.unique_values(xp.asarray(a)))
    assert got.shape == (4,)
    same(got[:2], [0.5, 1.0])
    assert np.isnan(got[2:]).all()
    empty = xp.unique_all(xp.asarray(np.zeros(0, "float32")))
    assert [v.shape for v in empty] == [(0,), (0,), (0,), (0,)]


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 2), (0, 3)])
def test_nonzero(xp: Any, shape: tuple[int, ...]) -> None:
    a = RNG.integers(0, 2, shape).astype("float32")
    got = xp.nonzero(xp.asarray(a))
    want = np.nonzero(a)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        same(g, w.astype("int64"))
    with pytest.raises(ValueError):
        xp.nonzero(xp.asarray(1.0))


@pytest.mark.parametrize("side", ["left", "right"])
def test_searchsorted(xp: Any, side: str) -> None:
    sorted_ = np.array([1.0, 2.0, 2.0, 3.0, 5.0])
    values = np.array([[0.0, 2.0], [2.5, 6.0]])
    same(xp.searchsorted(xp.asarray(sorted_), xp.asarray(values), side=side),
         np.searchsorted(sorted_, values, side=side).astype("int64"))
    shuffled = np.array([3.0, 1.0, 5.0, 2.0, 2.0])
    order = np.argsort(shuffled, kind="stable")
    same(xp.searchsorted(xp.asarray(shuffled), xp.asarray(values), side=side, sorter=xp.asarray(order)),
         np.searchsorted(shuffled, values, side=side, sorter=order).astype("int64"))
    with pytest.raises(ValueError):
        xp.searchsorted(xp.asarray(values), xp.asarray(values))


@pytest.mark.parametrize(("dtype", "want_dtype"), [("int8", "int64"), ("uint16", "uint64"), ("float32", "float32"),
                                                   ("int64", "int64")])
@pytest.mark.parametrize("include_initial", [False, True])
def test_cumulative(xp: Any, dtype: str, want_dtype: str, include_initial: bool) -> None:
    a = RNG.integers(1, 4, (3, 4)).astype(dtype)
    x = xp.asarray(a)
    for axis in (0, 1, -1):
        total = np.cumsum(a, axis=axis, dtype=want_dtype)
        product = np.cumprod(a, axis=axis, dtype=want_dtype)
        if include_initial:
            shape = list(a.shape)
            shape[axis] = 1
            total = np.concatenate([np.zeros(shape, want_dtype), total], axis=axis)
            product = np.concatenate([np.ones(shape, want_dtype), product], axis=axis)
        same(xp.cumulative_sum(x, axis=axis, include_initial=include_initial), total)
        same(xp.cumulative_prod(x, axis=axis, include_initial=include_initial), product)


def test_cumulative_dtype_and_axis_rules(xp: Any) -> None:
    a = np.arange(1, 6, dtype="int32")
    same(xp.cumulative_sum(xp.asarray(a)), np.cumsum(a, dtype="int64"))
    same(xp.cumulative_sum(xp.asarray(a), dtype=xp.float32), np.cumsum(a, dtype="float32"))
    with pytest.raises(ValueError):
        xp.cumulative_sum(xp.asarray(np.ones((2, 2))))
    with pytest.raises(TypeError):
        xp.cumulative_prod(xp.asarray(np.ones(3, bool)))


@pytest.mark.parametrize("transport", ["ring", "grpc"])
def test_library_functions_through_a_broker(open_gpu: Any, transport: str) -> None:
    """Through a real broker with queued commands: results stay on the device and come back right; the
    data-dependent shapes (unique, nonzero) wait for their count and go on."""
    from gpubroker.client.array import namespace

    with open_gpu("alice", transport, async_commands=True) as gpu:
        xp = namespace(gpu)
        a = RNG.standard_normal((6, 4))
        x = xp.asarray(a)
        np.testing.assert_allclose(np.asarray(x.mT @ x), a.T @ a, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(np.asarray(xp.linalg.svdvals(x)), np.linalg.svd(a, compute_uv=False), rtol=1e-9)
        same(xp.sort(x, axis=0), np.sort(a, axis=0))
        ints = np.array([4, 1, 4, 0, 1, 4], dtype="int32")
        got = xp.unique_counts(xp.asarray(ints))
        same(got.values, np.array([0, 1, 4], "int32"))
        same(got.counts, np.array([1, 2, 3], "int64"))
        rows, cols = xp.nonzero(xp.asarray(a > 0))
        same(rows, np.nonzero(a > 0)[0].astype("int64"))
        same(cols, np.nonzero(a > 0)[1].astype("int64"))
