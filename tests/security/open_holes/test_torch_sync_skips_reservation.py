"""Open hole (issue 21, round 10): a TorchOpSync runs its operator before anything is charged to the quota.

``TorchSession.op`` reserves each new output's bytes (from the client's announced metadata) before it runs the
operator; ``op_sync`` reserves nothing and settles on what PyTorch made afterwards (``_keep``). The worker never
checks that a TorchOpSync names an operator of ``torch_ops.SYNC``: a hostile client sends any allowlisted operator
that way (``aten::ones.default`` of 48 Mi float32) and the worker allocates and fills it, then refuses it
(RESOURCE_EXHAUSTED). Even the genuine SYNC operators do the same (``aten::nonzero.default`` of an expanded view:
an int64 output of numel x ndim, 16x the input's announced size, on a view that took no memory at all).

Measured on PoCL with a 64 MiB quota: the worker's peak resident memory (VmHWM) grew by 191 MiB for one ``ones``
sent as a TorchOpSync, 3x the tenant's quota, where the same operator as a TorchOp was refused before it ran (no
growth), and by 96 MiB for the ``nonzero``. The bound left is RLIMIT_DATA (quota + shared + the runtime's 576 MiB
here): host memory the quota does not hold, as the quota's docs promise it does for every tensor. On CUDA the same
path goes to PyTorch's caching allocator, bounded only by ``set_per_process_memory_fraction`` (quota / total) beside
CuPy's own pool.

The same for a TorchOp whose schema says its return aliases its input (``aten::contiguous.default``,
``reshape``, ``flatten``, ``to.dtype``: ``Tensor(a)``), which ``op`` reserves nothing for, but which copies when
the input is not laid out for a view: ``contiguous`` of a 48 Mi-element expanded view (stride 0, no memory)
fills 192 MiB (VmHWM +193 MiB) before ``_keep`` refuses it (third test).

Fix: refuse a TorchOpSync whose operator is not in ``torch_ops.SYNC`` (and a TorchOp whose operator is); for the
SYNC ones, bound the output before allocating it (``nonzero``: ``count_nonzero`` first and reserve numel x ndim x
8; ``masked_select``, ``unique*``, ``repeat_interleave``: likewise from a count), or run them under the quota's
remaining bytes as an allocator limit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec, descendants
from gpubroker.client import GpuBrokerError, connect
from gpubroker.client._remote import RemoteGpu
from gpubroker.wire.torch import TensorArg, TorchOp, TorchOpSync

QUOTA = 64 << 20


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess([TenantSpec("mallory", memory_quota=QUOTA)], backend="opencl") as b:
        yield b


def _reset_hwm(broker: BrokerProcess) -> None:
    """Reset the peak resident memory of the broker's descendants (``clear_refs`` 5), so each test measures its own."""
    assert broker.process is not None
    for pid in descendants(broker.process.pid):
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def _worker_hwm(broker: BrokerProcess) -> int:
    """The largest VmHWM (bytes) among the broker's descendants: the worker, once PyTorch is imported in it."""
    assert broker.process is not None
    peak = 0
    for pid in descendants(broker.process.pid):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            pass
    return peak


def _warm(gpu: RemoteGpu) -> None:
    gpu.torch_op(TorchOp("aten::ones.default", [[4]], {}, ["warm"], [("float32", (4,), (1,), 0)]))
    gpu.torch_read("warm")  # (PyTorch imported and warm: its own memory is in the baseline)


def test_sync_operator_output_is_bounded_before_it_is_made(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        _warm(gpu)
        n = 12 << 20  # nonzero of 12 Mi ones: 12 Mi x 1 x 8 bytes = 96 MiB of int64, from a view of 4 bytes
        gpu.torch_op(TorchOp("aten::ones.default", [[1]], {}, ["one"], [("float32", (1,), (1,), 0)]))
        gpu.torch_op(TorchOp("aten::expand.default", [TensorArg("one"), [n]], {}, ["wide"],
                             [("float32", (n,), (0,), 0)]))
        gpu.synchronize()
        _reset_hwm(broker)
        before = _worker_hwm(broker)
        with pytest.raises(GpuBrokerError) as info:
            gpu.torch_op_sync(TorchOpSync("aten::nonzero.default", [TensorArg("wide")], {}, ["nz"]))
        grew = _worker_hwm(broker) - before
        print(f"\n{type(info.value).__name__}: {info.value}; the worker's VmHWM grew by {grew >> 20} MiB")
        assert grew < QUOTA, (f"aten::nonzero.default made the worker touch {grew >> 20} MiB before the "
                              f"{QUOTA >> 20} MiB quota refused its output")


def test_non_sync_operator_as_sync_is_charged_before_it_runs(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        _warm(gpu)
        _reset_hwm(broker)
        before = _worker_hwm(broker)
        n = 48 << 20  # 192 MiB of float32: 3x the quota
        with pytest.raises(GpuBrokerError) as info:
            gpu.torch_op_sync(TorchOpSync("aten::ones.default", [[n]], {}, ["big"]))
        grew = _worker_hwm(broker) - before
        print(f"\n{type(info.value).__name__}: {info.value}; the worker's VmHWM grew by {grew >> 20} MiB")
        assert grew < QUOTA, (f"aten::ones.default sent as a TorchOpSync made the worker touch {grew >> 20} MiB "
                              f"before the {QUOTA >> 20} MiB quota refused it")


def test_aliasing_operator_that_copies_is_charged_before_it_runs(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        _warm(gpu)
        n = 48 << 20  # 192 MiB of float32 once materialized
        gpu.torch_op(TorchOp("aten::ones.default", [[1]], {}, ["one2"], [("float32", (1,), (1,), 0)]))
        gpu.torch_op(TorchOp("aten::expand.default", [TensorArg("one2"), [n]], {}, ["wide2"],
                             [("float32", (n,), (0,), 0)]))
        gpu.synchronize()
        _reset_hwm(broker)
        before = _worker_hwm(broker)
        with pytest.raises(GpuBrokerError) as info:
            gpu.torch_op(TorchOp("aten::contiguous.default", [TensorArg("wide2")], {}, ["dense"],
                                 [("float32", (n,), (1,), 0)]))
            gpu.synchronize()
        grew = _worker_hwm(broker) - before
        print(f"\n{type(info.value).__name__}: {info.value}; the worker's VmHWM grew by {grew >> 20} MiB")
        assert grew < QUOTA, (f"aten::contiguous.default (an aliasing return: nothing reserved) made the worker touch "
                              f"{grew >> 20} MiB before the {QUOTA >> 20} MiB quota refused it")
