"""Set functions: ``unique_all``, ``unique_counts``, ``unique_inverse``, ``unique_values``.

Their output sizes depend on the data: a first library operation ("count_unique") counts the distinct values into a
0-d array read to the host (the one wait), then the outputs are allocated and the operation queued. NaNs are each
distinct, as the standard says.
"""

from __future__ import annotations

from typing import NamedTuple

from gpubroker.client.array._array import Array
from gpubroker.client.array._library_calls import call, context_of, read_count

__all__ = ["unique_all", "unique_counts", "unique_inverse", "unique_values"]


class UniqueAllResult(NamedTuple):
    values: Array
    indices: Array
    inverse_indices: Array
    counts: Array


class UniqueCountsResult(NamedTuple):
    values: Array
    counts: Array


class UniqueInverseResult(NamedTuple):
    values: Array
    inverse_indices: Array


def _unique(op: str, x: Array) -> list[Array]:
    context_of(x)
    count = 0
    if x.size:
        (counted,) = call("count_unique", [x])
        count = read_count(counted)
    return call(op, [x], {"count": count})


def unique_all(x: Array, /) -> UniqueAllResult:
    """The sorted distinct values of ``x``, the index of each one's first occurrence in the flattened ``x``, the
    index of each element's value among them (of ``x``'s shape), and each value's count."""
    values, indices, inverse, counts = _unique("unique_all", x)
    return UniqueAllResult(values, indices, inverse, counts)


def unique_counts(x: Array, /) -> UniqueCountsResult:
    """The sorted distinct values of ``x`` and each one's count."""
    values, counts = _unique("unique_counts", x)
    return UniqueCountsResult(values, counts)


def unique_inverse(x: Array, /) -> UniqueInverseResult:
    """The sorted distinct values of ``x`` and the index of each element's value among them (``x``'s shape)."""
    values, inverse = _unique("unique_inverse", x)
    return UniqueInverseResult(values, inverse)


def unique_values(x: Array, /) -> Array:
    """The sorted distinct values of ``x`` (1-d)."""
    (values,) = _unique("unique_values", x)
    return values
