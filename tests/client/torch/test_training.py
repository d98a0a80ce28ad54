"""A model trains through the device to the same loss as eager CPU: autograd, optimizers, state_dict."""

from __future__ import annotations

import io
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import gpubroker.client.torch as gbtorch  # noqa: E402

X = torch.Generator().manual_seed(1)
INPUTS = torch.randn(128, 32, generator=X)
LABELS = torch.randint(0, 10, (128,), generator=X)


def make() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def train(device: Any, opt_name: str, steps: int = 5, **opt_kwargs: Any) -> tuple[Any, list[float]]:
    model = make().to(device)
    opt = getattr(torch.optim, opt_name)(model.parameters(), lr=1e-2, **opt_kwargs)
    x, y = INPUTS.to(device), LABELS.to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


OPTIMIZERS = [("SGD", {"momentum": 0.9}), ("SGD", {"momentum": 0.9, "foreach": True}), ("Adam", {}),
              ("Adam", {"foreach": True}), ("AdamW", {}), ("AdamW", {"foreach": True}), ("Adam", {"fused": True}),
              ("AdamW", {"fused": True})]


@pytest.mark.parametrize(("opt_name", "opt_kwargs"), OPTIMIZERS, ids=[f"{n}-{k}" for n, k in OPTIMIZERS])
def test_an_mlp_trains_to_the_loss_of_eager_cpu(dev: Any, opt_name: str, opt_kwargs: dict[str, Any]) -> None:
    _, expected = train("cpu", opt_name, **opt_kwargs)
    model, got = train(dev, opt_name, **opt_kwargs)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert got[-1] < got[0]
    eager, _ = train("cpu", opt_name, **opt_kwargs)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert p.device == dev and isinstance(p, torch.nn.Parameter), name
        assert torch.allclose(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6), name


def test_no_grad_and_autograd_grad(dev: Any) -> None:
    model = make().to(dev)
    x = INPUTS.to(dev).requires_grad_()
    with torch.no_grad():
        out = model(x)
    assert not out.requires_grad
    with torch.inference_mode():  # composite operators reach the device undecomposed here
        inferred = model(INPUTS.to(dev)).cpu()
    assert torch.equal(inferred, out.cpu())
    (grad,) = torch.autograd.grad(model(x).sum(), x)
    xc = INPUTS.clone().requires_grad_()
    (expected,) = torch.autograd.grad(make()(xc).sum(), xc)
    assert grad.device == dev
    assert torch.allclose(grad.cpu(), expected, atol=1e-6)


def test_state_dict_round_trips_and_saves_from_the_cpu(dev: Any) -> None:
    model, _ = train(dev, "SGD", steps=2)
    saved = {k: v.cpu() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(model.to("cpu").state_dict(), buf)
    buf.seek(0)
    restored = make()
    restored.load_state_dict(torch.load(buf))
    on_device = make().to(dev)
    on_device.load_state_dict(restored.state_dict())
    for name, value in on_device.state_dict().items():
        assert value.device == dev
        assert torch.equal(value.cpu(), saved[name]), name


def test_training_frees_what_it_drops(gpu: Any, dev: Any) -> None:
    if not hasattr(gpu, "tensors"):
        pytest.skip("counts the fake worker's tensors")
    model = make().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = INPUTS.to(dev), LABELS.to(dev)

    def steps(n: int) -> int:
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        gbtorch.synchronize(dev)
        return len(gpu.tensors)

    after_two = steps(2)
    assert steps(20) <= after_two + 2


def test_an_error_inside_backward_is_deferred_to_the_next_wait(dev: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpubroker.wire import torch_ops

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(dev)
    x = torch.randn(5, 4).to(dev)
    loss = model(x).sum()
    # Refused inside backward: raising there would abort the process, so the error waits for the next wait.
    monkeypatch.setattr(torch_ops, "ALLOWED", torch_ops.ALLOWED - {"aten::threshold_backward.default"})
    loss.backward()
    with pytest.raises(NotImplementedError, match=r"aten::threshold_backward\.default"):
        loss.item()
    assert (x * 2).sum().item() == pytest.approx((x.cpu() * 2).sum().item())  # the session goes on
    with pytest.raises(NotImplementedError, match=r"aten::threshold_backward\.default"):  # outside: at the call
        torch.ops.aten.threshold_backward(x, x, 0.0)


def _decoder_losses(device: Any) -> list[float]:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.ModuleList([torch.nn.Embedding(50, 32), torch.nn.TransformerEncoder(layer, 2),
                                 torch.nn.Linear(32, 50)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(12).to(device)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        logits = model[2](model[1](model[0](ids), mask=mask, is_causal=True))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), ids.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_causal_transformer_trains_to_the_loss_of_eager_cpu(dev: Any) -> None:
    assert _decoder_losses(dev) == pytest.approx(_decoder_losses("cpu"), rel=1e-5, abs=1e-6)


def _cnn(device: Any, train: bool) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, stride=2), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 10)).to(device)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to(device)
    if train:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        return model(x).cpu()


@pytest.mark.parametrize("train", [False, True], ids=["inference", "trained"])
def test_a_cnn_with_batch_norm_matches_eager_cpu(dev: Any, train: bool) -> None:
    # Eval-mode batch norm's saved statistics are empty on the CPU, full on CUDA and on meta: learned from the
    # worker once per signature.
    assert torch.allclose(_cnn(dev, train), _cnn("cpu", train), rtol=1e-5, atol=1e-6)


def test_an_operator_the_worker_makes_otherwise_is_learned_after_its_refusal(
        gpu: Any, dev: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpubroker.client import InvalidArgument
    from gpubroker.client.torch import _session, _tensor
    from tests.client.torch.fake_gpu import FakeTorchGpu

    if not isinstance(gpu, FakeTorchGpu) and gpu.device_info().backend != "opencl":
        pytest.skip("eval-mode batch norm's outputs disagree with meta only on PyTorch's CPU kernels")
    # As if eval-mode batch norm were not known to disagree: the worker refuses its first call, and the client
    # learns from that to ask the worker for its outputs (once per signature).
    disagreeing: set[str] = set()
    monkeypatch.setattr(_session, "DISAGREEING", disagreeing)
    monkeypatch.setattr(_tensor, "DISAGREEING", disagreeing)
    monkeypatch.setattr(_tensor, "LEARN_FROM_WORKER", frozenset())
    _tensor._CACHE.clear()
    with pytest.raises(InvalidArgument, match=r"aten::native_batch_norm\.default made .* disagrees"):
        _cnn(dev, train=False)
    assert disagreeing == {"aten::native_batch_norm.default"}
    assert torch.allclose(_cnn(dev, train=False), _cnn("cpu", train=False), rtol=1e-5, atol=1e-6)
    _tensor._CACHE.clear()  # nothing learned here outlives the patch
