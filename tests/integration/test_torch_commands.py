"""The torch device's commands through a real broker on PoCL: raw TorchOp / TorchOpSync / TorchFromBuffer /
TorchRead / TorchFree through RemoteGpu's ``torch_*`` methods, run by the tenant's sandboxed worker with the real
PyTorch. (The client's torch device, ``gpubroker.client.torch``, builds these same commands.)"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import (
    InvalidArgument,
    NotFound,
    RemoteGpu,
    ResourceExhausted,
    Unimplemented,
    connect,
)
from gpubroker.wire.torch import DeviceArg, TensorArg, TorchOp, TorchOpSync

from ..helpers import contiguous_meta as _meta

pytest.importorskip("torch")  # (the worker runs it: without it, nothing here can run)

QUOTA = 16 << 20


@pytest.fixture(scope="module")
def broker(backend: str) -> Iterator[BrokerProcess]:
    tenants = [TenantSpec("alice", memory_quota=QUOTA), TenantSpec("bob", memory_quota=QUOTA)]
    with BrokerProcess(tenants, backend=backend) as proc:
        yield proc
        log = proc.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "INTERNAL" not in log, log[-4000:]  # every refusal was the tenant's error


@pytest.fixture
def alice(broker: BrokerProcess) -> Iterator[RemoteGpu]:
    with connect(broker.target, token=broker.tokens["alice"]) as gpu:
        yield gpu



def _put(gpu: RemoteGpu, handle: str, data: np.ndarray) -> None:
    buf = gpu.allocate_memory(data.nbytes)
    gpu.copy_h2d(data, buf)
    gpu.torch_from_buffer(handle, buf, _meta(data.shape, str(data.dtype)))
    gpu.free_memory(buf)


def _get(gpu: RemoteGpu, handle: str, shape: Sequence[int], dtype: type = np.float32) -> np.ndarray:
    return np.frombuffer(gpu.torch_read(handle), dtype=dtype).reshape(shape)


@pytest.mark.parametrize("transport", ["ring", "link", "grpc"])
def test_add_view_inplace_and_matmul_run_in_the_worker(broker: BrokerProcess, transport: str) -> None:
    with connect(broker.target, token=broker.tokens["alice"], transport=transport) as gpu:
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        _put(gpu, "a", a)
        gpu.torch_op(TorchOp("aten::add.Tensor", [TensorArg("a"), TensorArg("a")], {}, ["sum"], [_meta((2, 3))]))
        assert _get(gpu, "sum", (2, 3)).tolist() == (a + a).tolist()
        # a view, then an in-place operator through it: the base changes (the storage is shared in the worker)
        gpu.torch_op(TorchOp("aten::select.int", [TensorArg("a"), 0, 1], {}, ["row"],
                             [("float32", (3,), (1,), 3)]))
        gpu.torch_op(TorchOp("aten::mul_.Tensor", [TensorArg("row"), 10], {}, [None], []))
        assert _get(gpu, "a", (2, 3)).tolist() == [[0, 1, 2], [30, 40, 50]]
        gpu.torch_op(TorchOp("aten::t.default", [TensorArg("a")], {}, ["at"], [("float32", (3, 2), (1, 3), 0)]))
        gpu.torch_op(TorchOp("aten::mm.default", [TensorArg("a"), TensorArg("at")], {}, ["gram"], [_meta((2, 2))]))
        done = np.array([[0, 1, 2], [30, 40, 50]], np.float32)
        assert _get(gpu, "gram", (2, 2)).tolist() == (done @ done.T).tolist()
        # out through a buffer, in the view's order
        out = gpu.allocate_memory(24)
        gpu.torch_to_buffer("at", out)
        host = np.empty((3, 2), np.float32)
        gpu.copy_d2h(out, host)
        assert host.tolist() == done.T.tolist()


def test_a_sync_operator_answers_with_what_came_out(alice: RemoteGpu) -> None:
    _put(alice, "x", np.array([[0, 2], [3, 0]], np.float32))
    assert alice.torch_op_sync(TorchOpSync("aten::nonzero.default", [TensorArg("x")], {}, ["nz"])) == [
        ("int64", (2, 2), (1, 2), 0)]
    assert _get(alice, "nz", (2, 2), np.int64).T.tolist() == [[0, 1], [1, 0]]


def test_a_pytorch_error_arrives_at_the_next_waiting_call_with_its_class(alice: RemoteGpu) -> None:
    _put(alice, "m", np.ones((2, 3), np.float32))
    # queued: the call returns, the worker's PyTorch refuses the shapes
    alice.torch_op(TorchOp("aten::mm.default", [TensorArg("m"), TensorArg("m")], {}, ["bad"], [_meta((2, 2))]))
    with pytest.raises(InvalidArgument) as info:
        alice.torch_read("m")
    assert info.value.details["torch_error"] == "RuntimeError"
    assert info.value.details["command"] == "torch operator aten::mm.default"
    # (in the words of PyTorch's meta kernel, which the worker runs first to know what the operator makes)
    assert re.search("mat1 and mat2 shapes cannot be multiplied|must have same reduction dim", info.value.message)
    # the session goes on; the failed operator's handle names nothing, and freeing it is harmless
    alice.torch_free(["bad"])
    assert _get(alice, "m", (2, 3)).sum() == 6
    with pytest.raises(NotFound, match="no tensor 'bad'"):
        alice.torch_read("bad")


def test_an_operator_off_the_allowlist_is_refused_by_the_client_and_by_the_worker(alice: RemoteGpu) -> None:
    with pytest.raises(Unimplemented, match="allowlist"):
        alice.torch_op(TorchOp("aten::from_file.default", ["/etc/passwd"], {}, ["f"], [_meta((1,))]))
    # A client that skips the check: the worker refuses it too, at the next wait.
    alice.transport.submit(TorchOp("aten::from_file.default", ["/etc/passwd"], {}, ["f"], [_meta((1,))]))
    with pytest.raises(Unimplemented, match=r"'aten::from_file\.default' is not on the broker's allowlist"):
        alice.synchronize()


def test_past_the_quota_resource_exhausted_names_the_operator_and_the_session_goes_on(alice: RemoteGpu) -> None:
    before = alice.device_info().memory_used
    n = QUOTA // 4 + 1  # one float32 more than the quota holds
    alice.torch_op(TorchOp("aten::zeros.default", [[n]], {"device": DeviceArg()}, ["huge"], [_meta((n,))]))
    with pytest.raises(ResourceExhausted, match=r"aten::zeros\.default: memory quota exceeded") as info:
        alice.synchronize()
    assert info.value.details["quota"] == QUOTA
    assert alice.device_info().memory_used == before
    alice.torch_op(TorchOp("aten::ones.default", [[4]], {"device": DeviceArg()}, ["small"], [_meta((4,))]))
    assert _get(alice, "small", (4,)).tolist() == [1, 1, 1, 1]


def test_free_gives_the_memory_back(alice: RemoteGpu) -> None:
    before = alice.device_info().memory_used
    n = 1 << 20
    alice.torch_op(TorchOp("aten::zeros.default", [[n]], {"device": DeviceArg()}, ["z"], [_meta((n,))]))
    alice.torch_op(TorchOp("aten::view.default", [TensorArg("z"), [1024, 1024]], {}, ["zv"], [_meta((1024, 1024))]))
    alice.synchronize()
    assert alice.device_info().memory_used == before + 4 * n  # the view costs nothing more
    alice.torch_free(["z"])
    alice.synchronize()
    assert alice.device_info().memory_used == before + 4 * n  # the view still holds the storage
    alice.torch_free(["zv"])
    alice.synchronize()
    assert alice.device_info().memory_used == before


def test_two_tenants_tensors_never_mix(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["alice"]) as a, \
            connect(broker.target, token=broker.tokens["bob"]) as b, \
            connect(broker.target, token=broker.tokens["alice"]) as a2:
        _put(a, "secret", np.full(4, 7, np.float32))
        for other in (b, a2):  # another tenant, and another session of the same tenant
            with pytest.raises(NotFound):
                other.torch_read("secret")
            other.torch_op(TorchOp("aten::neg.default", [TensorArg("secret")], {}, ["stolen"], [_meta((4,))]))
            with pytest.raises(NotFound, match="no tensor 'secret'"):
                other.synchronize()
        _put(b, "secret", np.zeros(4, np.float32))  # the same handle in bob's session is bob's own tensor
        assert _get(b, "secret", (4,)).tolist() == [0, 0, 0, 0]
        assert _get(a, "secret", (4,)).tolist() == [7, 7, 7, 7]


def test_a_closed_sessions_tensors_leave_the_quota_with_it(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["bob"]) as watcher:
        before = watcher.device_info().memory_used
        with connect(broker.target, token=broker.tokens["bob"]) as gone:
            gone.torch_op(TorchOp("aten::ones.default", [[1 << 18]], {"device": DeviceArg()}, ["kept"],
                                  [_meta((1 << 18,))]))
            gone.synchronize()
            assert watcher.device_info().memory_used == before + (1 << 20)
        assert watcher.device_info().memory_used == before  # closed: its tensors went with it
