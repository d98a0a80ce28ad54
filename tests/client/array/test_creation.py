"""Creation functions against numpy, on the in-process PoCL namespace."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest


def check(actual: Any, expected: np.ndarray[Any, Any]) -> None:
    host = np.asarray(actual)
    assert host.dtype == expected.dtype, (host.dtype, expected.dtype)
    assert host.shape == expected.shape, (host.shape, expected.shape)
    np.testing.assert_allclose(host, expected, rtol=1e-12, atol=0)


def test_asarray_infers_the_standards_dtypes(xp: Any) -> None:
    assert xp.asarray(True).dtype == xp.bool
    assert xp.asarray(3).dtype == xp.int64
    assert xp.asarray(3.0).dtype == xp.float64
    assert xp.asarray(3j).dtype == xp.complex128
    assert xp.asarray([1, 2.5]).dtype == xp.float64
    assert xp.asarray([[True], [False]]).dtype == xp.bool
    check(xp.asarray([[1, 2], [3, 4]]), np.array([[1, 2], [3, 4]], dtype=np.int64))
    check(xp.asarray(np.float32(1.5)), np.asarray(np.float32(1.5)))
    assert xp.asarray([np.float32(1), np.float32(2)]).dtype == xp.float32


def test_asarray_with_dtype_and_from_buffers(xp: Any) -> None:
    check(xp.asarray([1, 2, 3], dtype=xp.uint8), np.array([1, 2, 3], dtype=np.uint8))
    check(xp.asarray(np.arange(4, dtype=np.int32), dtype=xp.float32), np.arange(4, dtype=np.float32))
    check(xp.asarray(bytearray(b"\x01\x02")), np.array([1, 2], dtype=np.uint8))
    with pytest.raises(OverflowError):
        xp.asarray(2**63)
    with pytest.raises(OverflowError):
        xp.asarray([1, 300], dtype=xp.uint8)
    with pytest.raises(TypeError):
        xp.asarray(np.zeros(2, dtype=np.float16))
    with pytest.raises(TypeError):
        xp.asarray(["a"])


def test_asarray_copy_semantics(xp: Any) -> None:
    x = xp.asarray([1.0, 2.0])
    assert xp.asarray(x) is x
    assert xp.asarray(x, copy=False) is x
    y = xp.asarray(x, copy=True)
    assert y is not x
    y[0] = 5.0
    check(x, np.array([1.0, 2.0]))
    if _kernels_built(xp):
        check(xp.asarray(x, dtype=xp.float32), np.array([1.0, 2.0], dtype=np.float32))
    with pytest.raises(ValueError):
        xp.asarray(x, dtype=xp.float32, copy=False)
    with pytest.raises(ValueError):
        xp.asarray(np.ones(2), copy=False)


def _kernels_built(xp: Any) -> bool:
    """Whether the generated kernels (casts, elementwise functions) exist yet in this checkout."""
    try:
        xp.astype(xp.asarray([1]), xp.float32)
    except NotImplementedError:
        return False
    return True


def test_device_argument(xp: Any) -> None:
    device = xp.__array_namespace_info__().default_device()
    assert xp.zeros(2, device=device).device is device
    with pytest.raises(ValueError):
        xp.zeros(2, device="cpu")
    with pytest.raises(ValueError):
        xp.asarray([1], device="cuda:0")


@pytest.mark.parametrize("dtype", [None, "int32", "float32", "bool", "complex64"])
def test_zeros_ones_full_empty(xp: Any, dtype: str | None) -> None:
    dt = None if dtype is None else getattr(xp, dtype)
    expected_dt = np.float64 if dtype is None else np.dtype(dtype)
    check(xp.zeros((2, 3), dtype=dt), np.zeros((2, 3), expected_dt))
    check(xp.ones(4, dtype=dt), np.ones(4, expected_dt))
    check(xp.full((3,), 1, dtype=dt), np.full((3,), 1, np.int64 if dtype is None else expected_dt))
    assert xp.empty((0, 2), dtype=dt).shape == (0, 2)


def test_full_infers_from_the_fill_value(xp: Any) -> None:
    check(xp.full((2, 2), 7), np.full((2, 2), 7, dtype=np.int64))
    check(xp.full(3, -0.5), np.full(3, -0.5))
    check(xp.full(2, False), np.full(2, False))
    check(xp.full(2, 1 - 2j), np.full(2, 1 - 2j))
    check(xp.full((), 3.0), np.full((), 3.0))
    with pytest.raises(ValueError):
        xp.zeros((2, -1))


def test_like_functions(xp: Any) -> None:
    x = xp.asarray(np.arange(6, dtype=np.int16).reshape(2, 3))
    check(xp.zeros_like(x), np.zeros((2, 3), np.int16))
    check(xp.ones_like(x, dtype=xp.float32), np.ones((2, 3), np.float32))
    check(xp.full_like(x, 9), np.full((2, 3), 9, np.int16))
    assert xp.empty_like(x[:, :1]).shape == (2, 1)


@pytest.mark.parametrize("args", [(5,), (2, 9), (2, 9, 3), (9, 2, -2), (0,), (1.5, 4.0, 0.5), (0, 1, 0.1),
                                  (10, 0, -3.5)])
def test_arange(xp: Any, args: tuple[Any, ...]) -> None:
    check(xp.arange(*args), np.arange(*args))


def test_arange_dtype(xp: Any) -> None:
    check(xp.arange(4, dtype=xp.float32), np.arange(4, dtype=np.float32))
    check(xp.arange(1, 8, 3, dtype=xp.uint8), np.arange(1, 8, 3, dtype=np.uint8))
    with pytest.raises(ValueError):
        xp.arange(0, 5, 0)


@pytest.mark.parametrize(("start", "stop", "num", "endpoint"), [(0, 1, 5, True), (0, 1, 5, False), (-3, 7, 1, True),
                                                                (2, 2, 0, True), (1, -1, 7, True)])
def test_linspace(xp: Any, start: float, stop: float, num: int, endpoint: bool) -> None:
    expected = np.linspace(start, stop, num, endpoint=endpoint)
    np.testing.assert_allclose(np.asarray(xp.linspace(start, stop, num, endpoint=endpoint)), expected,
                               rtol=1e-14, atol=1e-15)
    if endpoint and num > 1:
        assert float(xp.linspace(start, stop, num)[-1]) == stop


def test_linspace_complex_and_float32(xp: Any) -> None:
    np.testing.assert_allclose(np.asarray(xp.linspace(0, 1 + 2j, 4)), np.linspace(0, 1 + 2j, 4))
    assert xp.linspace(0, 1, 3, dtype=xp.float32).dtype == xp.float32


@pytest.mark.parametrize(("n", "m", "k"), [(3, None, 0), (3, 5, 1), (4, 2, -1), (3, 3, 5), (2, 3, -7), (0, 0, 0)])
def test_eye(xp: Any, n: int, m: int | None, k: int) -> None:
    check(xp.eye(n, m, k=k), np.eye(n, m, k=k))
    check(xp.eye(n, m, k=k, dtype=xp.int32), np.eye(n, m, k=k, dtype=np.int32))


@pytest.mark.parametrize("indexing", ["xy", "ij"])
def test_meshgrid(xp: Any, indexing: str) -> None:
    a, b, c = np.arange(3), np.arange(4) * 10, np.arange(2) * 100
    got = xp.meshgrid(xp.asarray(a), xp.asarray(b), xp.asarray(c), indexing=indexing)
    for g, e in zip(got, np.meshgrid(a, b, c, indexing=indexing), strict=True):
        check(g, e)
    assert xp.meshgrid() == []


def test_tril_triu(xp: Any) -> None:
    pytest.importorskip("gpubroker.client.array._elementwise")  # built from the elementwise functions
    host = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) + 1
    x = xp.asarray(host)
    for k in (-1, 0, 2):
        check(xp.tril(x, k=k), np.tril(host, k=k))
        check(xp.triu(x, k=k), np.triu(host, k=k))
    with pytest.raises(ValueError):
        xp.tril(xp.asarray([1, 2]))


def test_from_dlpack(xp: Any) -> None:
    host = np.arange(5, dtype=np.int32)
    check(xp.from_dlpack(host), host)
    x = xp.asarray(host)
    assert xp.from_dlpack(x) is x
    with pytest.raises(BufferError):
        xp.from_dlpack(host, copy=False)


def test_info(xp: Any) -> None:
    info = xp.__array_namespace_info__()
    caps = info.capabilities()
    assert caps["boolean indexing"] and caps["data-dependent shapes"] and caps["max dimensions"] >= 8
    assert info.devices() == [info.default_device()]
    defaults = info.default_dtypes()
    assert defaults["integral"] == xp.int64 and defaults["indexing"] == xp.int64
    assert defaults["real floating"] in (xp.float32, xp.float64)
    assert set(info.dtypes(kind="integral")) == {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                                 "uint64"}
    assert set(info.dtypes(kind=("bool", "complex floating"))) <= {"bool", "complex64", "complex128"}
    assert "float32" in info.dtypes()
