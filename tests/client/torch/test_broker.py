"""The torch device through a real broker on PoCL (CUDA with -m cuda): what only a broker shows: the tenant's
memory quota, two tenants' devices in one process, and the client's CPU per operator with the real transport."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

import gpubroker.client.torch as gbtorch  # noqa: E402
from gpubroker.broker.launcher import BrokerProcess, TenantSpec  # noqa: E402
from gpubroker.client import RemoteGpu, ResourceExhausted, WorkerCrashed, connect  # noqa: E402

QUOTA = 32 << 20


@pytest.fixture(scope="module")
def broker(backend: str) -> Iterator[BrokerProcess]:
    # carol's worker may lose its CUDA context (the device-side assert test): the other tests' sessions are others'
    tenants = [TenantSpec("alice", memory_quota=QUOTA), TenantSpec("bob", memory_quota=QUOTA), TenantSpec("carol")]
    with BrokerProcess(tenants, backend=backend) as proc:
        yield proc
        log = proc.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def alice(broker: BrokerProcess) -> Iterator[RemoteGpu]:
    with connect(broker.target, token=broker.tokens["alice"]) as gpu:
        yield gpu


@pytest.fixture(scope="module")
def bob(broker: BrokerProcess) -> Iterator[RemoteGpu]:
    with connect(broker.target, token=broker.tokens["bob"]) as gpu:
        yield gpu


def test_past_the_quota_an_operator_is_refused_naming_it_and_the_session_goes_on(alice: RemoteGpu) -> None:
    dev = gbtorch.device(alice)
    small = torch.ones(4, device=dev)
    with pytest.raises(ResourceExhausted, match=r"aten::zeros\.default"):
        big = torch.zeros(QUOTA // 4 + 1, device=dev)  # queued: refused by the worker, raised at the next wait
        big.sum().item()
    assert (small * 2).sum().item() == 8.0


def test_two_tenants_devices_in_one_process_never_mix(alice: RemoteGpu, bob: RemoteGpu) -> None:
    dev_a, dev_b = gbtorch.device(alice), gbtorch.device(bob)
    assert dev_a != dev_b
    x = torch.randn(5)
    a, b = x.to(dev_a), x.to(dev_b)
    with pytest.raises(RuntimeError, match="same device"):
        a + b
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([a, b])
    b.copy_(a + 1)  # an explicit copy between devices: through the host, as cuda:0 -> cuda:1 through the GPUs
    assert torch.equal(b.cpu(), x + 1) and torch.equal(a.cpu(), x)


def test_a_device_side_assert_is_raised_at_the_next_wait(broker: BrokerProcess, backend: str) -> None:
    with connect(broker.target, token=broker.tokens["carol"]) as carol:
        dev = gbtorch.device(carol)
        torch._assert_async(torch.tensor(0, device=dev))  # queued: the worker's kernel fails it
        if backend != "cuda":
            with pytest.raises(RuntimeError, match=r"_assert_async"):
                gbtorch.synchronize(dev)
            assert torch.ones(2, device=dev).sum().item() == 2.0  # the session goes on
            return
        # On CUDA, as in eager PyTorch: a device-side assert breaks the context, raised as AcceleratorError. The
        # worker exits; the session's tensors are gone, and a new session gets a fresh worker.
        with pytest.raises(torch.AcceleratorError, match=r"device-side assert.*connect again"):
            gbtorch.synchronize(dev)
        with pytest.raises(WorkerCrashed, match="open a new session"):
            torch.ones(2, device=dev).sum().item()
    with connect(broker.target, token=broker.tokens["carol"]) as again:
        assert torch.ones(2, device=gbtorch.device(again)).sum().item() == 2.0


def test_client_cpu_per_warm_queued_operator_through_the_broker(alice: RemoteGpu,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    dev = gbtorch.device(alice)
    a = torch.randn(64, 64, device=dev)
    b = torch.randn(64, 64, device=dev)
    for _ in range(10):
        a + b
    gbtorch.synchronize(dev)
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(1000):
            a + b
        best = min(best, (time.process_time() - start) / 1000)
        gbtorch.synchronize(dev)
    with capsys.disabled():
        print(f"\nclient CPU per warm queued operator through RemoteGpu ({alice.transport.kind}), a + b: "
              f"{best * 1e6:.1f} us")
    assert best > 0
