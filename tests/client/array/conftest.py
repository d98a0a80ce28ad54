"""The ``xp`` fixture: the Array API namespace on an in-process PoCL device (one per test session)."""

from __future__ import annotations

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
