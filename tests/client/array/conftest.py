"""The ``xp`` fixture: the Array API namespace on an in-process PoCL device (one per test session)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.array_backends import namespace_on


@pytest.fixture(scope="session")
def xp() -> Any:
    """``gpubroker.client.array.namespace`` of an in-process OpenCL (PoCL) backend: the one every array test module
    shares (tests/array_backends.py), so kernels compiled for one file serve the others."""
    return namespace_on("opencl")


@pytest.fixture(autouse=True)
def _quick_pocl_builds() -> Iterator[None]:
    """PoCL builds these tests' kernels without LLVM's optimizations (``-cl-opt-disable``: IEEE results unchanged).

    The namespace's tests compile several hundred generated kernels (one per operation, dtypes and layout), each
    0.2-1.2 s with optimization on 2 CPU cores; unoptimized builds take about 40 % less, and these tests check
    results, not kernel speed. PoCL reads the variable at every build. Set around each test of this folder only, then
    restored: the rest of the suite (timing-sensitive fairness tests among it) builds as it always did.
    """
    before = os.environ.get("POCL_EXTRA_BUILD_FLAGS")
    os.environ["POCL_EXTRA_BUILD_FLAGS"] = "-cl-opt-disable"
    try:
        yield
    finally:
        if before is None:
            del os.environ["POCL_EXTRA_BUILD_FLAGS"]
        else:
            os.environ["POCL_EXTRA_BUILD_FLAGS"] = before
