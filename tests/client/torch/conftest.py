"""The torch device's client tests, on three GpuComputes: a fake worker (a dict of CPU tensors), an in-process
backend (the worker half's TorchSession: PyTorch's CPU kernels on PoCL, CUDA with -m cuda), and a RemoteGpu on a
real broker (one per test module: the tenant's sandboxed worker runs the operators). Torch is imported only where
it is installed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

GPUS = ["fake", "in-process", "broker"]


@pytest.fixture(scope="module")
def torch_broker(backend: str) -> Iterator[Any]:
    """A broker of this module's own, with two tenants."""
    from gpubroker.broker.launcher import BrokerProcess, TenantSpec

    tenants = [TenantSpec("alice", memory_quota=1 << 30), TenantSpec("bob", memory_quota=1 << 30)]
    with BrokerProcess(tenants, backend=backend) as proc:
        yield proc
        log = proc.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]  # every refusal was a clear status, never a crash


@pytest.fixture(scope="module", params=GPUS)
def gpu(request: pytest.FixtureRequest, backend: str) -> Iterator[Any]:
    pytest.importorskip("torch")
    if request.param == "fake":
        if backend != "opencl":
            pytest.skip("the fake worker runs once, with the OpenCL parameters")
        from tests.client.torch.fake_gpu import FakeTorchGpu

        yield FakeTorchGpu()
    elif request.param == "in-process":
        from gpubroker.broker.backends import open_backend

        with open_backend(backend) as gpu:
            yield gpu
    else:
        from gpubroker.client import connect

        proc = request.getfixturevalue("torch_broker")
        with connect(proc.target, token=proc.tokens["alice"]) as gpu:
            yield gpu


@pytest.fixture(scope="module")
def dev(gpu: Any) -> Any:
    import gpubroker.client.torch as gbtorch

    return gbtorch.device(gpu)
