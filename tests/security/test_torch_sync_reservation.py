"""A torch operator's outputs are charged to the quota before it runs, whatever the command (issue 21, round 10).

``TorchSession.op`` reserved each new output's bytes from the client's announced metadata before it ran the
operator; ``op_sync`` reserved nothing and settled on what PyTorch made afterwards (``_keep``), and the worker never
checked that a TorchOpSync names an operator of ``torch_ops.SYNC`` (the client sends others that way too, when its
shape inference disagreed with the worker's). A hostile client sent ``aten::ones.default`` of 48 Mi float32 that way
and the worker filled it, then refused it: its peak resident memory (VmHWM) grew by 191 MiB against a 64 MiB quota.
The genuine SYNC operators did the same (``nonzero`` of an expanded view: 16x the view's announced size, +95 MiB),
and so did a TorchOp whose schema says its return aliases its input but which copies (``contiguous`` of a
48 Mi-element expanded view: +192 MiB), reserved nothing.

Now the worker bounds what such an operator makes before it runs: a run on meta copies of its inputs (no memory),
or for operators whose outputs depend on the data, a bound from the inputs (``nonzero``: ``count_nonzero`` first);
the bound is charged, and refused past the quota before anything is allocated. The same holds for a TorchOp
whatever its client announces (the tests at the end): the meta run's answer is cached per operator and input
signature, so a queued operator pays for it once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

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


def _refused_within_the_quota(broker: BrokerProcess, what: str, attack: Callable[[], object]) -> None:
    """``attack`` is refused, and the worker's peak resident memory grew by less than the quota meanwhile."""
    _reset_hwm(broker)
    before = _worker_hwm(broker)
    with pytest.raises(GpuBrokerError) as info:
        attack()
    grew = _worker_hwm(broker) - before
    print(f"\n{type(info.value).__name__}: {info.value}; the worker's VmHWM grew by {grew >> 20} MiB")
    assert grew < QUOTA, f"{what} made the worker touch {grew >> 20} MiB before the {QUOTA >> 20} MiB quota refused it"


def test_sync_operator_output_is_bounded_before_it_is_made(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        _warm(gpu)
        n = 12 << 20  # nonzero of 12 Mi ones: 12 Mi x 1 x 8 bytes = 96 MiB of int64, from a view of 4 bytes
        gpu.torch_op(TorchOp("aten::ones.default", [[1]], {}, ["one"], [("float32", (1,), (1,), 0)]))
        gpu.torch_op(TorchOp("aten::expand.default", [TensorArg("one"), [n]], {}, ["wide"],
                             [("float32", (n,), (0,), 0)]))
        gpu.synchronize()
        _refused_within_the_quota(broker, "aten::nonzero.default", lambda: gpu.torch_op_sync(
            TorchOpSync("aten::nonzero.default", [TensorArg("wide")], {}, ["nz"])))


def test_non_sync_operator_as_sync_is_charged_before_it_runs(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        _warm(gpu)
        n = 48 << 20  # 192 MiB of float32: 3x the quota
        _refused_within_the_quota(broker, "aten::ones.default sent as a TorchOpSync", lambda: gpu.torch_op_sync(
            TorchOpSync("aten::ones.default", [[n]], {}, ["big"])))


def test_aliasing_operator_that_copies_is_charged_before_it_runs(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        _warm(gpu)
        n = 48 << 20  # 192 MiB of float32 once materialized
        gpu.torch_op(TorchOp("aten::ones.default", [[1]], {}, ["one2"], [("float32", (1,), (1,), 0)]))
        gpu.torch_op(TorchOp("aten::expand.default", [TensorArg("one2"), [n]], {}, ["wide2"],
                             [("float32", (n,), (0,), 0)]))
        gpu.synchronize()

        def densify() -> None:
            gpu.torch_op(TorchOp("aten::contiguous.default", [TensorArg("wide2")], {}, ["dense"],
                                 [("float32", (n,), (1,), 0)]))
            gpu.synchronize()

        _refused_within_the_quota(broker, "aten::contiguous.default (an aliasing return)", densify)


# -- a TorchOp whose client announces smaller outputs than the operator makes ------------------------------------
# The worker reserved what the client announced, ran the operator, and only then compared what it made with the
# announcement (INVALID_ARGUMENT): meanwhile it held all of it. Measured before the fix: ``aten::ones`` of 48 Mi
# float32 announced as one element grew the worker's VmHWM by 192 MiB against the 64 MiB quota. Now the worker
# knows each operator's output bytes before it runs it (a meta run, cached per operator and input signature) and
# charges the larger of that and the announcement.
def test_outputs_announced_smaller_than_made_are_charged_before_the_operator_runs(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        _warm(gpu)
        n = 48 << 20  # 192 MiB of float32, announced as 4 bytes

        def ones() -> None:
            gpu.torch_op(TorchOp("aten::ones.default", [[n]], {}, ["lie"], [("float32", (1,), (1,), 0)]))
            gpu.synchronize()

        for _ in range(2):  # (the second time, the worker's answer for this signature comes from its cache)
            _refused_within_the_quota(broker, "aten::ones.default announced as one element", ones)


def test_data_dependent_operator_sent_as_queued_is_bounded_before_it_runs(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        _warm(gpu)
        n = 12 << 20  # nonzero of 12 Mi ones: 96 MiB of int64 indices, announced as one index
        gpu.torch_op(TorchOp("aten::ones.default", [[1]], {}, ["one3"], [("float32", (1,), (1,), 0)]))
        gpu.torch_op(TorchOp("aten::expand.default", [TensorArg("one3"), [n]], {}, ["wide3"],
                             [("float32", (n,), (0,), 0)]))
        gpu.synchronize()

        def nonzero() -> None:
            gpu.torch_op(TorchOp("aten::nonzero.default", [TensorArg("wide3")], {}, ["nz3"],
                                 [("int64", (1, 1), (1, 1), 0)]))
            gpu.synchronize()

        _refused_within_the_quota(broker, "aten::nonzero.default sent as a TorchOp", nonzero)
