"""Library operations (``GpuCompute.run_library``), written once over an array module: NumPy or CuPy.

``run(xp, op, inputs, outputs, params)`` computes ``op`` on ``inputs`` (``xp`` arrays) and writes each output in
place. The op table (``gpubroker.wire.library``) has checked the op, its params (defaults filled in) and that
the outputs have exactly the dtypes and shapes the op gives; what only the data can tell (a singular matrix to
``inv``, the size of a ``unique`` or ``nonzero`` result) is checked here, before an output is written.

Memory the library takes for itself while it runs (cuSOLVER and cuFFT workspaces, NumPy and CuPy temporaries) is
not counted against the tenant's quota: it lives for one call and is bounded by a small multiple of the call's
arrays, which are counted. On CUDA the backend gives CuPy's unused pool blocks back after each call so it stays so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from gpubroker.wire.errors import InvalidArgument, ResourceExhausted
from gpubroker.wire.library import Params, check_library_call, fft_length, fftn_plan

__all__ = ["check_library_call", "library_errors", "run"]  # check_library_call: the table's, for the backends

Arrays = Sequence[Any]  # xp.ndarray: numpy.ndarray or cupy.ndarray
Impl = Callable[[Any, Arrays, Arrays, Params], None]


@contextlib.contextmanager
def library_errors(op: str) -> Iterator[None]:
    """The library's errors as the client's: a LinAlgError (a singular matrix, no convergence) or a ValueError the
    table did not foresee is InvalidArgument naming the op; host memory running out is ResourceExhausted."""
    try:
        yield
    except np.linalg.LinAlgError as exc:
        raise InvalidArgument(f"{op}: {exc}") from None
    except (ValueError, TypeError, IndexError) as exc:
        raise InvalidArgument(f"{op}: {exc}") from None
    except MemoryError:
        # (CuPy's OutOfMemoryError is a MemoryError too)
        raise ResourceExhausted(f"{op}: out of memory for the library's temporaries") from None


def run(xp: Any, op: str, inputs: Arrays, outputs: Arrays, params: Params) -> None:
    """Compute ``op`` with the array module ``xp`` and write ``outputs`` in place (checked params)."""
    impl = _IMPLS[op]
    if all(o.size == 0 for o in outputs) and op not in _CHECKS_SIZE:
        return  # nothing to write (an empty batch: cuFFT and cuBLAS refuse plans of none)
    if xp is not np and op.startswith("linalg.") and any(a.size == 0 for a in inputs):
        # Empty stacks and 0x0 / Mx0 matrices have well-defined results (det 1, identity factors) that NumPy
        # gives and cuSOLVER wrappers may refuse; they are tiny (no data), so compute them on the host.
        host_outputs = [np.empty(o.shape, o.dtype) for o in outputs]
        impl(np, [np.empty(a.shape, a.dtype) for a in inputs], host_outputs, params)
        for out, host in zip(outputs, host_outputs, strict=True):
            out[...] = xp.asarray(host)
        return
    impl(xp, inputs, outputs, params)


# -- matmul and linalg -----------------------------------------------------------------------------
def _matmul(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    xp.matmul(ins[0], ins[1], out=outs[0])


def _mT(xp: Any, x: Any) -> Any:
    return xp.swapaxes(x, -1, -2)


def _cholesky(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    lower = xp.linalg.cholesky(ins[0])
    outs[0][...] = xp.conj(_mT(xp, lower)) if params["upper"] else lower


def _det(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    outs[0][...] = xp.linalg.det(ins[0])


def _eigh(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    values, vectors = xp.linalg.eigh(ins[0])
    outs[0][...] = values
    outs[1][...] = vectors


def _eigvalsh(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    outs[0][...] = xp.linalg.eigvalsh(ins[0])


def _inv(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    outs[0][...] = xp.linalg.inv(ins[0])


def _default_rtol(x: Any, rtol: object) -> float:
    # The standard's default: max(M, N) * the machine epsilon of the (real) dtype.
    if rtol is not None:
        assert isinstance(rtol, float)
        return rtol
    eps: float = np.finfo(x.dtype).eps.item()
    return float(max(x.shape[-2], x.shape[-1]) * eps)


def _pinv(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    # Through the SVD with the standard's rtol (relative to the largest singular value); the same code on both
    # array modules (NumPy's rcond and CuPy's differ in default and meaning).
    x = ins[0]
    if min(x.shape[-2], x.shape[-1]) == 0:
        outs[0][...] = 0
        return
    u, s, vh = xp.linalg.svd(x, full_matrices=False)
    cutoff = _default_rtol(x, params["rtol"]) * xp.max(s, axis=-1, keepdims=True)
    keep = s > cutoff
    s_inv = xp.where(keep, 1 / xp.where(keep, s, 1), 0).astype(s.dtype)
    outs[0][...] = xp.matmul(xp.conj(_mT(xp, vh)) * s_inv[..., None, :], xp.conj(_mT(xp, u)))


def _qr(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    q, r = xp.linalg.qr(ins[0], mode=params["mode"])
    outs[0][...] = q
    outs[1][...] = r


def _slogdet(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    sign, logabsdet = xp.linalg.slogdet(ins[0])
    outs[0][...] = sign
    outs[1][...] = logabsdet


def _solve(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    # Broadcast explicitly, and a 1-d x2 as one column: NumPy 2 and CuPy then agree (CuPy follows NumPy 1's
    # rule, which took x2 of x1.ndim - 1 dimensions as a stack of vectors).
    a, b = ins
    vector = b.ndim == 1
    if vector:
        b = b[:, None]
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = xp.broadcast_to(a, batch + a.shape[-2:])
    b = xp.broadcast_to(b, batch + b.shape[-2:])
    x = xp.linalg.solve(xp.ascontiguousarray(a), xp.ascontiguousarray(b))
    outs[0][...] = x[..., 0] if vector else x


def _svd(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    u, s, vh = xp.linalg.svd(ins[0], full_matrices=params["full_matrices"])
    outs[0][...] = u
    outs[1][...] = s
    outs[2][...] = vh


def _svdvals(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    outs[0][...] = xp.linalg.svd(ins[0], compute_uv=False)


def _matrix_rank(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    x = ins[0]
    if min(x.shape[-2], x.shape[-1]) == 0:
        outs[0][...] = 0
        return
    s = xp.linalg.svd(x, compute_uv=False)
    tol = _default_rtol(x, params["rtol"]) * xp.max(s, axis=-1, keepdims=True)
    outs[0][...] = xp.sum(s > tol, axis=-1)


# -- fft -------------------------------------------------------------------------------------------
def _fft(name: str) -> Impl:
    def impl(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
        axis, n = fft_length(f"fft.{name}", ins[0].shape, params)
        outs[0][...] = getattr(xp.fft, name)(ins[0], n=n, axis=axis, norm=params["norm"])
    return impl


def _fftn(name: str) -> Impl:
    def impl(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
        lengths, axes = fftn_plan(f"fft.{name}", ins[0].shape, params)
        outs[0][...] = getattr(xp.fft, name)(ins[0], s=lengths, axes=axes, norm=params["norm"])
    return impl


# -- sorting and searching -------------------------------------------------------------------------
def _argsort(xp: Any, x: Any, axis: int, descending: bool) -> Any:
    # Always stable (the standard's stable=False allows it). Descending, stable: sort the reversed array and
    # map back, so equal elements keep their original order (as array-api-strict does).
    if not descending:
        return xp.argsort(x, axis=axis, kind="stable")
    flipped = xp.flip(xp.argsort(xp.flip(x, axis=axis), axis=axis, kind="stable"), axis=axis)
    return (x.shape[axis] - 1) - flipped


def _sort(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    axis = params["axis"]
    ordered = xp.sort(ins[0], axis=axis)
    outs[0][...] = xp.flip(ordered, axis=axis) if params["descending"] else ordered


def _argsort_impl(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    axis = params["axis"]
    assert type(axis) is int
    outs[0][...] = _argsort(xp, ins[0], axis % ins[0].ndim, bool(params["descending"]))


def _searchsorted(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    outs[0][...] = xp.searchsorted(ins[0], ins[1], side=params["side"])


def _cumulative(name: str) -> Impl:
    def impl(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
        x, out = ins[0], outs[0]
        axis = params["axis"]
        axis = 0 if axis is None else axis
        assert type(axis) is int
        axis %= x.ndim
        if params["include_initial"]:
            head = (slice(None),) * axis
            out[(*head, slice(0, 1))] = 0 if name == "cumsum" else 1
            out = out[(*head, slice(1, None))]
        if x.size:
            out[...] = getattr(xp, name)(x, axis=axis, dtype=out.dtype)
    return impl


# -- data-dependent sizes --------------------------------------------------------------------------
def _check_count(op: str, actual: int, given: int) -> None:
    if actual != given:
        raise InvalidArgument(f"{op}: the result has {actual} element(s), the outputs are sized for {given}")


def _runs(xp: Any, x: Any) -> tuple[Any, Any, Any]:
    """x flattened, sorted (stable), and where each run of equal values starts: (order, sorted, starts mask).
    NaN != NaN, so every NaN is a run of its own (the standard's rule for unique)."""
    flat = x.reshape(-1)
    order = xp.argsort(flat, kind="stable")
    ordered = flat[order]
    starts = xp.empty(flat.shape, dtype=bool)
    if flat.size:
        starts[0] = True
        xp.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    return order, ordered, starts


def _count_unique(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    _, _, starts = _runs(xp, ins[0])
    outs[0][...] = xp.count_nonzero(starts)


def _unique(op: str) -> Impl:
    def impl(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
        x = ins[0]
        order, ordered, starts = _runs(xp, x)
        first = xp.nonzero(starts)[0]
        _check_count(op, int(first.size), outs[0].shape[0])
        outs[0][...] = ordered[first]
        if op == "unique_values":
            return
        counts = xp.diff(xp.concatenate([first, xp.asarray([x.size], dtype=first.dtype)]))
        inverse = xp.empty(x.size, dtype=np.int64)
        inverse[order] = xp.cumsum(starts, dtype=np.int64) - 1
        if op == "unique_counts":
            outs[1][...] = counts
        elif op == "unique_inverse":
            outs[1][...] = inverse.reshape(x.shape)
        else:  # unique_all: values, indices (first occurrences: the sort is stable), inverse, counts
            outs[1][...] = order[first]
            outs[2][...] = inverse.reshape(x.shape)
            outs[3][...] = counts
    return impl


def _nonzero(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    indices = xp.nonzero(ins[0])
    _check_count("nonzero", int(indices[0].size), outs[0].shape[1])
    for row, index in zip(outs[0], indices, strict=True):
        row[...] = index


def _compress(xp: Any, ins: Arrays, outs: Arrays, params: Params) -> None:
    x, mask = ins
    selected = x[mask]
    _check_count("compress", int(selected.shape[0]), outs[0].shape[0])
    outs[0][...] = selected


# Ops whose outputs' size the data must confirm: run even when the outputs are empty.
_CHECKS_SIZE = frozenset({"unique_all", "unique_counts", "unique_inverse", "unique_values", "nonzero", "compress"})

_IMPLS: dict[str, Impl] = {
    "matmul": _matmul,
    "linalg.cholesky": _cholesky,
    "linalg.det": _det,
    "linalg.eigh": _eigh,
    "linalg.eigvalsh": _eigvalsh,
    "linalg.inv": _inv,
    "linalg.pinv": _pinv,
    "linalg.qr": _qr,
    "linalg.slogdet": _slogdet,
    "linalg.solve": _solve,
    "linalg.svd": _svd,
    "linalg.svdvals": _svdvals,
    "linalg.matrix_rank": _matrix_rank,
    **{f"fft.{name}": _fft(name) for name in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")},
    **{f"fft.{name}": _fftn(name) for name in ("fftn", "ifftn", "rfftn", "irfftn")},
    "sort": _sort,
    "argsort": _argsort_impl,
    "searchsorted": _searchsorted,
    "cumulative_sum": _cumulative("cumsum"),
    "cumulative_prod": _cumulative("cumprod"),
    "count_unique": _count_unique,
    **{name: _unique(name) for name in ("unique_all", "unique_counts", "unique_inverse", "unique_values")},
    "nonzero": _nonzero,
    "compress": _compress,
}
