"""Elementwise functions against numpy, on the in-process PoCL namespace: dtypes, promotion, Python scalars,
broadcasting, strided operands, empty and 0-d arrays, the standard's special cases, categories, in-place."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

from gpubroker.client.array import _elementwise

RNG = np.random.default_rng(14)


def host(x: Any) -> np.ndarray[Any, Any]:
    return np.asarray(x)


def check(actual: Any, expected: Any, rtol: float = 1e-6, atol: float = 0.0) -> None:
    got = host(actual)
    expected = np.asarray(expected)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    if got.dtype.kind in "fc":
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, expected)


def sample(dtype: str, shape: tuple[int, ...] = (3, 4)) -> np.ndarray[Any, Any]:
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return RNG.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return RNG.integers(max(info.min, -100), min(info.max, 100), shape, endpoint=True).astype(dt)
    values = RNG.uniform(-3, 3, shape)
    if dt.kind == "c":
        values = values + 1j * RNG.uniform(-3, 3, shape)
    return values.astype(dt)


NUMPY_NAMES = {"acos": "arccos", "acosh": "arccosh", "asin": "arcsin", "asinh": "arcsinh", "atan": "arctan",
               "atanh": "arctanh", "atan2": "arctan2", "bitwise_invert": "invert", "pow": "power",
               "bitwise_left_shift": "left_shift", "bitwise_right_shift": "right_shift"}


def np_fn(name: str) -> Any:
    return getattr(np, NUMPY_NAMES.get(name, name))


FLOAT_UNARY = ["acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "exp", "expm1", "log", "log1p",
               "log2", "log10", "sin", "sinh", "sqrt", "tan", "tanh", "reciprocal"]


def domain(name: str, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``x`` moved into the real domain of ``name`` (so numpy's answer is a number to compare with)."""
    if x.dtype.kind == "c":
        return x
    if name in ("acos", "asin", "atanh"):
        return (x / 3.5).astype(x.dtype)
    if name == "acosh":
        return (np.abs(x) + 1).astype(x.dtype)
    if name in ("log", "log2", "log10", "sqrt"):
        return (np.abs(x) + 0.1).astype(x.dtype)
    if name == "log1p":
        return (np.abs(x) - 0.5).astype(x.dtype)
    return x


# float64 on a few functions only: each signature is a compile, slow on PoCL
@pytest.mark.parametrize(("name", "dtype"), [(n, d) for n in FLOAT_UNARY for d in ("float32", "complex64")]
                         + [(n, "float64") for n in ("exp", "log", "sqrt", "atanh", "tan")])
def test_floating_unary_functions_match_numpy(xp: Any, name: str, dtype: str) -> None:
    data = domain(name, sample(dtype))
    expected = (1 / data) if name == "reciprocal" else np_fn(name)(data)
    rtol = 1e-5 if dtype == "float32" else (1e-4 if dtype == "complex64" else 1e-12)
    check(getattr(xp, name)(xp.asarray(data)), expected, rtol=rtol, atol=1e-5 if dtype != "float64" else 1e-12)


@pytest.mark.parametrize("name", ["asin", "asinh"])
@pytest.mark.parametrize(("dtype", "far"), [("complex64", 3e19), ("complex128", 1e154)])
def test_inverse_sines_of_far_out_complex_values_stay_finite(xp: Any, name: str, dtype: str, far: float) -> None:
    """Far from the origin asinh(z) is log(2z) to working precision: squaring z there overflows (the Array API
    suite's full run once found +-inf where the values are finite, about 45 in complex64 and 356 in complex128)."""
    data = np.array([far + far * 1j, -0.3 * far + far * 1j, far - 0.5 * far * 1j, -far * 1j, 0.5 + 0.25j], dtype)
    expected = np_fn(name)(data)
    assert np.isfinite(expected).all()
    check(getattr(xp, name)(xp.asarray(data)), expected, rtol=1e-5 if dtype == "complex64" else 1e-12)


@pytest.mark.parametrize("name", ["abs", "negative", "positive", "square", "sign", "conj", "real", "imag",
                                  "round", "ceil", "floor", "trunc", "isnan", "isinf", "isfinite"])
@pytest.mark.parametrize("dtype", ["int8", "uint16", "int64", "float32", "complex64"])
def test_numeric_unary_functions_match_numpy(xp: Any, name: str, dtype: str) -> None:
    if dtype == "complex64" and name in ("ceil", "floor", "trunc"):
        with pytest.raises(TypeError):
            getattr(xp, name)(xp.asarray(sample(dtype)))
        return
    data = sample(dtype)
    if dtype == "float32" and name == "round":
        data = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 2.4, -2.6, 3.0], dtype=np.float32)
    expected = np_fn(name)(data)
    if name == "sign" and dtype == "complex64":
        expected = (data / np.abs(data)).astype(data.dtype)
    if name in ("real", "imag") and dtype != "complex64":
        expected = expected.astype(data.dtype)
    check(getattr(xp, name)(xp.asarray(data)), expected, rtol=1e-6)


def test_unary_bool_and_bitwise(xp: Any) -> None:
    b = np.array([True, False, True])
    check(xp.logical_not(xp.asarray(b)), ~b)
    check(xp.bitwise_invert(xp.asarray(b)), ~b)
    i = np.array([0, 1, -128, 127], dtype=np.int8)
    check(xp.bitwise_invert(xp.asarray(i)), ~i)
    check(~xp.asarray(np.array([0, 255], dtype=np.uint8)), np.array([255, 0], dtype=np.uint8))
    check(xp.signbit(xp.asarray(np.array([-0.0, 0.0, -1.0, np.nan], dtype=np.float32))),
          np.array([True, False, True, False]))
    check(xp.abs(xp.asarray(np.array([-128, 5], dtype=np.int8))), np.array([-128, 5], dtype=np.int8))


ARITHMETIC = ["add", "subtract", "multiply"]


@pytest.mark.parametrize("name", [*ARITHMETIC, "maximum", "minimum", "equal", "not_equal", "less",
                                   "less_equal", "greater", "greater_equal"])
@pytest.mark.parametrize("dtypes", [("int8", "int8"), ("uint8", "int16"), ("int64", "int64"),
                                    ("float32", "float32"), ("float32", "float64"), ("uint32", "uint32")])
def test_binary_functions_promote_like_the_standard(xp: Any, name: str, dtypes: tuple[str, str]) -> None:
    a, b = sample(dtypes[0]), sample(dtypes[1], (4,))
    expected = np_fn(name)(a, b)
    check(getattr(xp, name)(xp.asarray(a), xp.asarray(b)), expected, rtol=1e-6)


@pytest.mark.parametrize("name", [*ARITHMETIC, "divide", "pow", "equal", "not_equal"])
def test_complex_binary_functions(xp: Any, name: str) -> None:
    a, b = sample("complex64"), sample("complex64")
    check(getattr(xp, name)(xp.asarray(a), xp.asarray(b)), np_fn(name)(a, b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["atan2", "copysign", "hypot", "logaddexp", "nextafter", "divide", "pow"])
def test_real_floating_binary_functions(xp: Any, name: str) -> None:
    a = sample("float32")
    b = np.abs(sample("float32")) + 0.5 if name == "pow" else sample("float32")
    if name == "pow":
        a = np.abs(a)
    check(getattr(xp, name)(xp.asarray(a), xp.asarray(b)), np_fn(name)(a, b), rtol=1e-5)


def test_logaddexp_special_cases(xp: Any) -> None:
    inf, nan = np.inf, np.nan
    a = np.array([inf, -inf, inf, 1.0, nan, -inf, 1000.0], dtype=np.float32)
    b = np.array([inf, -inf, -inf, nan, 1.0, 0.0, 1000.0], dtype=np.float32)
    with np.errstate(invalid="ignore"):
        expected = np.logaddexp(a, b)
    check(xp.logaddexp(xp.asarray(a), xp.asarray(b)), expected)


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8", "uint64"])
def test_integer_floor_divide_and_remainder_follow_python(xp: Any, dtype: str) -> None:
    dt = np.dtype(dtype)
    signed = dt.kind == "i"
    values = [-7, -6, -1, 0, 1, 5, 7] if signed else [0, 1, 5, 7, 200]
    divisors = [-3, -1, 2, 3] if signed else [1, 2, 3]
    a = np.array([v for v in values for _ in divisors], dtype=dt)
    b = np.array([d for _ in values for d in divisors], dtype=dt)
    pairs = [(int(x), int(y)) for x, y in zip(a, b, strict=True)]
    check(xp.floor_divide(xp.asarray(a), xp.asarray(b)), np.array([x // y for x, y in pairs], dt))
    check(xp.remainder(xp.asarray(a), xp.asarray(b)), np.array([x % y for x, y in pairs], dt))
    # by zero: 0, and the device survives (no trap); MIN // -1 wraps, never traps
    zero = xp.asarray(np.zeros(3, dtype=dt))
    check(xp.asarray(np.array([5, 0, 1], dtype=dt)) // zero, np.zeros(3, dtype=dt))
    check(xp.asarray(np.array([5, 0, 1], dtype=dt)) % zero, np.zeros(3, dtype=dt))
    if signed:
        low = np.iinfo(dt).min
        check(xp.asarray(np.array([low], dtype=dt)) // -1, np.array([low], dtype=dt))
        check(xp.asarray(np.array([low], dtype=dt)) % -1, np.array([0], dtype=dt))


def test_float_floor_divide_and_remainder(xp: Any) -> None:
    vals = np.array([-7.5, -0.0, 0.0, 3.25, 5.0, np.inf, -np.inf, np.nan, 1e-30], dtype=np.float64)
    a, b = np.meshgrid(vals, np.array([-2.0, 2.0, 0.0, -0.0, np.inf, -np.inf, np.nan, 0.5]))
    with np.errstate(all="ignore"):
        # the standard's infinities (an infinite operand gives what a / b gives), else numpy's
        fd, rem = np.where(np.isinf(a) | np.isinf(b), a / b, np.floor_divide(a, b)), np.remainder(a, b)
    x, y = xp.asarray(a), xp.asarray(b)
    got_fd, got_rem = host(x // y), host(x % y)
    number = ~np.isnan(fd)  # (a NaN's sign means nothing)
    np.testing.assert_array_equal(got_fd, fd)
    np.testing.assert_array_equal(np.signbit(got_fd[number]), np.signbit(fd[number]))
    number = ~np.isnan(rem)
    np.testing.assert_array_equal(got_rem, rem)
    np.testing.assert_array_equal(np.signbit(got_rem[number]), np.signbit(rem[number]))


def test_integer_pow_and_shifts(xp: Any) -> None:
    a = np.array([2, -3, 1, -1, 0, 7], dtype=np.int32)
    b = np.array([10, 3, -5, -3, 0, 2], dtype=np.int32)
    check(xp.pow(xp.asarray(a), xp.asarray(b)), np.array([1024, -27, 1, -1, 1, 49], dtype=np.int32))
    s = np.array([1, -8, 3, 100], dtype=np.int16)
    n = np.array([3, 2, 16, 1], dtype=np.int16)
    check(xp.asarray(s) << xp.asarray(n), np.array([8, -32, 0, 200], dtype=np.int16))
    check(xp.asarray(s) >> xp.asarray(n), np.array([0, -2, 0, 50], dtype=np.int16))
    check(xp.asarray(np.array([-1], dtype=np.int8)) >> 9, np.array([-1], dtype=np.int8))
    u = np.array([1, 255], dtype=np.uint8)
    check(xp.asarray(u) << 7, np.array([128, 128], dtype=np.uint8))
    check(xp.bitwise_and(xp.asarray(a), 6), a & 6)
    check(xp.bitwise_or(xp.asarray(a), xp.asarray(b)), a | b)
    check(xp.bitwise_xor(xp.asarray(a), xp.asarray(b)), a ^ b)
    t, f = np.array([True, True, False]), np.array([True, False, False])
    check(xp.asarray(t) & xp.asarray(f), t & f)
    check(xp.asarray(t) | xp.asarray(f), t | f)
    check(xp.asarray(t) ^ xp.asarray(f), t ^ f)
    check(xp.logical_and(xp.asarray(t), xp.asarray(f)), t & f)
    check(xp.logical_or(xp.asarray(t), False), t)
    check(xp.logical_xor(xp.asarray(t), xp.asarray(f)), t ^ f)


def test_python_scalars_take_the_arrays_dtype(xp: Any) -> None:
    a = sample("float32")
    x = xp.asarray(a)
    check(x + 1, a + np.float32(1))
    check(2.5 * x, a * np.float32(2.5))
    check(1 - x, np.float32(1) - a)
    check(x / 2, a / np.float32(2))
    check(x ** 2, a ** 2, rtol=1e-6)
    check(x > 0.5, a > 0.5)
    check(x * np.float32(3), a * np.float32(3))  # a NumPy scalar counts as the Python scalar it holds
    check(np.float64(2) - x, np.float32(2) - a)
    i = sample("int16")
    check(xp.asarray(i) * 3, i * np.int16(3))
    check(xp.asarray(i) + True, i + np.int16(1))
    check(xp.asarray(np.array([1, 2], dtype=np.float32)) * 1j, np.array([1j, 2j], dtype=np.complex64))
    check(xp.asarray(np.array([True, False])) == True, np.array([True, False]))  # noqa: E712
    with pytest.raises(OverflowError):
        xp.asarray(np.array([1], dtype=np.int8)) + 1000
    with pytest.raises(TypeError):
        xp.add(1, 2)


def test_negative_zero_and_nan_constants_are_distinct(xp: Any) -> None:
    x = xp.asarray(np.array([1.0, -1.0], dtype=np.float32))
    check(xp.copysign(x, -0.0), np.array([-1.0, -1.0], dtype=np.float32))
    check(xp.copysign(x, 0.0), np.array([1.0, 1.0], dtype=np.float32))
    check(x + float("nan"), np.array([np.nan, np.nan], dtype=np.float32))


def test_broadcasting_strided_and_empty_operands(xp: Any) -> None:
    a, b = sample("float32", (4, 1, 3)), sample("float32", (5, 1))
    check(xp.asarray(a) - xp.asarray(b), a - b)
    m = sample("int32", (6, 8))
    x = xp.asarray(m)
    check(x.T + 1, m.T + 1)                            # transposed: the strided kernel
    check(x[::2, 1::3] * x[1::2, ::3], m[::2, 1::3] * m[1::2, ::3])  # sliced: offsets and steps
    check(x[::-1] - x, m[::-1] - m)                    # negative strides
    check(xp.maximum(x.T, xp.asarray(m[0])[:6]), np.maximum(m.T, m[0][:6]))
    check(xp.asarray(np.zeros((0, 3), np.float32)) + 1, np.zeros((0, 3), np.float32))
    check(xp.asarray(np.float32(2.0)) * xp.asarray(np.float32(3.0)), np.float32(6.0))
    check(xp.sqrt(xp.asarray(np.zeros((2, 0), np.float32))), np.zeros((2, 0), np.float32))
    with pytest.raises(ValueError):
        xp.asarray(np.zeros(3)) + xp.asarray(np.zeros(4))


def test_special_cases_of_the_standard(xp: Any) -> None:
    inf, nan = np.inf, np.nan
    v = np.array([nan, inf, -inf, 0.0, -0.0, 1.0, -1.0], dtype=np.float32)
    x = xp.asarray(v)
    with np.errstate(all="ignore"):
        for name in ("sqrt", "log", "exp", "sin", "tanh", "atanh", "expm1", "log1p", "sign", "floor", "round"):
            got, want = host(getattr(xp, name)(x)), np_fn(name)(v)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, equal_nan=True, err_msg=name)
            zero = want == 0
            np.testing.assert_array_equal(np.signbit(got[zero]), np.signbit(want[zero]), err_msg=name)
    check(xp.maximum(x, xp.asarray(np.float32(0.0))), np.maximum(v, np.float32(0.0)))
    check(xp.minimum(xp.asarray(np.float32(0.0)), x), np.minimum(np.float32(0.0), v))
    check(xp.isnan(x), np.isnan(v))
    check(xp.isinf(x), np.isinf(v))
    check(xp.isfinite(x), np.isfinite(v))
    check(xp.pow(x, 0.0), np.ones(7, dtype=np.float32))
    check(xp.pow(xp.asarray(np.float32(1.0)), x), np.ones(7, dtype=np.float32))


def test_categories_are_enforced(xp: Any) -> None:
    f = xp.asarray(np.ones(3, dtype=np.float32))
    i = xp.asarray(np.ones(3, dtype=np.int32))
    b = xp.asarray(np.ones(3, dtype=bool))
    c = xp.asarray(np.ones(3, dtype=np.complex64))
    for bad in (lambda: f & f, lambda: f << i, lambda: xp.sin(i), lambda: i / i, lambda: xp.logical_and(i, i),
                lambda: c < c, lambda: xp.floor(c), lambda: b + b, lambda: -b, lambda: xp.atan2(c, c),
                lambda: xp.bitwise_and(i, 1.5), lambda: xp.signbit(i)):
        with pytest.raises(TypeError):
            bad()
    with pytest.raises(TypeError):
        xp.add(xp.asarray(np.ones(2, np.uint64)), xp.asarray(np.ones(2, np.int64)))


def test_where_and_clip(xp: Any) -> None:
    cond = RNG.integers(0, 2, (3, 4)).astype(bool)
    a, b = sample("float32"), sample("float32", (4,))
    check(xp.where(xp.asarray(cond), xp.asarray(a), xp.asarray(b)), np.where(cond, a, b))
    check(xp.where(xp.asarray(cond), xp.asarray(a), 0.0), np.where(cond, a, np.float32(0)))
    check(xp.where(xp.asarray(cond), 1, xp.asarray(sample("int8"))).dtype == xp.int8, np.True_)
    with pytest.raises(TypeError):
        xp.where(xp.asarray(a), xp.asarray(a), xp.asarray(b))
    check(xp.clip(xp.asarray(a), -1.0, 1.0), np.clip(a, -1, 1))
    check(xp.clip(xp.asarray(a), min=0.5), np.maximum(a, np.float32(0.5)))
    check(xp.clip(xp.asarray(a), max=xp.asarray(b)), np.minimum(a, b))
    check(xp.clip(xp.asarray(a)), a)
    i = np.array([-200, 0, 100], dtype=np.int16)
    check(xp.clip(xp.asarray(i), -100, 2**40), np.array([-100, 0, 100], dtype=np.int16))
    check(xp.clip(xp.asarray(np.array([np.nan, 1.0], np.float32)), 0.0, 0.5),
          np.array([np.nan, 0.5], np.float32))
    with pytest.raises(TypeError):
        xp.clip(xp.asarray(i), 0.5)


def test_in_place_operators_write_into_the_array(xp: Any) -> None:
    a = sample("float32")
    x = xp.asarray(a)
    row = x[1]  # a view: sees the in-place change
    x += 1
    x *= xp.asarray(np.float32(2))
    x -= xp.asarray(a[0])
    expected = (a + 1) * 2 - a[0]
    check(x, expected)
    check(row, expected[1])
    t = xp.asarray(np.arange(9, dtype=np.int32).reshape(3, 3))
    t += t.T  # overlapping operand in another layout: computed apart, then copied
    m = np.arange(9, dtype=np.int32).reshape(3, 3)
    check(t, m + m.T)
    i = xp.asarray(np.arange(4, dtype=np.int32))
    with pytest.raises(TypeError):
        i += 1.5
    with pytest.raises(TypeError):
        i /= 2
    with pytest.raises(ValueError):
        v = xp.asarray(np.zeros(3, np.float32))
        v += xp.asarray(np.zeros((2, 3), np.float32))
    z = xp.asarray(np.zeros((2, 2), np.float32))
    assert _elementwise.inplace_result(z, xp.asarray(np.ones(2, np.float32))) is z
    check(z, np.ones((2, 2), np.float32))


def test_a_repeated_operation_compiles_and_uploads_nothing(xp: Any) -> None:
    kernels = xp._ctx.kernels
    a = xp.asarray(sample("float32", (16, 8)))
    b = xp.asarray(sample("float32", (8,)))
    expected = host(a.T[::2] * 3.0 + b[:1])
    before = kernels.compiles
    plans = len(kernels._plans)
    for _ in range(3):
        check(a.T[::2] * 3.0 + b[:1], expected)
    assert kernels.compiles == before
    assert len(kernels._plans) == plans


def test_signatures_match_the_standard() -> None:
    params = inspect.signature(_elementwise.clip).parameters
    assert [p.kind for p in params.values()] == [inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD]
    for name in ("add", "atan2", "where", "sin", "logical_not"):
        fn = getattr(_elementwise, name)
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
        assert kinds == {inspect.Parameter.POSITIONAL_ONLY}, name
