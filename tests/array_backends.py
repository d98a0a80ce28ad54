"""The array namespace on each in-process backend (PoCL always; CUDA where the tests run with ``-m cuda``), made
once per test process and shared by the modules that test on every backend."""

from __future__ import annotations

import atexit
from typing import Any

import numpy as np
import pytest

from gpubroker.broker.backends import open_backend
from gpubroker.client.array import namespace

# A test module's ``xp`` fixture takes these params: its tests run on PoCL, and on CUDA under ``-m cuda``.
ARRAY_BACKENDS = [pytest.param("opencl", id="opencl"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]

_namespaces: dict[str, Any] = {}


def namespace_on(backend: str) -> Any:
    """The namespace of one in-process ``backend`` ("opencl" or "cuda") device, opened on first use."""
    if backend not in _namespaces:
        gpu = open_backend(backend)
        atexit.register(gpu.close)
        _namespaces[backend] = namespace(gpu)
    return _namespaces[backend]


def assert_exact(actual: Any, expected: np.ndarray[Any, Any]) -> None:
    """``actual`` (a namespace array) downloaded equals ``expected`` exactly: dtype, shape and every element."""
    host = np.asarray(actual)
    assert host.dtype == expected.dtype, (host.dtype, expected.dtype)
    assert host.shape == expected.shape, (host.shape, expected.shape)
    np.testing.assert_array_equal(host, expected)
