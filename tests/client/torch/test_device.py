"""The gpubroker torch device: moving data, operators, views, what waits, devices that must not mix."""

from __future__ import annotations

import io
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import gpubroker.client.torch as gbtorch  # noqa: E402


def test_tensors_report_the_device_and_move_both_ways(dev: Any) -> None:
    x = torch.randn(3, 4)
    y = x.to(dev)
    assert y.device == dev and y.device.type == "gpubroker"
    assert not y.is_cuda and y.is_gpubroker
    assert (y.shape, y.stride(), y.dtype) == (x.shape, x.stride(), x.dtype)
    assert torch.equal(y.cpu(), x)
    assert torch.equal(y.to("cpu", torch.float64), x.double())
    assert y.tolist() == x.tolist()
    assert torch.equal(torch.tensor([1, 2, 3], device=dev).cpu(), torch.tensor([1, 2, 3]))
    assert torch.equal(torch.zeros(2, 3, device=dev, dtype=torch.int32).cpu(), torch.zeros(2, 3, dtype=torch.int32))
    big = torch.arange(300_000, dtype=torch.float32)  # past one torch_read: through a buffer
    assert torch.equal(big.to(dev).cpu(), big)
    assert torch.equal(torch.empty(0, 3).to(dev).cpu(), torch.empty(0, 3))


def test_a_broadcast_element_moves_both_ways(dev: Any) -> None:
    one = torch.tensor(5.0).expand(1, 1)  # stride 0, yet contiguous: x.to(dev) keeps those strides, as on CUDA
    assert torch.equal(one.to(dev).cpu(), one)


def test_operators_match_eager_cpu(dev: Any) -> None:
    x = torch.randn(5, 6)
    y = x.to(dev)
    assert torch.allclose(((y * 2 + 1).relu() @ y.t()).cpu(), (x * 2 + 1).relu() @ x.t())
    assert torch.allclose(y.softmax(-1).sum(0).cpu(), x.softmax(-1).sum(0))
    # (absolute: 30 terms of about 1 may cancel to a small sum, whose relative error a GPU's order of adds can grow)
    assert y.sum().item() == pytest.approx(x.sum().item(), abs=1e-5)
    assert torch.equal((y + torch.tensor(2.0)).cpu(), x + torch.tensor(2.0))  # a CPU scalar tensor is fine
    assert torch.equal(y[torch.tensor([0, 2])].cpu(), x[torch.tensor([0, 2])])  # CPU indices too, as on CUDA
    assert torch.equal((y > 0).nonzero().cpu(), (x > 0).nonzero())  # a data-dependent shape: waits
    assert torch.equal(y[y > 0].cpu(), x[x > 0])
    assert bool((y == y).all())
    a, b = y.chunk(2, dim=1)
    assert torch.equal(a.cpu(), x[:, :3]) and torch.equal(b.cpu(), x[:, 3:])


def test_factories_make_one_operator_each(dev: Any) -> None:
    # PyTorch's own kernels for these make an empty tensor and resize it: one allowlisted operator each instead.
    assert torch.equal(torch.arange(10, device=dev).cpu(), torch.arange(10))
    assert torch.equal(torch.arange(0, 1, 0.25, device=dev).cpu(), torch.arange(0, 1, 0.25))
    assert torch.equal(torch.arange(0, 1, 0.5, device=dev).cpu(), torch.arange(0, 1, 0.5))  # a float's value: a shape
    x = torch.randn(1, 1, 3, 3)
    for scale in (2.0, 3.0):  # the scale factor decides the shape too
        up = torch.ops.aten.upsample_nearest2d.vec(x.to(dev), None, [scale, scale])
        assert torch.equal(up.cpu(), torch.ops.aten.upsample_nearest2d.vec(x, None, [scale, scale]))
    assert torch.allclose(torch.linspace(0, 1, 5, device=dev).cpu(), torch.linspace(0, 1, 5))
    assert torch.equal(torch.eye(3, device=dev).cpu(), torch.eye(3))
    assert torch.equal(torch.full((2, 3), 7.0, device=dev).cpu(), torch.full((2, 3), 7.0))
    assert torch.equal(torch.ones(2, device=dev, dtype=torch.int64).cpu(), torch.ones(2, dtype=torch.int64))


def test_views_share_storage_and_inplace_view_ops_restride(dev: Any) -> None:
    x = torch.randn(3, 4)
    y = x.to(dev)
    y[1].add_(100)
    x[1].add_(100)
    assert torch.equal(y.cpu(), x)
    t = y.t()
    assert t.stride() == (1, 4) and torch.equal(t.cpu(), x.t())
    assert t.cpu().stride() == (1, 4)  # .cpu() keeps dense strides, as from CUDA
    c = y.clone().t_()
    assert (c.shape, c.stride()) == (torch.Size([4, 3]), (1, 4)) and torch.equal(c.cpu(), x.t())
    s = y.clone().unsqueeze_(0)
    assert s.shape == (1, 3, 4) and torch.equal(s.cpu(), x.unsqueeze(0))
    y[0, 1] = 5
    x[0, 1] = 5
    assert torch.equal(y.cpu(), x)


def test_print_and_repr(dev: Any) -> None:
    y = torch.tensor([1.5, 2.0], device=dev)
    assert repr(y) == f"tensor([1.5000, 2.0000], device='{dev}')"
    assert repr(y.to(torch.int32)) == f"tensor([1, 2], device='{dev}', dtype=torch.int32)"
    assert repr(y.requires_grad_()) == f"tensor([1.5000, 2.0000], device='{dev}', requires_grad=True)"
    assert f"{y.sum():.2f}" == "3.50"


def test_what_is_refused_like_cuda(dev: Any) -> None:
    y = torch.randn(3, device=dev)
    with pytest.raises(TypeError, match=r"Use Tensor\.cpu"):
        y.numpy()
    with pytest.raises(RuntimeError, match=r"torch\.save"):
        torch.save(y, io.BytesIO())
    with pytest.raises(NotImplementedError, match="resiz"):
        y.resize_(10)
    with pytest.raises(RuntimeError, match="same device"):
        y + torch.randn(3)  # a CPU tensor with dimensions


def test_device_takes_a_gpucompute() -> None:
    with pytest.raises(TypeError, match="takes a GpuCompute"):
        gbtorch.device(object())  # type: ignore[arg-type]


def test_autocast_disables_itself_with_pytorchs_warning(dev: Any) -> None:
    with pytest.warns(UserWarning, match="Disabling autocast"), torch.autocast("gpubroker", dtype=torch.bfloat16):
        product = torch.ones(2, 2, device=dev) @ torch.ones(2, 2, device=dev)
    assert product.dtype == torch.float32 and torch.equal(product.cpu(), torch.full((2, 2), 2.0))


def test_an_operator_outside_the_allowlist_is_refused_before_sending(dev: Any, gpu: Any) -> None:
    y = torch.randn(4, device=dev)
    before = dict(getattr(gpu, "counts", {}))
    with pytest.raises(NotImplementedError, match=r"aten::polygamma\.default"):
        torch.polygamma(1, y)
    assert dict(getattr(gpu, "counts", {})) == before  # nothing sent


def test_a_shape_error_is_raised_at_the_call_with_pytorchs_message(dev: Any) -> None:
    # (a worker finds an operator's outputs on meta tensors before it runs it, to charge them to the quota first: an
    # operator the meta kernel refuses is not run, and the error is in that kernel's words)
    with pytest.raises(RuntimeError, match=r"size of tensor a \(3\) must match the size of tensor b \(4\)"
                                           r"|broadcast a dimension of length 4"):
        torch.randn(3, device=dev) + torch.randn(4, device=dev)


def test_a_queued_error_is_raised_at_the_next_wait_as_pytorchs_class(dev: Any, backend: str) -> None:
    if backend == "cuda":
        pytest.skip("on CUDA an index out of range is a device-side assert, which ends the session: "
                    "test_broker.py's test_a_device_side_assert_is_raised_at_the_next_wait")
    y = torch.randn(3, device=dev)
    with pytest.raises(IndexError, match=r"aten::index\.Tensor.*index 7 is out of bounds"):
        # Queued (the index is checked by the worker's kernel): raised by the next wait; in-process backends run
        # it at once.
        y[torch.tensor([7]).to(dev)].cpu()
    assert torch.equal((y * 2).cpu(), y.cpu() * 2)  # the session goes on


def test_a_synchronous_error_is_raised_at_the_call(dev: Any) -> None:
    y = torch.randn(3, device=dev)
    with pytest.raises(RuntimeError, match="must match"):
        torch.masked_select(y, torch.ones(4, dtype=torch.bool, device=dev))  # waits: the worker refuses it


def test_seeding_makes_random_ops_reproducible(dev: Any) -> None:
    torch.manual_seed(123)
    a = torch.randn(8, device=dev).cpu()
    torch.manual_seed(123)
    b = torch.randn(8, device=dev).cpu()
    assert torch.equal(a, b)


def test_a_new_device_starts_from_the_process_seed() -> None:
    from tests.client.torch.fake_gpu import FakeTorchGpu

    torch.manual_seed(7)  # before the device exists, as CUDA allows
    gpu = FakeTorchGpu()
    gbtorch.device(gpu)
    assert ("seed", 7) in gpu.queue  # its worker's generator is seeded


def test_two_devices_never_mix(gpu: Any, dev: Any) -> None:
    from tests.client.torch.fake_gpu import FakeTorchGpu

    other = gbtorch.device(FakeTorchGpu())
    assert other != dev and other.type == "gpubroker" and gbtorch.device(gpu) == dev
    x = torch.randn(3)
    a, b = x.to(dev), x.to(other)
    with pytest.raises(RuntimeError, match=f"same device.*{dev}.*{other}"):
        a + b
    assert torch.equal(a.to(other).cpu(), x)  # an explicit copy between devices goes through the host
    b.copy_(a * 2)
    assert torch.equal(b.cpu(), x * 2)
    assert torch.gpubroker.device_count() >= 2


def test_dropped_tensors_are_freed_in_batches(gpu: Any, dev: Any) -> None:
    if not hasattr(gpu, "tensors"):
        pytest.skip("counts the fake worker's tensors")
    y = torch.randn(16, device=dev)
    gbtorch.synchronize(dev)
    live = len(gpu.tensors)
    frees = gpu.counts["torch_free"]
    for _ in range(640):
        y = y + 1
    gbtorch.synchronize(dev)
    assert len(gpu.tensors) <= live + 1
    assert gpu.counts["torch_free"] - frees <= 640 // 64 + 1  # batched, not one command per tensor


def test_an_empty_tensor_nothing_names_is_never_made() -> None:
    from tests.client.torch.fake_gpu import FakeTorchGpu

    gpu = FakeTorchGpu()
    dev = gbtorch.device(gpu)
    x = torch.ones(4, device=dev)
    made = gpu.counts["torch_op"]
    # An inference pass's batch norm makes a 0-byte reserve per layer that nothing reads: dropped before any
    # operator named it, it costs the worker nothing.
    reserve = torch.empty(0, dtype=torch.uint8, device=dev)
    y = x + 1
    del reserve
    gbtorch.synchronize(dev)
    assert gpu.counts["torch_op"] - made == 1  # the add alone
    out = torch.empty(4, device=dev)  # one an operator writes is made first
    out.copy_(y + 1)
    assert torch.equal(out.cpu(), torch.full((4,), 3.0))
    kept = torch.empty(2, device=dev)  # and one alive at a wait is made there
    gbtorch.synchronize(dev)
    assert kept.shape == (2,) and gpu.counts["torch_op"] - made == 5
