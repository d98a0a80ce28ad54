"""The torch device's worker half in-process: TorchSession on a backend's device (PoCL's CPU device in CI, where
PyTorch's CPU kernels are the device's library; CUDA with -m cuda), through the backends' GpuCompute ``torch_*``
methods and through sessions of their own with a quota."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from gpubroker.broker.backends import TorchAccounts, TorchSession
from gpubroker.client import (
    GpuCompute,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unimplemented,
)
from gpubroker.wire import torch_ops
from gpubroker.wire.torch import (
    Complex,
    DeviceArg,
    DtypeArg,
    TensorArg,
    TensorListArg,
    TorchOp,
    TorchOpSync,
)
from tests.backend_kernels import OpenDevice
from tests.helpers import contiguous_meta as _meta

torch = pytest.importorskip("torch")

BACKENDS = [pytest.param("opencl", id="opencl"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


@pytest.fixture(scope="module", params=BACKENDS)
def gpu(request: pytest.FixtureRequest, open_device: OpenDevice) -> GpuCompute:
    return open_device(request.param)


_count = iter(range(1 << 62))


def _h() -> str:
    return f"t{next(_count)}"



def _put(gpu: GpuCompute, data: np.ndarray) -> str:
    """A tensor holding ``data``, through a buffer (as the client's ``.to(dev)`` does)."""
    buf = gpu.allocate_memory(max(data.nbytes, 1))
    try:
        gpu.copy_h2d(np.ascontiguousarray(data), buf)
        handle = _h()
        gpu.torch_from_buffer(handle, buf, _meta(data.shape, str(torch.from_numpy(data).dtype).removeprefix("torch.")))
        gpu.synchronize()
    finally:
        gpu.free_memory(buf)
    return handle


def _get(gpu: GpuCompute, handle: str, dtype: type, shape: Sequence[int]) -> np.ndarray:
    return np.frombuffer(gpu.torch_read(handle), dtype=dtype).reshape(shape)


def _op(gpu: GpuCompute, name: str, args: list, shape: Sequence[int], dtype: str = "float32",
        kwargs: dict | None = None) -> str:
    out = _h()
    gpu.torch_op(TorchOp(name, args, kwargs or {}, [out], [_meta(shape, dtype)]))
    return out


# -- the allowlist -------------------------------------------------------------------------------------------------
def test_every_listed_operator_is_one_of_pytorchs_and_none_changes_storage_or_process_state() -> None:
    missing = []
    for name in sorted(torch_ops.ALLOWED):
        namespace, op, overload = torch_ops.split_name(name)
        try:
            getattr(getattr(getattr(torch.ops, namespace), op), overload)
        except (AttributeError, RuntimeError):
            missing.append(name)
    assert not missing, f"not operators of torch {torch.__version__}: {missing}"
    assert torch_ops.SYNC <= torch_ops.ALLOWED
    for name in torch_ops.ALLOWED:
        _, op, overload = torch_ops.split_name(name)
        assert name.startswith("aten::")
        assert overload != "out" and not overload.endswith("_out"), name  # out= resizes what was charged
        assert op not in ("resize_", "resize_as_", "set_", "from_file", "save", "load", "_copy_from_and_resize")
        assert "num_threads" not in op and "deterministic" not in op and not op.startswith(("_set", "_use_")), name
    assert torch_ops.allowed("aten::add.Tensor") and not torch_ops.allowed("aten::resize_.default")
    with pytest.raises(ValueError):
        torch_ops.split_name("add")


# -- operators -----------------------------------------------------------------------------------------------------
def test_add_matmul_and_a_reduction_match_numpy(gpu: GpuCompute) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4), dtype=np.float32), rng.standard_normal((4, 5), dtype=np.float32)
    ha, hb = _put(gpu, a), _put(gpu, b)
    total = _op(gpu, "aten::add.Tensor", [TensorArg(ha), TensorArg(ha)], (3, 4), kwargs={"alpha": 2})
    product = _op(gpu, "aten::mm.default", [TensorArg(ha), TensorArg(hb)], (3, 5))
    summed = _op(gpu, "aten::sum.dim_IntList", [TensorArg(product), [1]], (3,))
    np.testing.assert_allclose(_get(gpu, total, np.float32, (3, 4)), 3 * a, rtol=1e-6)
    np.testing.assert_allclose(_get(gpu, product, np.float32, (3, 5)), a @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_get(gpu, summed, np.float32, (3,)), (a @ b).sum(1), rtol=1e-5, atol=1e-5)
    gpu.torch_free([ha, hb, total, product, summed])


def test_an_inplace_op_through_a_view_changes_its_base(gpu: GpuCompute) -> None:
    base = _put(gpu, np.arange(6, dtype=np.float32).reshape(2, 3))
    row = _h()
    gpu.torch_op(TorchOp("aten::select.int", [TensorArg(base), 0, 1], {}, [row], [("float32", (3,), (1,), 3)]))
    gpu.torch_op(TorchOp("aten::add_.Tensor", [TensorArg(row), 100], {}, [None], []))
    assert _get(gpu, base, np.float32, (2, 3)).tolist() == [[0, 1, 2], [103, 104, 105]]
    assert _get(gpu, row, np.float32, (3,)).tolist() == [103, 104, 105]  # the view's own elements
    transposed = _h()
    gpu.torch_op(TorchOp("aten::t.default", [TensorArg(base)], {}, [transposed], [("float32", (3, 2), (1, 3), 0)]))
    out = gpu.allocate_memory(24)
    gpu.torch_to_buffer(transposed, out)  # row-major in the view's order, not the storage's
    host = np.empty((3, 2), np.float32)
    gpu.copy_d2h(out, host)
    assert host.tolist() == [[0, 103], [1, 104], [2, 105]]
    gpu.free_memory(out)
    gpu.torch_free([base, row, transposed])


def test_a_sync_op_returns_its_outputs_metadata_and_plain_values(gpu: GpuCompute) -> None:
    x = _put(gpu, np.array([[0, 1.5], [2, 0]], dtype=np.float32))
    found = _h()
    assert gpu.torch_op_sync(TorchOpSync("aten::nonzero.default", [TensorArg(x)], {}, [found])) == [
        ("int64", (2, 2), (1, 2), 0)]
    assert _get(gpu, found, np.int64, (2, 2)).T.tolist() == [[0, 1], [1, 0]]
    total = _op(gpu, "aten::sum.default", [TensorArg(x)], ())
    assert gpu.torch_op_sync(TorchOpSync("aten::_local_scalar_dense.default", [TensorArg(total)], {}, [None])) == [3.5]
    assert gpu.torch_op_sync(TorchOpSync("aten::equal.default", [TensorArg(x), TensorArg(x)], {}, [None])) == [True]
    gpu.torch_free([x, found, total])


def test_creation_with_the_devices_own_device_and_dtypes_by_name(gpu: GpuCompute) -> None:
    full = _op(gpu, "aten::full.default", [[2, 2], Complex(1.0, 0.0).re], (2, 2), "float64",
               kwargs={"dtype": DtypeArg("float64"), "device": DeviceArg()})
    assert _get(gpu, full, np.float64, (2, 2)).tolist() == [[1, 1], [1, 1]]
    joined = _op(gpu, "aten::cat.default", [TensorListArg([full, full]), 1], (2, 4), "float64")
    assert _get(gpu, joined, np.float64, (2, 4)).sum() == 8
    with pytest.raises(InvalidArgument, match="unknown torch dtype"):
        _op(gpu, "aten::zeros.default", [[2]], (2,), kwargs={"dtype": DtypeArg("float128")})
    # A device is always the worker's own: a string naming another is refused, never parsed.
    with pytest.raises(InvalidArgument, match="device"):
        _op(gpu, "aten::zeros.default", [[2]], (2,), kwargs={"device": "cpu"})
    gpu.torch_free([full, joined])


def test_the_seed_makes_random_operators_repeat(gpu: GpuCompute) -> None:
    draws = []
    for _ in range(2):
        gpu.torch_seed(1234)
        r = _op(gpu, "aten::randn.default", [[8]], (8,), kwargs={"device": DeviceArg()})
        draws.append(_get(gpu, r, np.float32, (8,)))
        gpu.torch_free([r])
    assert draws[0].tolist() == draws[1].tolist() and len(set(draws[0].tolist())) == 8


# -- errors --------------------------------------------------------------------------------------------------------
def test_pytorchs_errors_carry_its_class_and_message_and_the_session_goes_on(gpu: GpuCompute) -> None:
    a = _put(gpu, np.ones((2, 3), np.float32))
    with pytest.raises(InvalidArgument) as info:
        _op(gpu, "aten::mm.default", [TensorArg(a), TensorArg(a)], (2, 2))
        gpu.synchronize()
    assert info.value.details["torch_error"] == "RuntimeError"
    # (in the words of PyTorch's meta kernel, which the worker runs first to know what the operator makes)
    assert "aten::mm.default" in info.value.message and re.search("cannot be multiplied|must have same reduction dim",
                                                                    info.value.message)
    index = _put(gpu, np.array([7], np.int64))
    if gpu.device_info().backend != "cuda":
        # (on CUDA an index out of range is a device-side assert, which breaks this process's context for every
        # later test: tests/client/torch/test_broker.py checks it through a worker)
        with pytest.raises(InvalidArgument) as info:
            _op(gpu, "aten::index_select.default", [TensorArg(a), 0, TensorArg(index)], (1, 3))
            gpu.synchronize()
        assert info.value.details["torch_error"] == "IndexError"
    fine = _op(gpu, "aten::mul.Tensor", [TensorArg(a), 2.0], (2, 3))  # the failed ops' handles were never taken
    assert _get(gpu, fine, np.float32, (2, 3)).sum() == 12
    gpu.torch_free([a, index, fine])


def test_operators_off_the_allowlist_and_unknown_handles_are_refused(gpu: GpuCompute) -> None:
    with pytest.raises(Unimplemented, match=r"aten::from_file\.default"):
        gpu.torch_op(TorchOp("aten::from_file.default", ["/etc/passwd"], {}, ["x"], [_meta((1,))]))
    with pytest.raises(Unimplemented, match="allowlist"):
        gpu.torch_op(TorchOp("aten::resize_.default", [TensorArg("x"), [1 << 40]], {}, [None], []))
    with pytest.raises(NotFound, match="no tensor 'nope'"):
        _op(gpu, "aten::neg.default", [TensorArg("nope")], (1,))
    big = _op(gpu, "aten::zeros.default", [[1 << 19]], (1 << 19,))
    with pytest.raises(OutOfRange, match="through a buffer"):
        gpu.torch_read(big)
    gpu.torch_free([big, "never-made"])  # an unknown handle is skipped


# -- memory --------------------------------------------------------------------------------------------------------
class _Quota(TorchAccounts):
    def __init__(self, quota: int) -> None:
        self.limit, self.used, self.handles = quota, 0, set[str]()

    def claim(self, handles: Sequence[str]) -> None:
        pass

    def bind(self, handle: str) -> None:
        self.handles.add(handle)

    def unbind(self, handles: Sequence[str]) -> None:
        self.handles.difference_update(handles)

    def reserve(self, nbytes: int) -> None:
        if self.used + nbytes > self.limit:
            raise ResourceExhausted(f"quota {self.limit}, used {self.used}, requested {nbytes}", quota=self.limit)
        self.used += nbytes

    def unreserve(self, nbytes: int) -> None:
        self.used -= nbytes

    def quota(self) -> int | None:
        return self.limit


@pytest.fixture
def quota(gpu: GpuCompute) -> Iterator[tuple[TorchSession, _Quota]]:
    accounts = _Quota(1 << 20)
    session = gpu.torch_session(accounts)  # type: ignore[attr-defined]
    yield session, accounts
    session.close()
    assert accounts.used == 0 and not accounts.handles


def _zeros(session: TorchSession, handle: str, n: int) -> None:
    session.op(TorchOp("aten::zeros.default", [[n]], {"device": DeviceArg()}, [handle], [_meta((n,))]))


def test_storage_is_charged_once_per_storage_and_released_with_its_last_view(
        quota: tuple[TorchSession, _Quota]) -> None:
    session, accounts = quota
    _zeros(session, "a", 1000)
    assert accounts.used == 4000
    session.op(TorchOp("aten::view.default", [TensorArg("a"), [10, 100]], {}, ["v"], [_meta((10, 100))]))
    session.op(TorchOp("aten::slice.Tensor", [TensorArg("v"), 0, 2, 4], {}, ["s"], [("float32", (2, 100), (100, 1),
                                                                                        200)]))
    assert accounts.used == 4000 and len(session) == 3  # views share their base's storage
    session.free(["a", "v"])
    assert accounts.used == 4000  # the slice still holds the storage
    session.free(["s"])
    assert accounts.used == 0 and len(session) == 0


def test_past_the_quota_the_operator_is_refused_naming_it_and_the_session_goes_on(
        quota: tuple[TorchSession, _Quota]) -> None:
    session, accounts = quota
    _zeros(session, "a", 200_000)  # 800 kB of the 1 MiB
    with pytest.raises(ResourceExhausted, match=r"aten::cat\.default: quota") as info:
        session.op(TorchOp("aten::cat.default", [TensorListArg(["a", "a"])], {}, ["b"], [_meta((400_000,))]))
    assert info.value.details["quota"] == 1 << 20
    assert accounts.used == 800_000 and len(session) == 1  # nothing kept, nothing charged
    # A client that announces less than the operator makes is charged what it makes, before it runs: the worker
    # works that out itself (on meta tensors, once per signature).
    with pytest.raises(ResourceExhausted, match=r"aten::cat\.default: quota .* requested 1600000"):
        session.op(TorchOp("aten::cat.default", [TensorListArg(["a", "a"])], {}, ["b"], [_meta((4,))]))
    assert accounts.used == 800_000 and len(session) == 1
    session.free(["a"])
    _zeros(session, "c", 250_000)  # room again
    assert accounts.used == 1_000_000


def test_a_bool_argument_and_an_int_one_are_different_signatures(quota: tuple[TorchSession, _Quota]) -> None:
    """``True == 1`` in Python, but ``add(bool_t, True)`` is bool and ``add(bool_t, 1)`` int64: eight times the bytes.
    One cached answer for both would charge the second as the first."""
    session, accounts = quota
    n = 150_000
    session.op(TorchOp("aten::zeros.default", [[n]], {"dtype": DtypeArg("bool"), "device": DeviceArg()}, ["b"],
                       [_meta((n,), "bool")]))
    session.op(TorchOp("aten::add.Scalar", [TensorArg("b"), True], {}, ["same"], [_meta((n,), "bool")]))
    assert accounts.used == 2 * n
    with pytest.raises(ResourceExhausted, match=rf"aten::add\.Scalar: quota .* requested {8 * n}"):
        session.op(TorchOp("aten::add.Scalar", [TensorArg("b"), 1], {}, ["wider"], [_meta((n,), "bool")]))
    assert accounts.used == 2 * n and len(session) == 2


def test_an_inplace_view_operator_makes_every_handles_signature_new(quota: tuple[TorchSession, _Quota]) -> None:
    """``as_strided_`` changes a tensor's shape in place, and every handle of that tensor sees it (``contiguous`` of
    a contiguous tensor is the tensor itself): a signature kept from before would find the one-element answer."""
    session, accounts = quota
    n = 16 << 20  # a 64 MiB copy against the 1 MiB quota
    _zeros(session, "a", 1)
    session.op(TorchOp("aten::contiguous.default", [TensorArg("a")], {}, ["also"], [_meta((1,))]))
    assert session.tensor("also") is session.tensor("a")
    for h in ("a", "also"):
        session.op(TorchOp("aten::clone.default", [TensorArg(h)], {}, [f"c{h}"], [_meta((1,))]))
    session.op(TorchOp("aten::as_strided_.default", [TensorArg("a"), [n], [0]], {}, [None], []))
    for h in ("a", "also"):
        with pytest.raises(ResourceExhausted, match=r"aten::clone\.default: quota .* requested 67108864"):
            session.op(TorchOp("aten::clone.default", [TensorArg(h)], {}, ["big"], [_meta((1,))]))
    assert accounts.used == 12


def test_the_signatures_kept_are_bounded(quota: tuple[TorchSession, _Quota], monkeypatch: pytest.MonkeyPatch) -> None:
    from gpubroker.broker.backends import _torch

    monkeypatch.setattr(_torch, "_PREDICTED_ENTRIES", 8)
    session, _ = quota
    _zeros(session, "a", 64)
    for i in range(1, 33):  # 32 signatures that never repeat (a hostile client's: any number of them)
        session.op(TorchOp("aten::view.default", [TensorArg("a"), [i, 64 // i]], {}, [f"v{i}"], [_meta((i, 64 // i))])
                   if 64 % i == 0 else TorchOp("aten::zeros.default", [[i]], {"device": DeviceArg()}, [f"v{i}"],
                                               [_meta((i,))]))
    assert len(session._predicted) == 8


def test_two_sessions_never_see_each_others_tensors(gpu: GpuCompute) -> None:
    one = gpu.torch_session()  # type: ignore[attr-defined]
    two = gpu.torch_session()  # type: ignore[attr-defined]
    _zeros(one, "same", 4)
    with pytest.raises(NotFound):
        two.read("same")
    _zeros(two, "same", 8)  # the same handle in another session is another tensor
    assert len(one.read("same")) == 16 and len(two.read("same")) == 32
    one.close()
    two.close()


def test_announced_strides_are_kept_and_a_wrong_shape_is_refused(quota: tuple[TorchSession, _Quota]) -> None:
    session, _ = quota
    _zeros(session, "a", 6)
    session.op(TorchOp("aten::view.default", [TensorArg("a"), [2, 3]], {}, ["m"], [_meta((2, 3))]))
    # clone keeps a dense layout as it is: a client that announces the column-major layout gets it
    session.op(TorchOp("aten::clone.default", [TensorArg("m")], {}, ["c"], [("float32", (2, 3), (1, 2), 0)]))
    assert session.tensor("c").stride() == (1, 2)
    with pytest.raises(InvalidArgument, match="shape inference disagrees"):
        session.op(TorchOp("aten::clone.default", [TensorArg("m")], {}, ["d"], [_meta((3, 2))]))
    with pytest.raises(InvalidArgument, match="already in use"):
        _zeros(session, "a", 1)


def test_a_worker_imports_pytorch_at_its_first_torch_command_only() -> None:
    """A worker that runs no torch operator never pays for PyTorch (about 220 MiB and a second or more)."""
    import subprocess
    import sys

    code = ("import sys; import gpubroker.broker.worker._main, gpubroker.broker.backends._opencl, "
            "gpubroker.broker.backends._torch, gpubroker.client; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


def test_a_failure_skips_the_rest_of_its_batch_but_its_torch_frees_still_let_go(open_device: OpenDevice) -> None:
    """Through the worker's executor: a training loop that catches an operator's error and goes on would otherwise
    keep the tensors whose frees were queued behind it on its quota until its session ends."""
    from gpubroker.broker.worker._executor import Executor
    from gpubroker.broker.worker._handles import HandleTables
    from gpubroker.broker.worker._segments import SegmentTable
    from gpubroker.wire.commands import Batch
    from gpubroker.wire.torch import TorchFree

    backend = open_device("opencl")
    tables = HandleTables("alice")
    executor = Executor(backend, tables, SegmentTable(backend))
    zeros = TorchOp("aten::zeros.default", [[1000]], {"device": DeviceArg()}, ["a"], [_meta((1000,))])
    assert executor.run("s1", Batch(1, 0, [zeros])).error is None
    assert tables.memory_used == 4000 and tables.sessions["s1"].kinds["a"] == "tensor"
    bad = TorchOp("aten::mm.default", [TensorArg("a"), TensorArg("a")], {}, ["p"], [_meta((1, 1))])
    neg = TorchOp("aten::neg.default", [TensorArg("a")], {}, ["n"], [_meta((1000,))])
    ack = executor.run("s1", Batch(2, 1, [bad, neg, TorchFree(["a"])]))
    assert (ack.done, ack.error.seq, ack.error.command) == (0, 1, "torch operator aten::mm.default")
    assert ack.error.details["torch_error"] == "RuntimeError"
    objs = tables.sessions["s1"]
    assert tables.memory_used == 0 and "a" not in objs.kinds and "n" not in objs.kinds  # freed; neg skipped
    executor.run("s1", Batch(3, 4, [TorchFree(["a"])]))  # sent again: harmless
    assert tables.memory_used == 0


def test_tensors_share_the_sessions_handle_namespace_and_limit(open_device: OpenDevice) -> None:
    from gpubroker.broker.worker._executor import Executor
    from gpubroker.broker.worker._handles import HandleTables, Limits
    from gpubroker.broker.worker._segments import SegmentTable
    from gpubroker.wire.commands import Allocate, Batch
    from gpubroker.wire.torch import TorchFree

    backend = open_device("opencl")
    tables = HandleTables("alice")
    tables.limits = Limits(memory_quota=1 << 20, max_handles=3)
    executor = Executor(backend, tables, SegmentTable(backend))

    def zeros(handle: str) -> TorchOp:
        return TorchOp("aten::zeros.default", [[4]], {"device": DeviceArg()}, [handle], [_meta((4,))])

    assert executor.run("s1", Batch(1, 0, [Allocate("b1", 64), zeros("t1")])).error is None
    ack = executor.run("s1", Batch(2, 2, [zeros("b1")]))  # a buffer's handle
    assert ack.error is not None and "already in use in this session (a buf)" in ack.error.message
    assert executor.run("s1", Batch(3, 3, [zeros("t2")])).error is None
    ack = executor.run("s1", Batch(4, 4, [zeros("t3")]))
    assert ack.error is not None and ack.error.code == "RESOURCE_EXHAUSTED" and "limit is 3" in ack.error.message
    assert executor.run("s1", Batch(5, 5, [TorchFree(["t1"]), zeros("t3")])).error is None  # room again
    assert executor.run("s2", Batch(6, 0, [zeros("t1")])).error is None  # another session: its own namespace


def test_operators_run_on_the_stream_they_name(gpu: GpuCompute) -> None:
    stream = gpu.create_stream()
    try:
        a = _put(gpu, np.arange(4, dtype=np.float32))
        out = _h()
        gpu.torch_op(TorchOp("aten::mul.Tensor", [TensorArg(a), 3.0], {}, [out], [_meta((4,))], stream.handle))
        assert np.frombuffer(gpu.torch_read(out, stream), np.float32).tolist() == [0, 3, 6, 9]
        with pytest.raises(NotFound):
            gpu.torch_op(TorchOp("aten::neg.default", [TensorArg(a)], {}, [_h()], [_meta((4,))], "s-nope"))
        gpu.torch_free([a, out])
    finally:
        gpu.destroy_stream(stream)


# -- what an operator makes is charged before it runs ------------------------------------------------------------
def _resident_peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def test_every_operator_is_bounded_before_it_runs_by_a_meta_kernel_or_from_its_inputs() -> None:
    from gpubroker.broker.backends._torch import _BOUNDS

    unbounded = []
    for name in sorted(torch_ops.ALLOWED - set(_BOUNDS)):
        _, op, overload = torch_ops.split_name(name)
        schema = getattr(getattr(torch.ops.aten, op), overload)._schema
        makes = any(str(r.type) in ("Tensor", "Optional[Tensor]", "List[Tensor]")
                    and (r.alias_info is None or not r.alias_info.is_write) for r in schema.returns)
        full = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        try:
            meta = any(torch._C._dispatch_has_kernel_for_dispatch_key(full, key) for key in (
                "Meta", "CompositeImplicitAutograd", "CompositeExplicitAutograd",
                "CompositeExplicitAutogradNonFunctional"))
        except RuntimeError:  # (a name the dispatcher does not know: its run refuses it)
            meta = True
        if makes and not meta and name != "aten::_copy_from.default":  # (no CPU or CUDA kernel: a backend's hook)
            unbounded.append(name)
    assert not unbounded, f"no meta kernel and no bound in _torch._BOUNDS: {unbounded}"


def test_a_sync_operator_past_the_quota_is_refused_before_it_makes_anything(
        quota: tuple[TorchSession, _Quota]) -> None:
    session, accounts = quota
    n = 16 << 20  # 64 MiB of float32 against a 1 MiB quota, sent as a TorchOpSync (nothing announced)
    _reset_peak()
    before = _resident_peak()
    with pytest.raises(ResourceExhausted, match=r"aten::ones\.default: quota"):
        session.op_sync(TorchOpSync("aten::ones.default", [[n]], {}, ["big"]))
    session.op(TorchOp("aten::ones.default", [[1]], {}, ["one"], [_meta((1,))]))
    session.op(TorchOp("aten::expand.default", [TensorArg("one"), [n]], {}, ["wide"], [("float32", (n,), (0,), 0)]))
    with pytest.raises(ResourceExhausted, match=r"aten::nonzero\.default: quota"):  # 128 MiB of int64 indices
        session.op_sync(TorchOpSync("aten::nonzero.default", [TensorArg("wide")], {}, ["nz"]))
    with pytest.raises(ResourceExhausted, match=r"aten::contiguous\.default: quota"):  # a copy, 64 MiB
        session.op(TorchOp("aten::contiguous.default", [TensorArg("wide")], {}, ["dense"], [_meta((n,))]))
    assert _resident_peak() - before < 32 << 20
    assert accounts.used == 4 and len(session) == 2
    # Within the quota they run, charged what they made: a view is charged nothing, a copy its bytes.
    session.op(TorchOp("aten::contiguous.default", [TensorArg("one")], {}, ["same"], [_meta((1,))]))
    assert accounts.used == 4
    session.op(TorchOp("aten::slice.Tensor", [TensorArg("wide"), 0, 0, 1000], {}, ["part"],
                       [("float32", (1000,), (0,), 0)]))
    assert session.op_sync(TorchOpSync("aten::nonzero.default", [TensorArg("part")], {}, ["nz"])) == [
        ("int64", (1000, 1), (1, 1000), 0)]
    session.op(TorchOp("aten::reshape.default", [TensorArg("part"), [10, 100]], {}, ["copied"], [_meta((10, 100))]))
    assert accounts.used == 4 + 8000 + 4000


@pytest.mark.parametrize("name, make", [
    ("nonzero", lambda: (torch.ops.aten.nonzero.default, (torch.ones(1 << 18),))),
    ("masked_select", lambda: (torch.ops.aten.masked_select.default, (torch.rand(1 << 18), torch.rand(1 << 18) > .5))),
    ("unique2", lambda: (torch.ops.aten._unique2.default, (torch.randperm(1 << 18), False, True, True))),
    ("unique_dim", lambda: (torch.ops.aten.unique_dim.default, (torch.rand(1 << 18, 1).double(), 0, True, True,
                                                                  True))),
    ("repeat_interleave", lambda: (torch.ops.aten.repeat_interleave.self_Tensor, (torch.rand(1 << 18),
                                                                                   torch.tensor(2)))),
    ("allclose", lambda: (torch.ops.aten.allclose.default, (torch.rand(1 << 18).double(),) * 2)),
])
def test_a_data_dependent_operators_bound_holds_what_its_kernel_touches(name: str, make: object) -> None:
    from gpubroker.broker.backends._torch import _BOUNDS

    func, args = make()  # type: ignore[operator]
    schema = func._schema
    params = {a.name: v for a, v in zip(schema.arguments, args, strict=False)}
    params.update({a.name: a.default_value for a in schema.arguments[len(args):] if a.has_default_value()})
    bound = _BOUNDS[f"{schema.name}.{schema.overload_name or 'default'}"](torch, params)
    func(*args)  # (warm: the CPU thread pool's stacks and PyTorch's first-call state are not the operator's)
    _reset_peak()
    before = _resident_peak()
    func(*args)
    assert _resident_peak() - before <= bound + (2 << 20), name
