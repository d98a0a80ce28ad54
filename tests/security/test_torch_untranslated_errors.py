"""Torch commands a hostile client builds itself are the tenant's errors, never the worker's INTERNAL path with a
traceback in the broker's log (issue 21, round 10: each case below did that before its fix).

The worker wraps what PyTorch raises *running an operator* (``TorchSession._run``) as the tenant's error, but not
what PyTorch, NumPy or the session's own bookkeeping raise around it; ``Executor.run`` then logs it with
``log.exception`` (a ~20-line traceback per command, forwarded by the front as WARNING lines of the broker log)
and answers ``INTERNAL`` (a broker bug, by the project's own reading). Measured on PoCL, each one command:

- ``torch_read`` / ``torch_to_buffer`` of a conjugate view (``aten::conj.default`` of a complex tensor, on the
  allowlist): ``_flat_bytes`` calls ``Tensor.view(uint8)``, which PyTorch refuses for conjugate views
  (RuntimeError);
- ``torch_to_buffer`` of an expanded view (``aten::expand.default`` of one element to 2**40, a view: no memory
  charged) into a 64-byte buffer: ``_flat_bytes`` materializes all of it (``reshape(-1).contiguous()``) before
  anything checks the destination's size, uncharged to the quota; past RLIMIT_DATA PyTorch's "can't allocate
  memory" RuntimeError is not translated (INTERNAL). Below the rlimit the worker allocates and fills that much
  host memory outside the quota before OUT_OF_RANGE;
- ``torch_from_buffer`` with shape ``(2**62, 2)``: ``_nbytes`` multiplies the dims with ``np.prod(dtype=int64)``,
  which wraps to -2**63; the ``> 1 << 48`` check passes, ``accounts.reserve`` is called with a negative count and
  ``np.empty`` raises ValueError;
- ``torch_op_sync`` of ``aten::empty.memory_format`` with ``layout=1`` (a plain int: ``_arg`` passes ints
  through, and PyTorch takes an int for a Layout): a sparse COO tensor, whose ``untyped_storage()`` raises
  NotImplementedError in ``_keep``. The same int trick bypasses the dtype allowlist (``dtype=12``: a qint8 tensor
  is made and kept; see the last test).

The fix: PyTorch's exceptions in ``to_buffer``/``read`` are the tenant's errors (``resolve_conj``/``resolve_neg``
first, so a conjugate view reads its values), a read is bounded by its destination before anything is gathered,
numel is computed in Python ints, and the schema's ScalarType, Layout and MemoryFormat parameters take only
DtypeArg/LayoutArg/MemoryFormatArg (never an int).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, Internal, connect
from gpubroker.client._remote import RemoteGpu
from gpubroker.wire.torch import Complex, DtypeArg, TensorArg, TorchOp, TorchOpSync


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess([TenantSpec("mallory", memory_quota=64 << 20)], backend="opencl") as b:
        yield b


def _error_of(call: Callable[[], object]) -> GpuBrokerError | None:
    try:
        call()
    except GpuBrokerError as exc:
        return exc
    return None


def _check(broker: BrokerProcess, what: str, call: Callable[[], object]) -> None:
    before = broker.log_tail(10**7)
    err = _error_of(call)
    assert err is not None, f"{what} was accepted"
    print(f"\n{what}: {type(err).__name__}: {err}")
    assert not isinstance(err, Internal), (
        f"{what} is a tenant's bad input but came back INTERNAL (a traceback in the broker's log): {err}")
    assert "Traceback" not in broker.log_tail(10**7)[len(before):]


def test_read_of_a_conjugate_view_reads_its_values(broker: BrokerProcess) -> None:
    """(It was INTERNAL: a conjugate view is no plain bytes; now it is resolved first.)"""
    before = broker.log_tail(10**7)
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        gpu.torch_op(TorchOp("aten::full.default", [[4], Complex(1.0, 2.0)], {"dtype": DtypeArg("complex64")},
                             ["c"], [("complex64", (4,), (1,), 0)]))
        gpu.torch_op(TorchOp("aten::conj.default", [TensorArg("c")], {}, ["cj"], [("complex64", (4,), (1,), 0)]))
        data = gpu.torch_read("cj")
    assert np.array_equal(np.frombuffer(data, dtype=np.complex64), np.full(4, 1 - 2j, dtype=np.complex64))
    assert "Traceback" not in broker.log_tail(10**7)[len(before):]


def test_to_buffer_of_huge_expanded_view_is_the_tenants_error(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        n = 1 << 40
        gpu.torch_op(TorchOp("aten::ones.default", [[1]], {}, ["one"], [("float32", (1,), (1,), 0)]))
        gpu.torch_op(TorchOp("aten::expand.default", [TensorArg("one"), [n]], {}, ["big"],
                             [("float32", (n,), (0,), 0)]))
        buf = gpu.allocate_memory(64)

        def attack() -> None:
            gpu.torch_to_buffer("big", buf)
            gpu.synchronize()
        _check(broker, "torch_to_buffer of a 4 TiB expanded view into 64 bytes", attack)


def test_from_buffer_shape_overflow_is_the_tenants_error(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        buf = gpu.allocate_memory(64)

        def attack() -> None:
            gpu.torch_from_buffer("fb", buf, ("float32", (1 << 62, 2), (2, 1), 0))
            gpu.synchronize()
        _check(broker, "torch_from_buffer of shape (2**62, 2)", attack)


def test_int_layout_is_refused(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        _check(broker, "empty.memory_format(layout=1) (sparse COO)", lambda: gpu.torch_op_sync(
            TorchOpSync("aten::empty.memory_format", [[4]], {"layout": 1}, ["sp"])))


def test_int_dtype_does_not_bypass_the_dtype_allowlist(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        err = _error_of(lambda: gpu.torch_op_sync(
            TorchOpSync("aten::empty.memory_format", [[4]], {"dtype": 12}, ["q"])))
        assert err is not None, "a dtype passed as the int 12 made a qint8 tensor, which no DtypeArg may name"
