"""One in-process backend of each kind for the whole session, shared by the contract and the per-backend files.

PoCL starts a compiler per OpenCL context (a third of a second before its first build); one context for these files
pays that once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.backend_kernels import Backend, OpenDevice, unopened


@pytest.fixture(scope="session")
def open_device() -> Iterator[OpenDevice]:
    """``open_device(kind)``: device 0 of ``kind`` ("cuda" or "opencl"), initialized at the first call, closed at the
    session's end."""
    opened: dict[str, Backend] = {}

    def get(kind: str) -> Backend:
        if kind not in opened:
            device = unopened(kind)
            device.initialize()
            opened[kind] = device
        return opened[kind]

    yield get
    for device in opened.values():
        device.close()
