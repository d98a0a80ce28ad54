"""The ``xp`` fixture: the Array API namespace on an in-process PoCL device (one per test session)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from gpubroker.broker.backends import open_backend
from gpubroker.client.array import namespace


@pytest.fixture(scope="session")
def xp() -> Iterator[Any]:
    """``gpubroker.client.array.namespace`` of an in-process OpenCL (PoCL) backend."""
    gpu = open_backend("opencl")
    try:
        yield namespace(gpu)
    finally:
        gpu.close()


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
