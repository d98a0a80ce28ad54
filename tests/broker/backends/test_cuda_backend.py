"""What only CudaBackend has, against a real NVIDIA GPU (run with -m cuda): binary images (PTX, cubin, fatbin),
CUDA C signature parsing, dynamic shared memory past 48 KiB, cudaMalloc accounting, fatal context errors, and
device time measured with CUDA events. Everything both backends share is in test_backend_contract.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from gpubroker.broker.backends import _cuda_timing  # noqa: E402
from gpubroker.broker.backends._cuda import CudaBackend  # noqa: E402
from gpubroker.broker.worker._executor import Executor  # noqa: E402
from gpubroker.broker.worker._handles import HandleTables  # noqa: E402
from gpubroker.broker.worker._segments import SegmentTable  # noqa: E402
from gpubroker.client import (  # noqa: E402
    Buffer,
    CompileError,
    ModuleFormat,
    NotFound,
    ResourceExhausted,
)
from gpubroker.wire.commands import (  # noqa: E402
    Batch,
    CreateStream,
    GetKernel,
    Launch,
    LoadModule,
    ScalarArg,
    Synchronize,
)
from tests.backend_kernels import source  # noqa: E402

pytestmark = pytest.mark.cuda

F32 = np.float32
FILL_INDEX = source("cuda", "fill_index")


@pytest.fixture
def gpu() -> Iterator[CudaBackend]:
    with CudaBackend(0) as backend:
        yield backend


def upload(gpu: CudaBackend, arr: np.ndarray) -> Buffer:
    buf = gpu.allocate_memory(arr.nbytes)
    gpu.copy_h2d(arr, buf)
    return buf


def download(gpu: CudaBackend, buf: Buffer, dtype: type, count: int, offset: int = 0) -> np.ndarray:
    out = np.empty(count, dtype=dtype)
    gpu.copy_d2h(buf, out, offset)
    return out


def blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def nvrtc_compile(source: str, option: str) -> tuple[bytes, bytes]:
    """(ptx, cubin-or-empty) straight from NVRTC, bypassing the backend."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, "test.cu", (), ())
    try:
        nvrtc.compileProgram(prog, (option,))
        return nvrtc.getPTX(prog), (nvrtc.getCUBIN(prog) if "sm_" in option else b"")
    finally:
        nvrtc.destroyProgram(prog)


# -- device ----------------------------------------------------------------------------------------

def test_device_info_is_nvidias(gpu: CudaBackend) -> None:
    info = gpu.device_info()
    assert info.vendor == "NVIDIA" and info.backend == "cuda" and info.name
    assert info.total_memory > info.free_memory > 0  # the driver's own numbers: its context takes some
    assert info.max_threads_per_block >= 1024 and info.max_block_dims[0] >= 1024
    assert info.compute_capability is not None and info.compute_capability >= (7, 0)
    major, minor = info.driver_version.split(".")
    assert int(major) >= 12 and minor.isdigit()
    print("DEVICE", info)


LIST_SCRIPT = r"""
import json
from gpubroker.broker.backends._cuda import list_cuda_devices
from gpubroker.broker.backends._cuda_driver import driver_extras
devices = list_cuda_devices()
print("RESULT" + json.dumps({"count": len(devices), "free": devices[0].free_memory, "total": devices[0].total_memory,
                             "active_after": driver_extras().primary_context_active(0)}))
"""


def test_listing_devices_leaves_no_context() -> None:
    # A fresh process: listing must not keep a ~500 MiB context on every GPU it looked at.
    proc = subprocess.run([sys.executable, "-c", LIST_SCRIPT], capture_output=True, text=True, timeout=120)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, proc.stdout + proc.stderr
    result = json.loads(line[len("RESULT"):])
    assert result["count"] >= 1 and 0 < result["free"] <= result["total"]
    assert result["active_after"] is False


# -- kernels ---------------------------------------------------------------------------------------

def test_dynamic_shared_memory_past_48k(gpu: CudaBackend) -> None:
    n, block = 100_003, 256
    x = (np.arange(n) % 7).astype(F32)
    dx, dout = upload(gpu, x), gpu.allocate_memory(blocks(n, block) * 4)
    kern = gpu.compile_kernel(source("cuda", "block_sum"), "block_sum")
    padded = np.zeros(blocks(n, block) * block, dtype=F32)
    padded[:n] = x
    expected = padded.reshape(-1, block).sum(axis=1)
    # More than 48 KiB of dynamic shared memory needs the per-function opt-in.
    gpu.execute_kernel(kern, blocks(n, block), block, [dx, dout, np.int32(n)], shared_mem=100 * 1024)
    np.testing.assert_array_equal(download(gpu, dout, F32, blocks(n, block)), expected)


def check_image(gpu: CudaBackend, image: str | bytes, fmt: ModuleFormat) -> None:
    n = 777
    mod = gpu.load_module(image, fmt)
    out = gpu.allocate_memory(4 * n)
    kern = gpu.get_kernel(mod, "fill_index")
    gpu.execute_kernel(kern, blocks(n, 128), 128, [out, np.int32(n)])
    np.testing.assert_array_equal(download(gpu, out, np.int32, n), np.arange(n))
    gpu.unload_module(mod)
    with pytest.raises(NotFound):
        gpu.execute_kernel(kern, 1, 1, [out, np.int32(1)])
    with pytest.raises(NotFound):
        gpu.get_kernel(mod, "fill_index")


def arch(gpu: CudaBackend) -> str:
    return "".join(map(str, gpu.device_info().compute_capability or (0, 0)))


def test_load_ptx(gpu: CudaBackend) -> None:
    ptx, _ = nvrtc_compile(FILL_INDEX, f"-arch=compute_{arch(gpu)}")
    try:
        check_image(gpu, ptx, ModuleFormat.PTX)
    except CompileError as exc:
        if exc.details.get("cuda_error") == 222:  # NVRTC's PTX ISA is newer than the driver's JIT
            pytest.skip(f"driver cannot JIT this NVRTC's PTX: {exc}")
        raise
    check_image(gpu, ptx.rstrip(b"\0").decode(), ModuleFormat.PTX)


def test_load_cubin(gpu: CudaBackend) -> None:
    _, cubin = nvrtc_compile(FILL_INDEX, f"-arch=sm_{arch(gpu)}")
    check_image(gpu, cubin, ModuleFormat.CUBIN)


def test_load_fatbin_with_nvcc(gpu: CudaBackend) -> None:
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if nvcc is None:
        pytest.skip("nvcc not available")
    major, minor = gpu.device_info().compute_capability or (0, 0)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.fatbin")
        with open(src, "w") as f:
            f.write(FILL_INDEX)
        subprocess.run([nvcc, "-fatbin", f"-arch=sm_{major}{minor}", src, "-o", out], check=True)
        with open(out, "rb") as f:
            image = f.read()
    mod = gpu.load_module(image, ModuleFormat.FATBIN)
    n = 300
    buf = gpu.allocate_memory(4 * n)
    gpu.execute_kernel(gpu.get_kernel(mod, "fill_index"), 3, 128, [buf, np.int32(n)])
    np.testing.assert_array_equal(download(gpu, buf, np.int32, n), np.arange(n))


def test_signature_parsing() -> None:
    from gpubroker.broker.backends._cuda_sig import param_kinds

    src = r"""
    typedef float real;
    // __global__ void commented(int* x)
    extern "C" __global__ void __launch_bounds__(256, 2)
    lb(const float* __restrict__ a, unsigned long long n, real r, int32_t k, float v[], __half h) {}
    extern "C" __global__ void noargs(void) {}
    extern "C" __global__ void decl(int* p, double d);
    extern "C" __global__ void decl(int* p, double d) { }
    #if 1
    extern "C" __global__ void twice(int* p) {}
    #else
    extern "C" __global__ void twice(float p) {}
    #endif
    """
    kinds = param_kinds(src, "lb", 6)
    assert kinds is not None
    assert [(k.kind, k.is_float) for k in kinds] == [
        ("pointer", False), ("scalar", False), ("unknown", False), ("scalar", False), ("pointer", False),
        ("scalar", True)]
    assert param_kinds(src, "lb", 5) is None  # disagrees with the driver's count: not trusted
    assert param_kinds(src, "noargs", 0) == []
    assert [k.kind for k in param_kinds(src, "decl", 2) or []] == ["pointer", "scalar"]
    assert param_kinds(src, "twice", 1) is None
    assert param_kinds(src, "commented", 1) is None


# -- memory ----------------------------------------------------------------------------------------

def test_allocations_are_real_cuda_mallocs(gpu: CudaBackend) -> None:
    before = gpu.device_info().free_memory
    buf = gpu.allocate_memory(1 << 30)
    assert gpu.allocated_bytes == 1 << 30
    assert gpu.device_info().free_memory <= before - (1 << 30) + (64 << 20)
    gpu.free_memory(buf)
    assert gpu.allocated_bytes == 0
    assert gpu.device_info().free_memory >= before - (64 << 20)  # really freed, no pool keeps it
    # Two allocations that cannot both fit: the second fails cleanly in cudaMalloc.
    big = int(gpu.device_info().free_memory * 0.7)
    first = gpu.allocate_memory(big)
    with pytest.raises(ResourceExhausted):
        gpu.allocate_memory(big)
    gpu.free_memory(Buffer(first.handle, 0))  # the worker frees with size 0: only the handle counts
    assert gpu.allocated_bytes == 0
    gpu.allocate_memory(16)


# -- fatal errors ----------------------------------------------------------------------------------

FATAL_SCRIPT = r"""
import json, sys, numpy as np
from gpubroker.broker.backends._cuda import CudaBackend
from gpubroker.client import Aborted
result = {}
gpu = CudaBackend(0)
gpu.initialize()
k = gpu.compile_kernel('extern "C" __global__ void poke(unsigned long long a) { *(int*)a = 1; }', "poke")
gpu.execute_kernel(k, 1, 1, [np.uint64(8)])  # writes to address 8
if sys.argv[1:] == ["take"]:
    result["take_first"] = gpu.take_device_time()  # the scheduler's wait is the first to meet the fault
try:
    gpu.synchronize()
except Aborted as exc:
    result["sync"] = [type(exc).__name__, exc.details.get("fatal"), exc.message]
try:
    gpu.allocate_memory(16)
except Aborted as exc:
    result["after"] = [type(exc).__name__, exc.details.get("fatal")]
result["take"] = gpu.take_device_time()
gpu.close()
result["closed"] = True
result["take_closed"] = gpu.take_device_time()
print("RESULT" + json.dumps(result))
"""


@pytest.mark.parametrize("first", ["sync", "take"])
def test_illegal_address_is_fatal(first: str) -> None:
    # In a child process: the error poisons the CUDA context for the whole process.
    proc = subprocess.run([sys.executable, "-c", FATAL_SCRIPT, first], capture_output=True, text=True,
                          timeout=120)
    print("FATAL_STDERR", proc.stderr[-2000:])
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, proc.stdout + proc.stderr
    result = json.loads(line[len("RESULT"):])
    assert result["sync"][:2] == ["Aborted", True]
    assert "cudaErrorIllegalAddress" in result["sync"][2] or "ILLEGAL_ADDRESS" in result["sync"][2]
    assert result["after"] == ["Aborted", True]
    assert result["closed"]
    # take_device_time never raises: after a fatal error there is nothing it can measure.
    assert result["take"] == 0.0 and result["take_closed"] == 0.0
    if first == "take":
        assert result["take_first"] == 0.0


# -- device time: CUDA events around each stream's run of commands, checked against the SM clock ---------------

SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def spin_cycles(gpu: CudaBackend, seconds: float) -> np.int64:
    """SM clock cycles for about ``seconds`` at the device's reported clock."""
    return np.int64(seconds * gpu.device_info().clock_mhz * 1e6)


def test_device_time_measures_kernels(gpu: CudaBackend) -> None:
    spin = gpu.compile_kernel(SPIN_SOURCE, "spin")
    cycles = spin_cycles(gpu, 2e-3)
    gpu.execute_kernel(spin, 1, 1, [np.int64(1000)])  # warm-up: module load, clocks up
    gpu.take_device_time()
    gpu.execute_kernel(spin, 1, 1, [cycles])
    gpu.execute_kernel(spin, 1, 1, [cycles])
    took = gpu.take_device_time()  # no synchronize first: the take waits itself
    print("DEVICE_TIME 2 x 2 ms spin:", took)
    assert 3e-3 < took < 8e-3, took
    assert gpu.take_device_time() < 1e-3
    # The same work split over the default stream and a created one: each launch counts in full.
    stream = gpu.create_stream()
    gpu.execute_kernel(spin, 1, 1, [cycles])
    gpu.execute_kernel(spin, 1, 1, [cycles], stream=stream)
    took = gpu.take_device_time()
    assert 3e-3 < took < 8e-3, took
    gpu.destroy_stream(stream)
    assert gpu.take_device_time() == 0.0


def test_device_time_pairs_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cuda_timing, "FOLD_PAIRS", 64)
    with CudaBackend(0) as backend:
        buf = backend.allocate_memory(64 << 10)
        longest = 0
        for _ in range(100):  # commands alone record no pairs: one open segment per stream
            backend.memset(buf, 3)
        assert backend._timer._pairs == [] and len(backend._timer._open) == 1
        for i in range(1, 20 * 64 + 1):
            backend.memset(buf, 3)
            backend.flush_device_time()  # a batch end: closes the segment, one pair each
            longest = max(longest, len(backend._timer._pairs))
            if i % 64 == 0:
                backend.synchronize()
        # Without folding the list would hold all 1280 pairs; with it, completed ones leave once 64 pile up.
        assert longest <= 2 * 64 + 1, longest
        assert backend.take_device_time() > 0
        assert backend._timer._pairs == [] and backend.take_device_time() == 0.0
        assert backend._timer._pool  # read events are kept for reuse


def test_device_time_of_a_kernel_survives_close() -> None:
    with CudaBackend(0) as backend:
        spin = backend.compile_kernel(SPIN_SOURCE, "spin")
        backend.execute_kernel(spin, 1, 1, [spin_cycles(backend, 2e-3)])
    took = backend.take_device_time()  # close waited for the launch; its time is still charged
    assert 1e-3 < took < 8e-3, took
    assert backend.take_device_time() == 0.0


# -- the worker's device-time segments across batches -------------------------------------------------------------

def _spin_executor(gpu: CudaBackend) -> Executor:
    executor = Executor(gpu, HandleTables(), SegmentTable(gpu))
    ack = executor.run("s", Batch(1, 0, [LoadModule("m", "cuda_c", SPIN_SOURCE.encode(), []),
                                         GetKernel("spin", "m", "spin")]))
    assert ack.error is None, ack.error
    return executor


def _spin(cycles: np.int64, stream: str = "") -> Launch:
    return Launch("spin", (1,), (1,), [ScalarArg(cycles.dtype.str, cycles.tobytes())], stream=stream)


def test_worker_segment_spans_batches_and_ends_when_the_worker_goes_idle(gpu: CudaBackend) -> None:
    executor = _spin_executor(gpu)
    spin = _spin(spin_cycles(gpu, 1e-3))
    gpu.take_device_time()
    for i in range(3):  # back-to-back batches: one segment, no timing event between their kernels
        assert executor.run("s", Batch(10 + i, 0, [spin])).error is None
        assert executor.issuing()
    assert gpu._timer._pairs == []
    executor.idle()  # what the serve loop does before it waits for input
    assert not executor.issuing()
    time.sleep(0.05)  # host idle time: not the device's, so not charged
    took = gpu.take_device_time()
    assert 2e-3 < took < 20e-3, took


def _counting_event_records(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every cudaEventRecord the device-time code makes from now on, by stream."""
    records: list[int] = []
    record = cupy.cuda.runtime.eventRecord

    def counted(event: int, stream: int) -> None:
        records.append(stream)
        record(event, stream)

    monkeypatch.setattr(_cuda_timing.runtime, "eventRecord", counted)
    return records


def test_a_synchronous_round_trip_records_no_timing_event_and_is_charged_its_wall_time(
        gpu: CudaBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launch + synchronize, answered, again and again (a synchronous client on a link): the start mark is recorded
    after each answer (``answered``: while the client reads it), none while a batch runs, and each run is charged
    its wall time, which holds its kernel. (Runs of 1 ms count as short here: see the next test.)"""
    monkeypatch.setattr(_cuda_timing, "LONG_SYNC", 1.0)
    monkeypatch.setattr(_cuda_timing, "ANCHOR_MAX_AGE", 1.0)  # (a busy host's gaps between the calls below)
    executor = _spin_executor(gpu)
    spin = _spin(spin_cycles(gpu, 1e-3))
    executor.run_link("s", Batch(2, 0, [spin, Synchronize()]))  # warm-up
    executor.answered()
    gpu.take_device_time()
    records = _counting_event_records(monkeypatch)
    during_batches = 0
    t0 = time.perf_counter()
    for i in range(20):
        before = len(records)
        assert executor.run_link("s", Batch(10 + i, 0, [spin, Synchronize()])).error is None
        during_batches += len(records) - before
        executor.answered()
    wall = time.perf_counter() - t0
    assert during_batches == 0 and len(records) == 20, records
    took = gpu.take_device_time()
    assert 20 * 0.7e-3 < took <= wall, (took, wall)


def test_after_a_long_synchronous_run_the_next_records_its_end_mark_and_is_charged_by_it(
        gpu: CudaBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A synchronous run longer than LONG_SYNC (a 2 ms kernel): the next one records its end mark while its kernel
    runs, so the host's time after the kernel (a wake-up, a late turn on the CPU) is not in its charge; once one is
    short again, the next records none."""
    monkeypatch.setattr(_cuda_timing, "ANCHOR_MAX_AGE", 1.0)
    monkeypatch.setattr(_cuda_timing, "LONG_SYNC", 1e-3)  # (a 2 ms kernel is long, an empty one short)
    executor = _spin_executor(gpu)
    spin, short = _spin(spin_cycles(gpu, 2e-3)), _spin(np.int64(0))
    gpu.synchronize()
    executor.answered()
    assert executor.run_link("s", Batch(2, 0, [spin, Synchronize()])).error is None  # long: charged its wall time
    executor.answered()
    gpu.take_device_time()
    records = _counting_event_records(monkeypatch)
    counts = []
    for i, command in enumerate([spin, short, short]):
        before = len(records)
        assert executor.run_link("s", Batch(3 + i, 0, [command, Synchronize()])).error is None
        counts.append(len(records) - before)
        if i == 0:
            took = gpu.take_device_time()
            assert 1e-3 < took < 8e-3, took
        executor.answered()
    # the long run after a long one: its end mark (its start: the mark recorded ahead); the short one after it:
    # its end mark too; the short one after a short one: none
    assert counts == [1, 1, 0], counts


def test_a_run_begun_on_a_start_mark_recorded_ahead_is_charged_its_device_time_not_the_wait_before(
        gpu: CudaBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start mark recorded ahead (the device quiet) and a run that ends without a synchronize (the worker
    waits for input with its kernel in flight): the host's wait between the mark and the run is not charged."""
    monkeypatch.setattr(_cuda_timing, "ANCHOR_MAX_AGE", 1.0)
    executor = _spin_executor(gpu)
    gpu.synchronize()
    gpu.take_device_time()
    executor.answered()
    time.sleep(0.05)  # the client thinks: 50 ms between the mark and the next batch
    records = _counting_event_records(monkeypatch)
    assert executor.run_link("s", Batch(2, 0, [_spin(spin_cycles(gpu, 2e-3))])).error is None
    assert records == []  # the run began on the mark recorded ahead
    executor.idle()
    assert len(records) == 1, records  # its end mark
    took = gpu.take_device_time()
    assert 1e-3 < took < 10e-3, took  # (52 ms and more with the 50 ms before it)


def test_a_start_mark_too_old_to_use_is_recorded_again(gpu: CudaBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mark older than ANCHOR_MAX_AGE is not a run's start (the run records its own); the next answer records the
    mark again."""
    monkeypatch.setattr(_cuda_timing, "ANCHOR_MAX_AGE", 0.01)
    executor = _spin_executor(gpu)
    gpu.synchronize()
    executor.answered()
    time.sleep(0.03)
    records = _counting_event_records(monkeypatch)
    executor.answered()  # too old: recorded again
    assert records == [0], records
    time.sleep(0.03)
    assert executor.run_link("s", Batch(2, 0, [_spin(np.int64(0))])).error is None
    assert records == [0, 0], records  # the run's own start mark


def test_a_fences_wait_leaves_the_device_quiet(gpu: CudaBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Work on a second stream that no synchronize waited for: the scheduler's take (which waits for the device)
    finishes it, so the next answer records a start mark ahead."""
    executor = _spin_executor(gpu)
    assert executor.run("s", Batch(2, 0, [CreateStream("side")])).error is None
    assert executor.run_link("s", Batch(3, 0, [_spin(spin_cycles(gpu, 1e-3), "side")])).error is None
    executor.idle()
    records = _counting_event_records(monkeypatch)
    executor.answered()
    assert records == []  # its work unfinished: no mark ahead
    assert gpu.take_device_time() > 0
    executor.answered()
    assert records == [0], records  # after the fence's wait: the mark, on the default stream


def test_a_synchronize_after_another_streams_work_measures_each_run_with_events(
        gpu: CudaBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run begun on a quiet device is charged its wall time only if it was the only work: here a second stream
    ran too (the synchronize's wait holds both), so each run gets its end mark and counts its own kernel."""
    executor = _spin_executor(gpu)
    assert executor.run("s", Batch(2, 0, [CreateStream("side")])).error is None
    cycles = spin_cycles(gpu, 2e-3)
    gpu.synchronize()
    gpu.take_device_time()
    executor.answered()
    records = _counting_event_records(monkeypatch)
    ack = executor.run_link("s", Batch(3, 0, [_spin(cycles), _spin(cycles, "side"), Synchronize()]))
    assert ack.error is None, ack.error
    assert len(records) == 3, records  # the second stream's start, then an end mark for each
    took = gpu.take_device_time()
    assert 3e-3 < took < 8e-3, took


def test_pinned_buffers_are_page_locked_and_come_back_to_their_pool(gpu: CudaBackend) -> None:
    """A link's chunk lands in page-locked memory (one DMA, no staging copy) from a pool: a block comes back when
    its last view goes (not before: a frame in an outbox keeps it), free blocks stay within their bound, and small
    buffers are plain memory."""
    from gpubroker.broker.backends import _cuda_copies

    assert type(gpu.pinned_buffer(_cuda_copies.PINNED_MIN - 1)) is bytearray
    size = (1 << 20) + 100  # (a chunk's frame: a little over 1 MiB)
    view = gpu.pinned_buffer(size)
    assert isinstance(view, memoryview) and len(view) == size and view.format == "B"
    address = np.frombuffer(view, np.uint8).ctypes.data
    attributes = cupy.cuda.runtime.pointerGetAttributes(address)
    assert attributes.type == cupy.cuda.runtime.memoryTypeHost  # registered with CUDA: page-locked

    data = np.arange(size, dtype=np.uint64).astype(np.uint8)
    buf = upload(gpu, data)
    gpu.copy_d2h(buf, view)
    assert bytes(view) == data.tobytes()

    kept = view[10:20]  # another view of the same block keeps it out of the pool
    del view
    other = gpu.pinned_buffer(size)
    assert np.frombuffer(other, np.uint8).ctypes.data != address
    del kept
    again = gpu.pinned_buffer(size)
    assert np.frombuffer(again, np.uint8).ctypes.data == address  # back in the pool once its last view went

    # Far more than the pool keeps, all given back at once: what it keeps stays within its bound.
    many = [gpu.pinned_buffer(size) for _ in range(2 * _cuda_copies._PINNED_FREE_MAX // size)]
    del many, other, again
    pool = gpu._copies._pinned
    assert 0 < pool._free_bytes <= _cuda_copies._PINNED_FREE_MAX
    gpu.free_memory(buf)
