"""The torch device's client tests: on a fake worker (a dict of CPU tensors) and on an in-process backend (PoCL:
the worker half's TorchSession on PyTorch's CPU kernels). Torch is imported only where it is installed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

GPUS = ["fake", "in-process"]


@pytest.fixture(scope="module", params=GPUS)
def gpu(request: pytest.FixtureRequest) -> Iterator[Any]:
    pytest.importorskip("torch")
    if request.param == "fake":
        from tests.client.torch.fake_gpu import FakeTorchGpu

        yield FakeTorchGpu()
        return
    from gpubroker.broker.backends import open_backend

    backend = open_backend("opencl")
    if not hasattr(backend, "torch_op"):
        backend.close()
        pytest.skip("this backend has no torch_* methods")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def dev(gpu: Any) -> Any:
    import gpubroker.client.torch as gbtorch

    return gbtorch.device(gpu)
