"""Indexing against numpy: basic keys (views), integer arrays, boolean masks, assignment, take."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.array_backends import assert_exact as check

HOST = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)


BASIC_KEYS = [0, -1, (1, 2), (1, 2, 3), (-3, -4, -5), slice(None), slice(1, None), slice(None, None, -1),
              (slice(None), slice(3, 0, -2)), (Ellipsis, 1), (Ellipsis, slice(None, None, 2)),
              (None, 1, None, Ellipsis), (slice(10, 20),), (slice(None), slice(-100, 100)), (2, Ellipsis, None),
              (), Ellipsis, (slice(0, 0), 1), (slice(None), None, slice(None), None)]


@pytest.mark.parametrize("key", BASIC_KEYS, ids=repr)
def test_basic_keys_are_views(xp: Any, key: Any) -> None:
    x = xp.asarray(HOST)
    got = x[key]
    assert got._storage is x._storage
    check(got, HOST[key])


@pytest.mark.parametrize("key", [3, -4, (0, 4), (0, 0, 5), (0, 0, 0, 0), (Ellipsis, Ellipsis), 1.5, "a"], ids=repr)
def test_bad_keys(xp: Any, key: Any) -> None:
    with pytest.raises(IndexError):
        xp.asarray(HOST)[key]


def test_python_bool_key(xp: Any) -> None:
    x = xp.asarray(HOST)
    check(x[True], HOST[True])
    check(x[False], HOST[False])


@pytest.mark.parametrize("key", [
    (np.array([2, 0, -1]),),
    (slice(None), np.array([[3, 0], [1, 1]])),
    (1, np.array([0, 3])),
    (np.array([0, 2]), np.array([1, 3])),
    (np.array([0, 2]), slice(None), np.array([4, 0])),
    (Ellipsis, np.array([4, 4, 0])),
    (np.array([[1], [2]]), np.array([0, 1, 2])),
    (None, slice(1, None), np.array([1])),
], ids=repr)
def test_integer_arrays(xp: Any, key: tuple[Any, ...]) -> None:
    x = xp.asarray(HOST)
    dkey = tuple(xp.asarray(k) if isinstance(k, np.ndarray) else k for k in key)
    check(x[dkey], HOST[key])


@pytest.mark.parametrize("mask_shape", [(3,), (3, 4), (3, 4, 5)])
def test_boolean_masks(xp: Any, mask_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    mask = rng.random(mask_shape) < 0.5
    x = xp.asarray(HOST)
    check(x[xp.asarray(mask)], HOST[mask])
    check(x[xp.asarray(np.zeros(mask_shape, bool))], HOST[np.zeros(mask_shape, bool)])
    check(x[1:][xp.asarray(mask[:2])], HOST[1:][mask[:2]])


def test_mask_of_the_wrong_shape(xp: Any) -> None:
    with pytest.raises(IndexError):
        xp.asarray(HOST)[xp.asarray([True, False])]


def test_setitem_scalars_and_arrays(xp: Any) -> None:
    x = xp.asarray(HOST)
    expected = HOST.copy()
    for key, value in [(0, 1.5), ((slice(None), 1), -2.0), ((Ellipsis, slice(None, None, -2)), 0.0),
                       ((2, 3, 4), 99.0)]:
        x[key] = value
        expected[key] = value
    row = np.arange(5, dtype=np.float32) * 10
    x[1] = xp.asarray(row)
    expected[1] = row
    x[:, ::2, :] = xp.asarray(row)  # broadcast
    expected[:, ::2, :] = row
    check(x, expected)


def test_setitem_overlapping_views(xp: Any) -> None:
    host = np.arange(10)
    x = xp.asarray(host)
    x[1:] = x[:-1]
    host[1:] = host[:-1].copy()
    check(x, host)
    x[::-1] = x
    host[::-1] = host.copy()
    check(x, host)


def test_setitem_checks(xp: Any) -> None:
    x = xp.asarray(np.zeros(4, dtype=np.int32))
    with pytest.raises(TypeError):
        x[0] = 1.5
    with pytest.raises(TypeError):
        x[0] = 1j
    with pytest.raises(IndexError):
        x[4] = 1
    with pytest.raises(ValueError):
        x[:2] = xp.asarray([1, 2, 3], dtype=xp.int32)


def test_setitem_boolean_mask(xp: Any) -> None:
    pytest.importorskip("gpubroker.client.array._elementwise")  # masked assignment is ``where``
    host = HOST.copy()
    x = xp.asarray(host)
    mask = host > 30
    x[xp.asarray(mask)] = -1.0
    host[mask] = -1.0
    check(x, host)


@pytest.mark.parametrize(("shape", "mask", "values"), [
    ((0,), np.True_, np.empty((1, 0), np.float32)),  # one row of no elements (found by the property test)
    ((2, 3), np.True_, np.arange(6, dtype=np.float32).reshape(1, 2, 3)),  # a 0-d mask: x[True] is x[None]
    ((3, 2), np.array([True, False, True]), np.arange(4, dtype=np.float32).reshape(2, 2)),
    ((3, 0), np.array([True, False, True]), np.empty((2, 0), np.float32)),
], ids=["empty-under-0d", "0d-mask", "rows", "rows-of-nothing"])
def test_setitem_mask_with_an_array_per_selected_element(xp: Any, shape: tuple[int, ...], mask: Any,
                                                         values: Any) -> None:
    pytest.importorskip("gpubroker.client.array._elementwise")
    host = np.zeros(shape, np.float32)
    x = xp.asarray(host)
    x[xp.asarray(mask)] = xp.asarray(values)
    host[mask] = values
    check(x, host)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_take(xp: Any, axis: int) -> None:
    indices = np.array([0, 2, -1, 1, 0])
    check(xp.take(xp.asarray(HOST), xp.asarray(indices), axis=axis), np.take(HOST, indices, axis=axis))
    small = np.array([1, 0], dtype=np.int8)
    check(xp.take(xp.asarray(HOST), xp.asarray(small), axis=axis), np.take(HOST, small, axis=axis))


def test_take_1d_and_errors(xp: Any) -> None:
    v = np.arange(7) * 3
    check(xp.take(xp.asarray(v), xp.asarray([6, 0, 3])), v[[6, 0, 3]])
    check(xp.take(xp.asarray(v)[::-2], xp.asarray(np.array([], dtype=np.int64))), v[::-2][[]])
    with pytest.raises(ValueError):
        xp.take(xp.asarray(HOST), xp.asarray([0]))
    with pytest.raises(TypeError):
        xp.take(xp.asarray(v), xp.asarray([0.0]))


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_take_along_axis(xp: Any, axis: int) -> None:
    rng = np.random.default_rng(1)
    shape = list(HOST.shape)
    shape[axis] = 6
    indices = rng.integers(0, HOST.shape[axis], size=shape)
    check(xp.take_along_axis(xp.asarray(HOST), xp.asarray(indices), axis=axis),
          np.take_along_axis(HOST, indices, axis=axis))


def test_take_along_axis_broadcasts(xp: Any) -> None:
    indices = np.array([[[4, 0]]])
    check(xp.take_along_axis(xp.asarray(HOST), xp.asarray(indices), axis=-1),
          np.take_along_axis(HOST, np.broadcast_to(indices, (3, 4, 2)), axis=-1))


def test_out_of_range_index_arrays_stay_in_bounds(xp: Any) -> None:
    """Values outside the axis are clamped on the device: never a read outside the array."""
    got = np.asarray(xp.take(xp.asarray(np.arange(4)), xp.asarray([100, -100])))
    assert set(got.tolist()) <= {0, 1, 2, 3}
