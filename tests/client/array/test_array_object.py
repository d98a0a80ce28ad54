"""The array object: attributes, host conversions (``__array__``, ``__dlpack__``, ``__bool__``...), ``T``/``mT``,
``to_device``, iteration; and one round trip through a real broker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gpubroker.client import RemoteGpu
from gpubroker.client.array import namespace

OpenGpu = Callable[..., RemoteGpu]  # tests/conftest.py's open_gpu fixture


def test_attributes_and_round_trip(xp: Any) -> None:
    host = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    x = xp.asarray(host)
    assert (x.shape, x.ndim, x.size, x.dtype) == ((2, 3, 4), 3, 24, xp.float32)
    assert x.device is xp.__array_namespace_info__().default_device()
    assert x.__array_namespace__() is xp
    np.testing.assert_array_equal(np.asarray(x), host)


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int32", "int64", "uint64", "float32", "float64",
                                   "complex64", "complex128"])
def test_every_dtype_uploads_and_downloads(xp: Any, dtype: str) -> None:
    host = (np.arange(10) % 3).astype(dtype)
    if host.dtype.kind == "c":
        host = host + 1j * host[::-1]
    x = xp.asarray(host)
    assert x.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(x), host)
    np.testing.assert_array_equal(np.asarray(x[::-3]), host[::-3])  # a strided view, made contiguous on device


def test_views_download_their_own_elements(xp: Any) -> None:
    host = np.arange(60, dtype=np.int64).reshape(3, 4, 5)
    x = xp.asarray(host)
    for key in [(slice(None), 1), (Ellipsis, slice(None, None, -2)), (1, slice(None), slice(1, 4)),
                (None, 2, Ellipsis, None), (slice(2, 0, -1), slice(None, None, 3), 4)]:
        np.testing.assert_array_equal(np.asarray(x[key]), host[key])
    np.testing.assert_array_equal(np.asarray(x[0].T), host[0].T)
    np.testing.assert_array_equal(np.asarray(x.mT), np.swapaxes(host, -1, -2))


def test_array_copy_false_and_dtype(xp: Any) -> None:
    x = xp.asarray([1, 2, 3])
    with pytest.raises(ValueError):
        x.__array__(copy=False)
    assert np.asarray(x, dtype=np.float32).dtype == np.float32


def test_dlpack_exports_through_the_host(xp: Any) -> None:
    x = xp.asarray(np.arange(12.0).reshape(3, 4))
    assert x.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(x[:, 1]), np.arange(12.0).reshape(3, 4)[:, 1])
    with pytest.raises(BufferError):
        x.__dlpack__(copy=False)


def test_python_scalars_from_0d(xp: Any) -> None:
    assert bool(xp.asarray(True)) is True
    assert int(xp.asarray(-7)) == -7
    assert float(xp.asarray(2.5)) == 2.5
    assert complex(xp.asarray(1 + 2j)) == 1 + 2j
    assert [10, 20, 30][xp.asarray(1)] == 20  # __index__
    with pytest.raises(TypeError):
        bool(xp.asarray([True, False]))
    with pytest.raises(TypeError):
        int(xp.asarray(1j))
    with pytest.raises(TypeError):
        float(xp.asarray(1j))
    with pytest.raises(TypeError):
        [1][xp.asarray(0.0)]
    with pytest.raises(OverflowError):
        int(xp.asarray(float("inf")))


def test_transpose_needs_two_dimensions(xp: Any) -> None:
    with pytest.raises(ValueError):
        _ = xp.asarray([1, 2]).T
    with pytest.raises(ValueError):
        _ = xp.asarray([1, 2]).mT


def test_to_device(xp: Any) -> None:
    x = xp.asarray([1.0])
    assert x.to_device(x.device) is x
    with pytest.raises(ValueError):
        x.to_device("cpu")


def test_iteration_is_over_the_first_axis(xp: Any) -> None:
    host = np.arange(6).reshape(3, 2)
    rows = list(xp.asarray(host))
    assert len(rows) == 3
    for row, expected in zip(rows, host, strict=True):
        np.testing.assert_array_equal(np.asarray(row), expected)
    with pytest.raises(TypeError):
        iter(xp.asarray(1))


def test_repr_shows_the_values(xp: Any) -> None:
    text = repr(xp.asarray([1.5, 2.5]))
    assert "1.5" in text and "2.5" in text and "float64" in text


def test_hash_is_refused(xp: Any) -> None:
    with pytest.raises(TypeError):
        hash(xp.asarray([1]))


def test_round_trip_through_a_broker(open_gpu: OpenGpu) -> None:
    gpu = open_gpu("alice", "link", async_commands=True)
    try:
        xp = namespace(gpu)
        host = np.arange(30, dtype=np.float32).reshape(5, 6)
        x = xp.asarray(host)
        np.testing.assert_array_equal(np.asarray(x), host)
        view = x[1::2, ::-1].T
        np.testing.assert_array_equal(np.asarray(view), host[1::2, ::-1].T)
        np.testing.assert_array_equal(np.asarray(xp.take(x, xp.asarray([4, 0]), axis=0)), host[[4, 0]])
        np.testing.assert_array_equal(np.asarray(x[x > 12.0]), host[host > 12.0])  # a data-dependent shape
    finally:
        gpu.close()


@pytest.mark.cuda
def test_views_take_and_masks_on_cuda() -> None:
    """The gather kernel's CUDA C (strided copies, take, integer arrays) and a mask, on an in-process CUDA device."""
    from gpubroker.broker.backends import open_backend

    gpu = open_backend("cuda")
    try:
        xp = namespace(gpu)
        host = np.arange(2 * 3 * 4, dtype=np.complex128).reshape(2, 3, 4) * (1 + 1j)
        x = xp.asarray(host)
        np.testing.assert_array_equal(np.asarray(xp.permute_dims(x, (2, 0, 1))), np.transpose(host, (2, 0, 1)))
        np.testing.assert_array_equal(np.asarray(x[:, ::-2, 1]), host[:, ::-2, 1])
        np.testing.assert_array_equal(np.asarray(xp.take(x, xp.asarray([3, -4]), axis=2)), host[:, :, [3, -4]])
        ints = xp.asarray(np.arange(10, dtype=np.int8))
        np.testing.assert_array_equal(np.asarray(ints[xp.asarray([[9, 0], [1, 2]])]), np.array([[9, 0], [1, 2]]))
        np.testing.assert_array_equal(np.asarray(ints[ints > 6]), np.array([7, 8, 9], dtype=np.int8))
        np.testing.assert_array_equal(np.asarray(xp.tile(ints[:2], (3,))), np.tile(np.arange(2, dtype=np.int8), 3))
    finally:
        gpu.close()
