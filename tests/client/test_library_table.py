"""The library op table (pure): what each op gives back, and what it refuses, by name."""

from __future__ import annotations

import pytest

from gpubroker.client import LIBRARY_OPS, InvalidArgument, library_outputs


@pytest.mark.parametrize(("op", "inputs", "params", "outputs"), [
    ("matmul", [("int8", (2, 1, 3, 4)), ("int8", (5, 4, 6))], {}, [("int8", (2, 5, 3, 6))]),
    ("linalg.cholesky", [("float32", (3, 3))], {"upper": True}, [("float32", (3, 3))]),
    ("linalg.det", [("complex64", (2, 3, 3))], {}, [("complex64", (2,))]),
    ("linalg.eigh", [("complex128", (4, 4))], {}, [("float64", (4,)), ("complex128", (4, 4))]),
    ("linalg.eigvalsh", [("float32", (2, 4, 4))], {}, [("float32", (2, 4))]),
    ("linalg.pinv", [("float64", (2, 5, 3))], {"rtol": 1}, [("float64", (2, 3, 5))]),
    ("linalg.qr", [("float64", (5, 3))], {}, [("float64", (5, 3)), ("float64", (3, 3))]),
    ("linalg.qr", [("float64", (5, 3))], {"mode": "complete"}, [("float64", (5, 5)), ("float64", (5, 3))]),
    ("linalg.slogdet", [("complex64", (3, 3))], {}, [("complex64", ()), ("float32", ())]),
    ("linalg.solve", [("float64", (2, 3, 3)), ("float64", (3,))], {}, [("float64", (2, 3))]),
    ("linalg.solve", [("float64", (2, 3, 3)), ("float64", (4, 1, 3, 2))], {}, [("float64", (4, 2, 3, 2))]),
    ("linalg.svd", [("float32", (5, 3))], {}, [("float32", (5, 5)), ("float32", (3,)), ("float32", (3, 3))]),
    ("linalg.svd", [("float32", (5, 3))], {"full_matrices": False},
     [("float32", (5, 3)), ("float32", (3,)), ("float32", (3, 3))]),
    ("linalg.svdvals", [("complex128", (2, 3, 7))], {}, [("float64", (2, 3))]),
    ("linalg.matrix_rank", [("float32", (2, 3, 7))], {"rtol": None}, [("int64", (2,))]),
    ("fft.fft", [("complex64", (3, 8))], {"n": 5, "axis": 0}, [("complex64", (5, 8))]),
    ("fft.rfft", [("float64", (8,))], {}, [("complex128", (5,))]),
    ("fft.irfft", [("complex64", (5,))], {}, [("float32", (8,))]),
    ("fft.hfft", [("complex64", (5,))], {"n": 7}, [("float32", (7,))]),
    ("fft.ihfft", [("float32", (7,))], {}, [("complex64", (4,))]),
    ("fft.fftn", [("complex128", (2, 3, 4))], {"s": [5, 6]}, [("complex128", (2, 5, 6))]),
    ("fft.rfftn", [("float32", (2, 3, 4))], {"axes": [2, 0]}, [("complex64", (2, 3, 4))]),  # halves axis 0
    ("fft.irfftn", [("complex64", (2, 3, 4))], {"s": [-1, 7]}, [("float32", (2, 3, 7))]),
    ("fft.irfftn", [("complex64", (2, 3, 4))], {}, [("float32", (2, 3, 6))]),
    ("sort", [("uint16", (3, 4))], {"axis": 0, "descending": True}, [("uint16", (3, 4))]),
    ("argsort", [("bool", (3, 4))], {}, [("int64", (3, 4))]),
    ("searchsorted", [("int32", (9,)), ("int32", (2, 3))], {"side": "right"}, [("int64", (2, 3))]),
    ("cumulative_sum", [("int16", (3, 4))], {"axis": -1, "include_initial": True}, [("int64", (3, 5))]),
    ("cumulative_sum", [("uint8", (4,))], {}, [("uint64", (4,))]),
    ("cumulative_prod", [("float32", (4,))], {"dtype": "float64"}, [("float64", (4,))]),
    ("count_unique", [("float64", (3, 4))], {}, [("int64", ())]),
    ("unique_all", [("int8", (3, 4))], {"count": 5},
     [("int8", (5,)), ("int64", (5,)), ("int64", (3, 4)), ("int64", (5,))]),
    ("unique_counts", [("int8", (3, 4))], {"count": 5}, [("int8", (5,)), ("int64", (5,))]),
    ("unique_inverse", [("int8", (3, 4))], {"count": 5}, [("int8", (5,)), ("int64", (3, 4))]),
    ("unique_values", [("bool", ())], {"count": 1}, [("bool", (1,))]),
    ("nonzero", [("float32", (3, 4))], {"count": 7}, [("int64", (2, 7))]),
    ("compress", [("float32", (3, 4, 2)), ("bool", (3, 4))], {"count": 7}, [("float32", (7, 2))]),
])
def test_outputs(op: str, inputs: list[tuple[str, tuple[int, ...]]], params: dict[str, object],
                 outputs: list[tuple[str, tuple[int, ...]]]) -> None:
    assert library_outputs(op, inputs, params) == outputs
    assert len(outputs) == LIBRARY_OPS[op].outputs


@pytest.mark.parametrize(("op", "inputs", "params", "message"), [
    ("matmul", [("float32", (3,)), ("float32", (3, 2))], {}, "both operands must have at least 2 dimensions"),
    ("matmul", [("float32", (2, 3)), ("float64", (3, 2))], {}, "input 1 has dtype float64"),
    ("matmul", [("bool", (2, 3)), ("bool", (3, 2))], {}, "input dtype bool is not supported"),
    ("matmul", [("float32", (2, 2, 3)), ("float32", (3, 3, 2))], {}, "do not broadcast"),
    ("matmul", [("float32", (2, 3))], {}, r"takes 2 input\(s\), got 1"),
    ("linalg.inv", [("int32", (3, 3))], {}, "input dtype int32 is not supported"),
    ("linalg.solve", [("float64", (3, 3)), ("float64", (4,))], {}, r"x2 of shape \(4,\)"),
    ("linalg.pinv", [("float64", (3, 3))], {"rtol": -1.0}, "'rtol' must be a finite float >= 0"),
    ("fft.fft", [("float32", (8,))], {}, "input dtype float32 is not supported"),
    ("fft.fft", [("complex64", (8,))], {"n": 0}, "'n' must be >= 1"),
    ("fft.fft", [("complex64", (8,))], {"axis": 1}, "axis 1 is out of range"),
    ("fft.irfft", [("complex64", (1,))], {}, "leaves no transform; give n"),
    ("fft.fftn", [("complex64", (2, 3))], {"axes": [0, -2]}, "repeat an axis"),
    ("fft.fftn", [("complex64", (2, 3))], {"s": [1, 2, 3]}, "more than x's 2 dimension"),
    ("fft.fftn", [("complex64", (2, 3))], {"s": [0]}, "s entries must be >= 1 or -1"),
    ("sort", [("complex64", (3,))], {}, "input dtype complex64 is not supported"),
    ("sort", [("float32", ())], {}, "at least 1 dimension"),
    ("sort", [("float32", (3,))], {"axis": "0"}, "'axis' must be an int"),
    ("searchsorted", [("float32", (3, 2)), ("float32", (3,))], {}, "x1 must be 1-d"),
    ("cumulative_sum", [("float32", (3, 2))], {}, "axis is required"),
    ("cumulative_sum", [("complex64", (3,))], {"dtype": "float32"}, "cannot accumulate"),
    ("cumulative_sum", [("float32", (3,))], {"dtype": "float16"}, "'dtype' must be one of"),
    ("unique_values", [("float32", (3,))], {}, "'count' is required"),
    ("unique_values", [("float32", (3,))], {"count": 4}, "exceeds the 3 element"),
    ("unique_values", [("float32", (3,))], {"count": 0}, "impossible"),
    ("compress", [("float32", (3, 4)), ("bool", (4,))], {"count": 1}, "does not match"),
    ("compress", [("float32", (3,)), ("int8", (3,))], {"count": 1}, "the mask must be bool"),
    ("nonzero", [("float32", (3,))], {"count": 1, "bogus": 2}, "unknown param 'bogus'"),
    ("nonzero", [("float32", (3,))], {"count": 1.0}, "'count' must be an int"),
    ("sort", [("float32", (3,))], {"axis": 1 << 70}, "out of range"),
    ("fft.fftn", [("complex64", (3,))], {"s": [1] * 33}, "at most 32 ints"),
    ("linalg.qr", [("float32", (3, 3))], {"mode": "x" * 100}, "at most 32 characters"),
    ("sort", [("float32", (3, -1))], {}, "must hold ints >= 0"),
    ("sort", [("float16", (3,))], {}, "unknown dtype"),
])
def test_refusals_name_the_op(op: str, inputs: list[tuple[str, tuple[int, ...]]], params: dict[str, object],
                              message: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{op}: .*{message}"):
        library_outputs(op, inputs, params)


def test_unknown_op() -> None:
    with pytest.raises(InvalidArgument, match=r"^unknown library op 'linalg.eig'; known: matmul, "):
        library_outputs("linalg.eig", [("float32", (3, 3))])
    with pytest.raises(InvalidArgument, match=r"^unknown library op"):
        library_outputs(3, [])  # type: ignore[arg-type]


def test_numpy_integers_and_dtypes_are_taken_as_python_ones() -> None:
    import numpy as np

    shape = (np.int64(3), np.intp(4))
    assert library_outputs("fft.rfft", [(np.dtype("float32"), shape)], {"n": np.int32(6), "axis": np.int8(0)}) \
        == [("complex64", (4, 4))]
    assert library_outputs("linalg.pinv", [("float64", (2, 2))], {"rtol": np.float32(0.5)}) == [("float64", (2, 2))]
    assert library_outputs("linalg.svd", [("float64", (3, 2))], {"full_matrices": np.bool_(False)})[0] \
        == ("float64", (3, 2))
    with pytest.raises(InvalidArgument, match="'upper' must be a bool"):
        library_outputs("linalg.cholesky", [("float64", (2, 2))], {"upper": np.int8(1)})


def test_a_remembered_answer_is_given_only_for_the_same_plain_call() -> None:
    """library_outputs remembers its answers (a loop asks the same one each step); a call that equals a remembered
    one but for its types (True == 1, 1.0 == 1) still takes the table's check, and a returned list is the caller's."""
    first = library_outputs("linalg.cholesky", [("float64", (2, 2))], {"upper": True})
    first.append(("int8", ()))
    assert library_outputs("linalg.cholesky", [("float64", (2, 2))], {"upper": True}) == [("float64", (2, 2))]
    with pytest.raises(InvalidArgument, match="'upper' must be a bool"):
        library_outputs("linalg.cholesky", [("float64", (2, 2))], {"upper": 1})
    assert library_outputs("sort", [("float32", (3,))], {"axis": 0}) == [("float32", (3,))]
    with pytest.raises(InvalidArgument, match="'axis' must be an int"):
        library_outputs("sort", [("float32", (3,))], {"axis": 0.0})
    assert library_outputs("sort", [("float32", [1, 3])], {}) == [("float32", (1, 3))]
    with pytest.raises(InvalidArgument, match="must hold ints >= 0"):
        library_outputs("sort", [("float32", (True, 3))], {})
