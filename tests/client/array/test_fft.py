"""The fft extension on an in-process PoCL namespace, against numpy.fft."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.array_backends import ARRAY_BACKENDS, namespace_on

RNG = np.random.default_rng(1414)


@pytest.fixture(scope="module", params=ARRAY_BACKENDS)
def xp(request: pytest.FixtureRequest) -> Any:
    """The namespace on each backend (this module's tests run on CUDA too, under ``-m cuda``)."""
    return namespace_on(request.param)


def signal(*shape: int, complex_: bool = True, dtype: str = "complex128") -> np.ndarray[Any, Any]:
    real = RNG.standard_normal(shape)
    if complex_:
        return (real + 1j * RNG.standard_normal(shape)).astype(dtype)
    return real.astype(dtype)


def close(got: Any, want: Any, tol: float = 1e-9) -> None:
    got = np.asarray(got)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["fft", "ifft", "hfft", "irfft"])
@pytest.mark.parametrize(("n", "axis", "norm"), [(None, -1, "backward"), (6, 0, "ortho"), (11, 1, "forward")])
def test_complex_input_transforms(xp: Any, name: str, n: int | None, axis: int, norm: str) -> None:
    x = signal(4, 8)
    close(getattr(xp.fft, name)(xp.asarray(x), n=n, axis=axis, norm=norm),
          getattr(np.fft, name)(x, n=n, axis=axis, norm=norm))


@pytest.mark.parametrize("name", ["rfft", "ihfft"])
@pytest.mark.parametrize(("n", "axis", "norm"), [(None, -1, "backward"), (5, 0, "ortho"), (12, -2, "forward")])
def test_real_input_transforms(xp: Any, name: str, n: int | None, axis: int, norm: str) -> None:
    x = signal(4, 8, complex_=False, dtype="float64")
    close(getattr(xp.fft, name)(xp.asarray(x), n=n, axis=axis, norm=norm),
          getattr(np.fft, name)(x, n=n, axis=axis, norm=norm))


def test_single_precision_stays_single(xp: Any) -> None:
    x = signal(16, complex_=False, dtype="float32")
    got = xp.fft.rfft(xp.asarray(x))
    assert got.dtype == xp.complex64
    np.testing.assert_allclose(np.asarray(got), np.fft.rfft(x), rtol=1e-4, atol=1e-4)
    back = xp.fft.irfft(got, n=16)
    assert back.dtype == xp.float32
    np.testing.assert_allclose(np.asarray(back), x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["fftn", "ifftn", "irfftn"])
@pytest.mark.parametrize(("s", "axes"), [(None, None), ([4, 6], [0, 2]), (None, [-1, 0]), ([-1, 6], [1, 2])])
def test_n_dimensional_complex(xp: Any, name: str, s: list[int] | None, axes: list[int] | None) -> None:
    x = signal(3, 4, 5)
    close(getattr(xp.fft, name)(xp.asarray(x), s=s, axes=axes), getattr(np.fft, name)(x, s=s, axes=axes))


@pytest.mark.parametrize(("s", "axes"), [(None, None), ([4, 6], [0, 2]), (None, [-1, 0])])
def test_rfftn(xp: Any, s: list[int] | None, axes: list[int] | None) -> None:
    x = signal(3, 4, 5, complex_=False, dtype="float64")
    close(xp.fft.rfftn(xp.asarray(x), s=s, axes=axes, norm="ortho"), np.fft.rfftn(x, s=s, axes=axes, norm="ortho"))


def test_dtype_kind_errors(xp: Any) -> None:
    real = xp.asarray(signal(8, complex_=False, dtype="float64"))
    cplx = xp.asarray(signal(8))
    for fn in (xp.fft.fft, xp.fft.ifft, xp.fft.irfft, xp.fft.hfft, xp.fft.fftn):
        with pytest.raises(TypeError):
            fn(real)
    for fn in (xp.fft.rfft, xp.fft.ihfft, xp.fft.rfftn):
        with pytest.raises(TypeError):
            fn(cplx)
    with pytest.raises(ValueError):
        xp.fft.fft(cplx, norm="sideways")
    with pytest.raises(ValueError):
        xp.fft.fft(cplx, n=0)
    with pytest.raises(ValueError):
        xp.fft.fftn(cplx, s=[4])  # s without axes


@pytest.mark.parametrize("n", [1, 8, 9])
def test_frequencies(xp: Any, n: int) -> None:
    close(xp.fft.fftfreq(n, d=0.5), np.fft.fftfreq(n, 0.5))
    close(xp.fft.rfftfreq(n, d=2.0), np.fft.rfftfreq(n, 2.0))
    assert xp.fft.fftfreq(n, dtype=xp.float32).dtype == xp.float32
    assert xp.fft.fftfreq(n, device=xp.asarray([1.0]).device).shape == (n,)
    with pytest.raises(ValueError):
        xp.fft.fftfreq(n, dtype=xp.int32)


@pytest.mark.parametrize("axes", [None, 0, [1], [0, 1], -1])
def test_shifts(xp: Any, axes: Any) -> None:
    x = signal(5, 6, complex_=False, dtype="float64")
    shifted = xp.fft.fftshift(xp.asarray(x), axes=axes)
    close(shifted, np.fft.fftshift(x, axes=axes))
    close(xp.fft.ifftshift(shifted, axes=axes), x)
