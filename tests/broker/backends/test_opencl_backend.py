"""What only OpenCLBackend has, on a real OpenCL device (PoCL's CPU device in CI): device numbering across
platforms and the values pyopencl reports, sub-buffer alignment of views, the ``__local`` parameter behind
``shared_mem``, work-group rules, OpenCL's error codes and messages, and its device-time events. Everything both
backends share is in test_backend_contract.py."""

from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from gpubroker.broker.backends import _opencl_timing
from gpubroker.broker.backends._opencl import OpenCLBackend, list_opencl_devices
from gpubroker.broker.backends._opencl_info import translate_cl_error
from gpubroker.client import (
    ArgumentTypeError,
    CompileError,
    Internal,
    InvalidArgument,
    Kernel,
    Module,
    ModuleFormat,
    NotFound,
    ResourceExhausted,
)
from tests.backend_kernels import OpenDevice, module_source, source

F32 = np.float32
I32 = np.int32


@pytest.fixture(scope="module")
def gpu(open_device: OpenDevice) -> OpenCLBackend:
    device = open_device("opencl")  # the contract's: one OpenCL context for the session
    assert isinstance(device, OpenCLBackend)
    return device


@pytest.fixture(scope="module")
def module(gpu: OpenCLBackend) -> Module:
    # The contract's module, the very same source: PoCL's cache compiles it once for both files.
    return gpu.load_module(module_source("opencl"), ModuleFormat.OPENCL_C)


@pytest.fixture(scope="module")
def kernels(gpu: OpenCLBackend, module: Module) -> dict[str, Kernel]:
    return {name: gpu.get_kernel(module, name) for name in module.kernel_names}


@pytest.fixture(scope="module")
def align() -> int:
    """Sub-buffer alignment in bytes for device 0, read straight from pyopencl."""
    return max(int(cl.get_platforms()[0].get_devices()[0].mem_base_addr_align) // 8, 1)


# -- devices -----------------------------------------------------------------------------------


def test_list_devices_numbers_all_platforms() -> None:
    devices = list_opencl_devices()
    flat = [d for p in cl.get_platforms() for d in p.get_devices()]
    assert [d.id for d in devices] == list(range(len(flat)))
    assert [d.name for d in devices] == [d.name.strip() for d in flat]


def test_device_info_reports_real_values(gpu: OpenCLBackend) -> None:
    dev = cl.get_platforms()[0].get_devices()[0]
    info = gpu.device_info()
    assert (info.id, info.backend, info.compute_capability) == (0, "opencl", None)
    assert info.name == dev.name.strip() and info.vendor == dev.vendor.strip()
    assert info.total_memory == dev.global_mem_size
    assert info.multiprocessor_count == dev.max_compute_units
    assert info.clock_mhz == dev.max_clock_frequency
    assert info.l2_cache_bytes == dev.global_mem_cache_size
    assert info.max_threads_per_block == dev.max_work_group_size
    assert info.max_block_dims == tuple(dev.max_work_item_sizes[:3])
    assert info.max_grid_dims == (2**31 - 1,) * 3
    assert info.opencl_version == dev.version.strip() and info.driver_version == dev.driver_version.strip()
    # free_memory is the device's size less what this backend allocated (OpenCL has no query for it).
    before = info.free_memory
    buf = gpu.allocate_memory(1 << 20)
    assert gpu.device_info().free_memory == before - (1 << 20)
    gpu.free_memory(buf)
    assert gpu.device_info().free_memory == before


def test_largest_single_allocation(gpu: OpenCLBackend) -> None:
    max_alloc = cl.get_platforms()[0].get_devices()[0].max_mem_alloc_size
    with pytest.raises(ResourceExhausted, match="largest single allocation"):
        gpu.allocate_memory(max_alloc + 1)


# -- views, modules, arguments and work-groups -------------------------------------------------


def test_view_args_must_be_aligned_sub_buffers(gpu: OpenCLBackend, kernels: dict[str, Kernel], align: int) -> None:
    buf = gpu.allocate_memory(align + 64 * 4)
    if align > 1:
        with pytest.raises(InvalidArgument, match="multiple of"):
            gpu.execute_kernel(kernels["fill_index"], 1, 1, [buf.at(4), I32(1)])
    with pytest.raises(InvalidArgument):  # a sub-buffer of no bytes
        gpu.execute_kernel(kernels["fill_index"], 1, 1, [buf.at(buf.size), I32(0)])
    gpu.free_memory(buf)


def test_module_errors_say_what_there_is(gpu: OpenCLBackend, module: Module) -> None:
    with pytest.raises(NotFound, match="vadd"):  # the program's kernels, listed
        gpu.compile_kernel(module_source("opencl"), "no_such_kernel")
    with pytest.raises(NotFound, match="fill_index"):
        gpu.get_kernel(module, "two")
    with pytest.raises(InvalidArgument, match="not supported by the opencl backend"):
        gpu.load_module(b"\x7fELF", ModuleFormat.CUBIN)
    with pytest.raises(InvalidArgument):
        gpu.load_module("", ModuleFormat.OPENCL_C)
    with pytest.raises(CompileError, match="INVALID_BUILD_OPTIONS"):
        gpu.compile_kernel(source("opencl", "fill_index"), "fill_index", ["-no-such-option"])


# Kernels only OpenCL C can declare: a by-value typedef (its arg info names only the typedef), a fixed work-group.
OPENCL_ONLY = """
typedef float real;
__kernel void takes_typedef(__global float* out, real v) { out[0] = v; }
__kernel __attribute__((reqd_work_group_size(4, 1, 1))) void fixed_group(__global int* a) {}
"""


@pytest.fixture(scope="module")
def opencl_only(gpu: OpenCLBackend) -> Module:
    return gpu.load_module(OPENCL_ONLY, ModuleFormat.OPENCL_C)


def test_argument_errors_name_the_parameter(gpu: OpenCLBackend, kernels: dict[str, Kernel],
                                           opencl_only: Module) -> None:
    buf = gpu.allocate_memory(1024)
    saxpy, fill, block_sum = kernels["saxpy"], kernels["fill_index"], kernels["block_sum"]
    with pytest.raises(ArgumentTypeError, match=r"arg 0.*4-byte floating-point.*float64"):
        gpu.execute_kernel(saxpy, 1, 1, [np.float64(2), buf, buf, I32(1)])
    with pytest.raises(ArgumentTypeError, match="expected a Buffer"):
        gpu.execute_kernel(fill, 1, 1, [np.uint64(0), I32(1)])
    with pytest.raises(ArgumentTypeError, match="real"):  # by-value parameters must be built-in scalars
        gpu.execute_kernel(gpu.get_kernel(opencl_only, "takes_typedef"), 1, 1, [buf, F32(1)])
    # shared_mem fills a trailing __local parameter: needed when there is one, refused when there is none.
    with pytest.raises(InvalidArgument, match="shared_mem"):
        gpu.execute_kernel(block_sum, 1, 64, [buf, buf, I32(64)])
    with pytest.raises(InvalidArgument, match="__local"):
        gpu.execute_kernel(fill, 1, 1, [buf, I32(1)], shared_mem=64)
    with pytest.raises(InvalidArgument, match="local memory"):
        gpu.execute_kernel(block_sum, 1, 64, [buf, buf, I32(64)], shared_mem=1 << 40)
    gpu.free_memory(buf)


def test_reqd_work_group_size(gpu: OpenCLBackend, opencl_only: Module) -> None:
    buf = gpu.allocate_memory(16)
    fixed = gpu.get_kernel(opencl_only, "fixed_group")
    with pytest.raises(InvalidArgument, match="reqd_work_group_size"):
        gpu.execute_kernel(fixed, 1, 8, [buf])
    gpu.free_memory(buf)


def test_cl_errors_are_translated() -> None:
    def err(cls: type[cl.Error], code: int) -> cl.Error:
        return cls(cl._cl._ErrorRecord(msg="boom", code=code, routine="clSomething"))

    assert isinstance(translate_cl_error(err(cl.MemoryError, -4), "x"), ResourceExhausted)
    assert isinstance(translate_cl_error(err(cl.RuntimeError, -5), "x"), ResourceExhausted)
    assert isinstance(translate_cl_error(err(cl.LogicError, -30), "x"), InvalidArgument)
    assert isinstance(translate_cl_error(err(cl.RuntimeError, -9999), "x"), Internal)


# -- device time: profiling events of every command --------------------------------------------


def test_device_time_events_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_opencl_timing, "FOLD_EVENTS", 64)
    with OpenCLBackend(0) as backend:
        buf = backend.allocate_memory(64 << 10)
        longest = 0
        for i in range(1, 20 * 64 + 1):
            backend.memset(buf, 3)
            longest = max(longest, len(backend._timing._events))
            if i % 64 == 0:
                backend.synchronize()
        # Without folding the list would hold all 1280 events; with it, completed ones leave once 64 pile up.
        assert longest <= 2 * 64 + 1, longest
        total = backend.take_device_time()
        assert total > 0
        assert backend._timing._events == [] and backend.take_device_time() == 0.0
