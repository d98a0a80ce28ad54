"""Manipulation functions against numpy: views share storage, the rest are fresh arrays."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.array_backends import assert_exact as check

HOST = np.arange(2 * 3 * 4, dtype=np.int32).reshape(2, 3, 4)


def shares_storage(a: Any, b: Any) -> bool:
    return a._storage is b._storage


def test_views_share_storage(xp: Any) -> None:
    x = xp.asarray(HOST)
    for view, expected in [(xp.permute_dims(x, (2, 0, 1)), np.transpose(HOST, (2, 0, 1))),
                           (xp.moveaxis(x, 0, -1), np.moveaxis(HOST, 0, -1)),
                           (xp.moveaxis(x, (0, 1), (2, 0)), np.moveaxis(HOST, (0, 1), (2, 0))),
                           (xp.expand_dims(x, axis=1), np.expand_dims(HOST, 1)),
                           (xp.expand_dims(x, axis=-1), np.expand_dims(HOST, -1)),
                           (xp.squeeze(x[:, :1], axis=1), HOST[:, 0]),
                           (xp.flip(x), np.flip(HOST)),
                           (xp.flip(x, axis=(0, 2)), np.flip(HOST, (0, 2))),
                           (xp.broadcast_to(x[:, :1, :], (5, 2, 3, 4)), np.broadcast_to(HOST[:, :1], (5, 2, 3, 4))),
                           (xp.reshape(x, (6, 4)), HOST.reshape(6, 4)),
                           (xp.reshape(x, (-1,)), HOST.reshape(-1)),
                           (xp.reshape(x[:, 1:], (2, 8)), HOST[:, 1:].reshape(2, 8))]:
        assert shares_storage(view, x)
        check(view, expected)


def test_reshape_copies_where_it_must(xp: Any) -> None:
    x = xp.asarray(HOST)
    t = xp.permute_dims(x, (2, 1, 0))
    r = xp.reshape(t, (4, 6))
    assert not shares_storage(r, x)
    check(r, np.transpose(HOST, (2, 1, 0)).reshape(4, 6))
    with pytest.raises(ValueError):
        xp.reshape(t, (24,), copy=False)
    c = xp.reshape(x, (24,), copy=True)
    assert not shares_storage(c, x)
    check(c, HOST.reshape(24))
    check(xp.reshape(xp.asarray(np.zeros((0, 3))), (3, 0)), np.zeros((3, 0)))
    with pytest.raises(ValueError):
        xp.reshape(x, (5, -1))
    with pytest.raises(ValueError):
        xp.reshape(x, (-1, -1))


def test_errors(xp: Any) -> None:
    x = xp.asarray(HOST)
    with pytest.raises(ValueError):
        xp.squeeze(x, axis=0)
    with pytest.raises(ValueError):
        xp.permute_dims(x, (0, 0, 1))
    with pytest.raises(IndexError):
        xp.expand_dims(x, axis=4)
    with pytest.raises(ValueError):
        xp.flip(x, axis=3)
    with pytest.raises(ValueError):
        xp.broadcast_to(x, (3, 3, 4))
    with pytest.raises(ValueError):
        xp.concat([x, x[:, :, :2]], axis=1)


def test_broadcast_arrays(xp: Any) -> None:
    a, b = xp.broadcast_arrays(xp.asarray(HOST[:, :1]), xp.asarray(np.arange(4, dtype=np.int32)))
    ea, eb = np.broadcast_arrays(HOST[:, :1], np.arange(4, dtype=np.int32))
    check(a, ea)
    check(b, eb)


@pytest.mark.parametrize("axis", [0, 1, -1, None])
def test_concat(xp: Any, axis: int | None) -> None:
    x = xp.asarray(HOST)
    parts = [HOST, HOST[:, ::-1] * 2, HOST + 7] if axis is not None else [HOST, HOST[:1]]
    expected = np.concatenate(parts, axis=axis)
    check(xp.concat([xp.asarray(p) for p in parts], axis=axis), expected)
    check(xp.concat((x,), axis=0), HOST)


def test_concat_promotes(xp: Any) -> None:
    pytest.importorskip("gpubroker.client.array._elementwise")  # casts need the generated copy kernel
    got = xp.concat([xp.asarray([1, 2], dtype=xp.int8), xp.asarray([3.5], dtype=xp.float32)])
    check(got, np.array([1, 2, 3.5], dtype=np.float32))


@pytest.mark.parametrize("axis", [0, 2, -1])
def test_stack_and_unstack(xp: Any, axis: int) -> None:
    parts = [HOST, HOST * 3, HOST[::-1]]
    stacked = xp.stack([xp.asarray(p) for p in parts], axis=axis)
    check(stacked, np.stack(parts, axis=axis))
    for got, expected in zip(xp.unstack(stacked, axis=axis), parts, strict=True):
        check(got, expected)


@pytest.mark.parametrize(("repeats", "axis"), [(2, None), (3, 1), (0, 0), (1, -1)])
def test_repeat(xp: Any, repeats: int, axis: int | None) -> None:
    check(xp.repeat(xp.asarray(HOST), repeats, axis=axis), np.repeat(HOST, repeats, axis=axis))


def test_repeat_with_counts(xp: Any) -> None:
    counts = np.array([2, 0, 1], dtype=np.int64)
    check(xp.repeat(xp.asarray(HOST), xp.asarray(counts), axis=1), np.repeat(HOST, counts, axis=1))
    check(xp.repeat(xp.asarray(np.arange(3)), xp.asarray(counts)), np.repeat(np.arange(3), counts))


@pytest.mark.parametrize("reps", [(2,), (2, 1, 3), (1, 2, 1, 2), (0, 1)])
def test_tile(xp: Any, reps: tuple[int, ...]) -> None:
    check(xp.tile(xp.asarray(HOST), reps), np.tile(HOST, reps))


@pytest.mark.parametrize(("shift", "axis"), [(1, None), (-5, None), (2, 2), ((1, -1), (0, 1)), ((1, 2), (2, 2)),
                                             (6, 0)])
def test_roll(xp: Any, shift: Any, axis: Any) -> None:
    check(xp.roll(xp.asarray(HOST), shift, axis=axis), np.roll(HOST, shift, axis=axis))


def test_astype(xp: Any) -> None:
    x = xp.asarray(HOST)
    assert xp.astype(x, xp.int32, copy=False) is x
    same = xp.astype(x, xp.int32)
    assert same is not x
    check(same, HOST)
    with pytest.raises(TypeError):
        xp.astype(xp.asarray([1j]), xp.float64)
    pytest.importorskip("gpubroker.client.array._elementwise")  # casts need the generated copy kernel
    check(xp.astype(x[:, ::2], xp.float32), HOST[:, ::2].astype(np.float32))
    check(xp.astype(xp.asarray([0.0, -2.5]), xp.bool), np.array([False, True]))
