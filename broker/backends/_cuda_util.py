"""Pieces of the CUDA backend without state: error translation and device properties."""

from __future__ import annotations

from typing import Any

import cupy
from cupy.cuda import compiler, driver, runtime

from gpubroker.client import (
    Aborted,
    CompileError,
    DeviceInfo,
    GpuBrokerError,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)

from ._cuda_driver import driver_extras

__all__ = ["BAD_IMAGE", "list_cuda_devices", "props_info", "translate"]

# Errors after which the context is unusable: every later call fails, so the worker must exit.
_FATAL = {214, 700, 702, 710, 714, 715, 716, 717, 718, 719}
_EXHAUSTED = {2}  # cudaErrorMemoryAllocation / CUDA_ERROR_OUT_OF_MEMORY
_NOT_FOUND = {100, 101, 500}  # no device, invalid device ordinal, CUDA_ERROR_NOT_FOUND
_BAD_INPUT = {1, 9, 98, 200, 209, 218, 222, 400, 701}
BAD_IMAGE = {200, 209, 218, 222}


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
        if status in _NOT_FOUND:
            return NotFound(msg, cuda_error=status)
        if status in _BAD_INPUT:
            return InvalidArgument(msg, cuda_error=status)
        return Internal(msg, cuda_error=status)
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
