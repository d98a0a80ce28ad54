"""Stateless pieces of the CUDA backend: error translation, device properties, kernel records, NVRTC."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import cupy
from cupy.cuda import compiler, driver, function, runtime

from gpubroker.broker.backends._common import PlanMemo, source_text
from gpubroker.broker.backends._cuda_driver import driver_extras
from gpubroker.broker.backends._cuda_sig import ParamKind, param_kinds
from gpubroker.wire.errors import (
    Aborted,
    ArgumentTypeError,
    CompileError,
    FailedPrecondition,
    GpuBrokerError,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from gpubroker.wire.types import Buffer, DeviceInfo

__all__ = [
    "BAD_IMAGE", "KernelRec", "ModuleRec", "as_source", "check_params", "compile_module", "list_cuda_devices",
    "make_kernel_rec", "props_info", "translate", "use_kernel_cache_of_environment",
]

# Errors after which the context is unusable: every later call fails, so the worker must exit.
_FATAL = {214, 700, 702, 710, 714, 715, 716, 717, 718, 719}
_EXHAUSTED = {2}  # cudaErrorMemoryAllocation / CUDA_ERROR_OUT_OF_MEMORY
_NOT_FOUND = {100, 101, 500}  # no device, invalid device ordinal, CUDA_ERROR_NOT_FOUND
_BAD_INPUT = {1, 9, 98, 200, 209, 218, 222, 300, 400, 701}
BAD_IMAGE = {200, 209, 218, 222, 300}
_NO_DRIVER = {34, 35}  # stub library, insufficient driver: this machine cannot run CUDA at all


def use_kernel_cache_of_environment() -> None:
    """CuPy's kernel cache (its own kernels': a library call's) in the folder this process's environment names now.
    CuPy fixes that folder as it is imported: a worker forked from the zygote imported it there, in the zygote's
    environment, and learns its tenant's cache folder only at its start (its writes elsewhere fail in the sandbox)."""
    try:
        from cupy.cuda._compiler_cache import DiskKernelCacheBackend
    except ImportError:  # (a CuPy before 14 reads CUPY_CACHE_DIR at each compile)
        return
    folder = os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")
    compiler._set_kernel_cache_backend(DiskKernelCacheBackend(folder))


def translate(what: str, exc: BaseException) -> GpuBrokerError:
    """Map any exception from CuPy or CUDA onto the gpubroker hierarchy."""
    if isinstance(exc, GpuBrokerError):
        return exc
    if isinstance(exc, compiler.CompileException):
        text = str(exc)
        first = next((ln for ln in text.splitlines() if "error" in ln), text.strip()[:200])
        return CompileError(f"{what}: compilation failed: {first}", log=text)
    status = getattr(exc, "status", None)
    if isinstance(exc, (runtime.CUDARuntimeError, driver.CUDADriverError)) and isinstance(status, int):
        msg = f"{what}: {exc}"
        if status in _FATAL:
            return Aborted(msg + " (the CUDA context is now unusable)", fatal=True, cuda_error=status)
        if status in _EXHAUSTED:
            return ResourceExhausted(msg, cuda_error=status)
        if status in _NO_DRIVER:
            return FailedPrecondition(msg, cuda_error=status)
        if status in _NOT_FOUND:
            return NotFound(msg, cuda_error=status)
        if status in _BAD_INPUT:
            return InvalidArgument(msg, cuda_error=status)
        return Internal(msg, cuda_error=status)
    if isinstance(exc, MemoryError):  # cupy.cuda.memory.OutOfMemoryError
        return ResourceExhausted(f"{what}: {exc}")
    if isinstance(exc, (TypeError, ValueError, OverflowError)):
        return InvalidArgument(f"{what}: {exc}")
    return Internal(f"{what}: {type(exc).__name__}: {exc}")


def props_info(dev: int, free: int) -> tuple[DeviceInfo, int]:
    """DeviceInfo from the runtime, plus the opt-in dynamic shared memory limit per block."""
    props: dict[str, Any] = runtime.getDeviceProperties(dev)

    def get(key: str, attr: int) -> int:
        # CUDA 13 dropped some cudaDeviceProp fields (clockRate); the attributes remain.
        value = props.get(key)
        return int(value) if value is not None else int(runtime.deviceGetAttribute(attr, dev))

    def dims(key: str, first_attr: int) -> tuple[int, int, int]:
        value = props.get(key)
        if value is None or len(value) != 3:
            value = [runtime.deviceGetAttribute(first_attr + i, dev) for i in range(3)]
        return (int(value[0]), int(value[1]), int(value[2]))

    try:
        clock_khz = int(runtime.deviceGetAttribute(runtime.cudaDevAttrClockRate, dev))
    except runtime.CUDARuntimeError:
        clock_khz = int(props.get("clockRate", 0))
    name = props.get("name", b"")
    driver_ver = runtime.driverGetVersion()
    info = DeviceInfo(
        id=dev, name=name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name),
        vendor="NVIDIA", backend="cuda", total_memory=get("totalGlobalMem", -1), free_memory=free,
        multiprocessor_count=get("multiProcessorCount", runtime.cudaDevAttrMultiProcessorCount),
        clock_mhz=clock_khz // 1000, l2_cache_bytes=get("l2CacheSize", runtime.cudaDevAttrL2CacheSize),
        unified_memory=bool(get("managedMemory", runtime.cudaDevAttrManagedMemory)),
        max_threads_per_block=get("maxThreadsPerBlock", runtime.cudaDevAttrMaxThreadsPerBlock),
        max_block_dims=dims("maxThreadsDim", runtime.cudaDevAttrMaxBlockDimX),
        max_grid_dims=dims("maxGridSize", runtime.cudaDevAttrMaxGridDimX),
        compute_capability=(get("major", 75), get("minor", 76)),
        driver_version=f"{driver_ver // 1000}.{driver_ver % 1000 // 10}")
    return info, get("sharedMemPerBlockOptin", runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin)


def list_cuda_devices() -> list[DeviceInfo]:
    """Every CUDA device CuPy sees ([] with no driver or GPU), without keeping contexts alive."""
    try:
        count = runtime.getDeviceCount()
    except Exception:
        return []
    extras, devices = driver_extras(), []
    for dev in range(count):
        free = extras.free_memory_transient(dev) if extras.primary_context_active(dev) is False else None
        if free is None:
            with cupy.cuda.Device(dev):
                free = runtime.memGetInfo()[0]
        devices.append(props_info(dev, free)[0])
    return devices


@dataclass
class KernelRec:
    func: function.Function  # holds its Module, keeping the code loaded
    name: str
    module: str | None  # handle of the load_module Module, None for compile_kernel
    params: list[int] | None  # byte size of each parameter; None when the driver can't tell
    kinds: list[ParamKind] | None  # pointer / scalar per parameter, read from CUDA C source we compiled
    max_threads: int
    dynamic_shared: int = 48 * 1024  # the default cap until raised with cuFuncSetAttribute
    # Launch signatures (block, shared_mem, arg types) that passed the kernel-specific checks.
    plans: PlanMemo = field(default_factory=PlanMemo, compare=False, repr=False)


@dataclass
class ModuleRec:
    module: function.Module
    source: str | None  # CUDA C, when we compiled it: lets get_kernel read signatures
    kernels: dict[str, str] = field(default_factory=dict)  # name -> kernel handle


def check_params(rec: KernelRec, args: list[Any]) -> None:
    """A wrong count, width or kind on CUDA launches silently with garbage, so refuse it here."""
    expected = rec.params or []
    if len(args) != len(expected):
        raise InvalidArgument(f"kernel {rec.name!r} takes {len(expected)} arguments, got {len(args)}",
                              expected=len(expected), got=len(args))
    for i, (arg, size) in enumerate(zip(args, expected, strict=True)):
        is_buf = isinstance(arg, Buffer)
        got = f"Buffer {arg.handle!r}" if is_buf else f"np.{type(arg).__name__}"
        kind = rec.kinds[i] if rec.kinds else ParamKind("unknown")
        where = f"kernel {rec.name!r} arg {i}" + (f" ({kind.text})" if kind.text else "")
        if kind.kind == "pointer" and not is_buf:
            raise ArgumentTypeError(f"{where} is a pointer: pass a Buffer, got {got}", index=i)
        if kind.kind == "scalar" and (is_buf or (arg.dtype.kind == "f") != kind.is_float):
            family = "floating-point" if kind.is_float else "integer"
            raise ArgumentTypeError(f"{where} takes a {size}-byte {family} numpy scalar, got {got}", index=i)
        width = 8 if is_buf else int(arg.itemsize)
        if width != size:
            raise ArgumentTypeError(f"{where} is a {size}-byte parameter; got {got} ({width} bytes)",
                                    index=i, expected=size, got=width)


def as_source(source: object) -> str:
    if isinstance(source, (bytes, bytearray, memoryview)):
        try:
            return source_text(bytes(source).decode("utf-8"), "CUDA C")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"CUDA C source is not valid UTF-8: {exc}") from None
    if not isinstance(source, str):
        raise InvalidArgument(f"CUDA C source must be str or bytes, got {type(source).__name__}")
    return source_text(source, "CUDA C")


def compile_module(source: str, options: Sequence[str]) -> function.Module:
    """Compile CUDA C with NVRTC for the current device and load it."""
    if isinstance(options, str) or not all(isinstance(o, str) for o in options):
        raise InvalidArgument(f"options must be a sequence of str, got {options!r}")
    # compile_using_nvrtc, not RawModule: RawModule memoizes modules for the process's life,
    # so unload_module could never unload them. This picks -arch=sm_XX for the device.
    binary, _ = compiler.compile_using_nvrtc(source, tuple(options), cache_in_memory=True)
    mod = function.Module()
    mod.load(binary)
    return mod


def make_kernel_rec(mod: function.Module, name: str, module: str | None, source: str | None) -> KernelRec:
    """Look ``name`` up in a loaded module and learn what its launches need."""
    try:
        func = mod.get_function(name)
    except driver.CUDADriverError as exc:
        if exc.status == 500:
            raise NotFound(f'no kernel named {name!r} in the module (is it declared extern "C"?)') from exc
        raise
    # Reading an attribute also makes a lazily loaded function resident before we query it.
    max_threads = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, func.ptr)
    params = driver_extras().param_sizes(func.ptr)
    kinds = param_kinds(source, name, len(params)) if source is not None and params is not None else None
    return KernelRec(func, name, module, params, kinds, max_threads)
