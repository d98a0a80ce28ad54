"""Library operations through a broker (sandboxed worker) on every transport, with queued commands: results,
refusals that name the op and leave the session working, and nonsense params that never hurt the worker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from gpubroker.client import ArrayRef, Buffer, InvalidArgument, RemoteGpu, library_outputs
from gpubroker.wire.commands import RunLibrary

from ..conftest import TRANSPORTS, OpenGpu
from ..library_calls import allocate, download, run_op, upload

rng = np.random.default_rng(1414)


@pytest.fixture(scope="module", params=TRANSPORTS)
def gpu(open_gpu: OpenGpu, request: pytest.FixtureRequest) -> Iterator[RemoteGpu]:
    with open_gpu("bob", request.param, async_commands=True) as g:
        yield g


def test_svd_and_matmul_round_trip(gpu: RemoteGpu) -> None:
    x = rng.standard_normal((4, 64, 48)).astype(np.float32)
    u, s, vh = run_op(gpu, "linalg.svd", [x], {"full_matrices": False})
    np.testing.assert_allclose(s, np.linalg.svdvals(x), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose((u * s[..., None, :]) @ vh, x, rtol=1e-4, atol=1e-4)
    a, b = rng.standard_normal((3, 1, 40, 30)), rng.standard_normal((5, 30, 20))
    (c,) = run_op(gpu, "matmul", [a, b])
    np.testing.assert_allclose(c, a @ b, rtol=1e-10)


def test_a_chain_of_library_ops_queues_without_waiting(gpu: RemoteGpu) -> None:
    # matmul -> inv -> matmul on device buffers, one download at the end: x @ inv(x) is the identity.
    buffers: list[Buffer] = []
    x = rng.standard_normal((16, 16)) + 16 * np.eye(16)
    ref = upload(gpu, x, buffers)
    inverse = allocate(gpu, "float64", (16, 16), buffers)
    product = allocate(gpu, "float64", (16, 16), buffers)
    gpu.run_library("linalg.inv", [ref], [inverse])
    gpu.run_library("matmul", [ref, inverse], [product])
    np.testing.assert_allclose(download(gpu, product), np.eye(16), atol=1e-10)
    for buf in buffers:
        gpu.free_memory(buf)


def _send(gpu: RemoteGpu, command: RunLibrary) -> None:
    """Past the client's own checks, straight to the worker (as a hostile or buggy client would)."""
    gpu.transport.submit(command)


def test_bad_calls_raise_invalid_argument_naming_the_op_and_later_work_runs(gpu: RemoteGpu) -> None:
    buffers: list[Buffer] = []
    x = rng.standard_normal((6, 6)) + 6 * np.eye(6)
    ref = upload(gpu, x, buffers)
    out = allocate(gpu, "float64", (6, 6), buffers)
    small = allocate(gpu, "float64", (2, 2), buffers)
    wire_in, wire_out = ((ref.buffer.handle, ref.buffer.offset), "float64", (6, 6)), \
        ((out.buffer.handle, out.buffer.offset), "float64", (6, 6))
    cases: list[tuple[RunLibrary, str]] = [
        (RunLibrary("linalg.inv", [((ref.buffer.handle, ref.buffer.offset), "float64", (5, 7))], [wire_out]),
         r"linalg.inv: x must be a stack of square matrices"),
        (RunLibrary("linalg.inv", [wire_in], [((small.buffer.handle, small.buffer.offset), "float64", (6, 6))]),
         r"linalg.inv: outputs\[0\] .* overruns its"),
        (RunLibrary("linalg.eig", [wire_in], [wire_out]), r"unknown library op 'linalg.eig'"),
        (RunLibrary("linalg.inv", [wire_in], [wire_out], {"upper": True}), r"linalg.inv: unknown param 'upper'"),
        (RunLibrary("linalg.inv", [wire_in], [((out.buffer.handle, out.buffer.offset), "float32", (6, 6))]),
         r"linalg.inv: output 0 must be float64 of shape \(6, 6\), got float32"),
    ]
    for command, message in cases:
        _send(gpu, command)
        with pytest.raises(InvalidArgument, match=message) as info:
            gpu.synchronize()
        assert f"(run_library of {command.name!r}) failed" in str(info.value)
        gpu.run_library("linalg.inv", [ref], [out])  # later work still runs
        np.testing.assert_allclose(download(gpu, out), np.linalg.inv(x), rtol=1e-9)
    # The same mistakes through RemoteGpu.run_library raise at the call (the client checks the table too).
    with pytest.raises(InvalidArgument, match=r"^linalg.inv: output 0 must be float64"):
        gpu.run_library("linalg.inv", [ref], [ArrayRef(out.buffer, "float32", (6, 6))])
    with pytest.raises(InvalidArgument, match=r"^linalg.inv: outputs\[0\] .* overruns"):
        gpu.run_library("linalg.inv", [ref], [ArrayRef(small.buffer, "float64", (6, 6))])
    for buf in buffers:
        gpu.free_memory(buf)


def test_a_data_dependent_size_that_is_wrong_is_refused(gpu: RemoteGpu) -> None:
    x = np.array([3, 1, 3, 2, 1], dtype=np.int32)
    (count,) = run_op(gpu, "count_unique", [x])
    assert count == 3
    with pytest.raises(InvalidArgument, match=r"unique_all: the result has 3 element\(s\)"):
        run_op(gpu, "unique_all", [x], {"count": 2})
        gpu.synchronize()
    values, indices, inverse, counts = run_op(gpu, "unique_all", [x], {"count": int(count)})
    np.testing.assert_array_equal(values, [1, 2, 3])
    np.testing.assert_array_equal(indices, [1, 3, 0])
    np.testing.assert_array_equal(inverse, [2, 0, 2, 1, 0])
    np.testing.assert_array_equal(counts, [2, 1, 2])


_NONSENSE: list[Any] = [
    None, True, -1, 0, 1 << 40, -(1 << 62), 1.5, float("nan"), float("inf"), "", "x" * 32, "ortho", "left",
    [], [0], [-1, -1], [1 << 40], [0] * 32, [-(1 << 62)] * 3,
]


def test_nonsense_params_never_hurt_the_worker(gpu: RemoteGpu) -> None:
    """Every op with random params of every wire type, sent past the client's checks: each call runs or is
    refused with InvalidArgument naming the op; the worker keeps serving."""
    from gpubroker.client import LIBRARY_OPS

    buffers: list[Buffer] = []
    arrays = {dtype: upload(gpu, rng.standard_normal((3, 4)).astype(dtype), buffers)
              for dtype in ("float32", "float64", "complex64", "int64")}
    arrays["bool"] = upload(gpu, rng.standard_normal((3, 4)) > 0, buffers)
    scratch = gpu.allocate_memory(1 << 16)
    buffers.append(scratch)
    local = np.random.default_rng(7)
    sent = refused = 0
    for op, entry in LIBRARY_OPS.items():
        dtype = entry.dtypes[-1] if entry.dtypes[-1] in arrays else "float64"
        inputs = [arrays["bool"] if op == "compress" and i == 1 else arrays[dtype] for i in range(entry.inputs)]
        names = [*entry.params, "bogus"]
        for _ in range(6):
            params = {str(local.choice(names)): _NONSENSE[local.integers(len(_NONSENSE))]
                      for _ in range(local.integers(0, 3))}
            try:
                specs = library_outputs(op, [(r.dtype, r.shape) for r in inputs], params)
            except InvalidArgument:
                specs = [("float64", (3, 4))]
            outputs = [((scratch.handle, 0), dtype_, shape) for dtype_, shape in specs]
            wire = [((r.buffer.handle, r.buffer.offset), r.dtype, r.shape) for r in inputs]
            _send(gpu, RunLibrary(op, wire, outputs, params))
            sent += 1
            try:
                gpu.synchronize()
            except InvalidArgument as exc:
                refused += 1
                assert op in str(exc)
    assert sent == 6 * len(LIBRARY_OPS) and 0 < refused < sent
    (c,) = run_op(gpu, "matmul", [np.eye(3), np.eye(3)])  # the worker is still there
    np.testing.assert_array_equal(c, np.eye(3))
    for buf in buffers:
        gpu.free_memory(buf)
