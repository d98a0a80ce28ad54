"""The native baselines of `gpubroker bench remote`: the plain runtime in this process, no gpubroker in the way.

On CUDA: plain CuPy (RawKernel, one non-blocking stream). Without CUDA: plain pyopencl on the same OpenCL device
the broker serves (PoCL in CI). Each baseline does exactly what the remote side of the benchmark does, with the
same kernels (``src/gpubroker/broker/samples.py``), the same grid and block, the same sizes, so that their ratio
measures
gpubroker's cost and nothing else.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from typing import Any, Protocol

import numpy as np

from gpubroker.broker import samples

__all__ = ["SPIN_BLOCK", "Native", "NativeCupy", "NativeOpenCL", "open_native"]

# The spin kernel runs one block of this many threads: a small kernel whose run time its iteration count sets.
SPIN_BLOCK = 256


class Native(Protocol):
    kind: str  # what the baseline is, said in the JSON

    def info(self) -> dict[str, str]: ...

    def launch_sync(self, iterations: int) -> list[float]:
        """Seconds of each empty-kernel launch followed by a synchronize of its stream."""
        ...

    def async_launches(self, count: int) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) to queue ``count`` empty launches and then synchronize."""
        ...

    def spin_chain(self, iters: int, steps: int, read_every: int) -> float:
        """Seconds for ``steps`` dependent spin kernels on one buffer, reading 4 bytes back every ``read_every``
        steps (0: only a synchronize at the end)."""
        ...

    def spin_each(self, iters: int, count: int) -> float:
        """Seconds for ``count`` spin kernels, each launched and synchronized on its own."""
        ...

    def copies(self, size: int, repeats: int, pinned: bool) -> dict[str, float]:
        """Best H2D and D2H GB/s of ``size`` bytes, from page-locked host memory or a plain numpy array."""
        ...

    def close(self) -> None: ...


def _gbps(size: int, seconds: list[float]) -> float:
    return size / min(seconds) / 1e9


class NativeCupy:
    kind = "plain CuPy in this process (RawKernel, one non-blocking stream)"

    def __init__(self, device: int) -> None:
        import cupy

        self.cp = cupy
        self.device = cupy.cuda.Device(device)
        self.device.use()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        src = samples.source("cuda")
        self.empty = cupy.RawKernel(src, "empty_kernel")
        self.spin = cupy.RawKernel(src, "spin")
        self.x = cupy.zeros(SPIN_BLOCK, dtype=cupy.float32)
        self.word = np.empty(1, dtype=np.float32)
        with self.stream:  # compile and load both kernels before anything is timed
            self.empty((1,), (1,), ())
            self.spin((1,), (SPIN_BLOCK,), (self.x, np.int64(1)))
        self.stream.synchronize()

    def info(self) -> dict[str, str]:
        rt = self.cp.cuda.runtime
        props = rt.getDeviceProperties(self.device.id)
        name = props["name"]
        driver = f"CUDA driver API {rt.driverGetVersion()}"
        if shutil.which("nvidia-smi"):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                                      "-i", str(self.device.id)], capture_output=True, text=True, timeout=30)
                if out.returncode == 0 and out.stdout.strip():
                    driver = f"{out.stdout.strip()} ({driver})"
        return {"device": name.decode() if isinstance(name, bytes) else str(name), "driver": driver,
                "runtime": f"CuPy {self.cp.__version__}, CUDA runtime {rt.runtimeGetVersion()}"}

    def launch_sync(self, iterations: int) -> list[float]:
        times = []
        with self.stream:
            for _ in range(iterations):
                t0 = time.perf_counter()
                self.empty((1,), (1,), ())
                self.stream.synchronize()
                times.append(time.perf_counter() - t0)
        return times

    def async_launches(self, count: int) -> tuple[float, float]:
        with self.stream:
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(count):
                self.empty((1,), (1,), ())
            self.stream.synchronize()
            return time.perf_counter() - t0, time.process_time() - c0

    def _read_word(self) -> None:
        self.x.data.copy_to_host_async(self.word.ctypes.data, 4, self.stream)
        self.stream.synchronize()

    def spin_chain(self, iters: int, steps: int, read_every: int) -> float:
        n = np.int64(iters)
        with self.stream:
            t0 = time.perf_counter()
            for i in range(1, steps + 1):
                self.spin((1,), (SPIN_BLOCK,), (self.x, n))
                if read_every and i % read_every == 0:
                    self._read_word()
            self.stream.synchronize()
            return time.perf_counter() - t0

    def spin_each(self, iters: int, count: int) -> float:
        n = np.int64(iters)
        with self.stream:
            t0 = time.perf_counter()
            for _ in range(count):
                self.spin((1,), (SPIN_BLOCK,), (self.x, n))
                self.stream.synchronize()
            return time.perf_counter() - t0

    def copies(self, size: int, repeats: int, pinned: bool) -> dict[str, float]:
        cp = self.cp
        if pinned:
            mem = cp.cuda.alloc_pinned_memory(size)
            host = np.frombuffer(mem, np.uint8, size)
            out_mem = cp.cuda.alloc_pinned_memory(size)
            out = np.frombuffer(out_mem, np.uint8, size)
            host[:] = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        else:
            host = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
            out = np.empty_like(host)
        dev = cp.empty(size, dtype=cp.uint8)
        h2d, d2h = [], []
        for i in range(repeats + 1):  # the first round warms up (first touch, lazy registration)
            t0 = time.perf_counter()
            dev.data.copy_from_host_async(host.ctypes.data, size, self.stream)
            self.stream.synchronize()
            t1 = time.perf_counter()
            dev.data.copy_to_host_async(out.ctypes.data, size, self.stream)
            self.stream.synchronize()
            t2 = time.perf_counter()
            if i:
                h2d.append(t1 - t0)
                d2h.append(t2 - t1)
        if not np.array_equal(out, host):
            raise AssertionError("native copy round trip returned different bytes")
        del dev
        return {"h2d_gbps": _gbps(size, h2d), "d2h_gbps": _gbps(size, d2h)}

    def close(self) -> None:
        self.stream.synchronize()
        self.cp.get_default_memory_pool().free_all_blocks()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()


class NativeOpenCL:
    kind = "plain pyopencl in this process, on the same OpenCL device (no CUDA here)"

    def __init__(self, device: int) -> None:
        import pyopencl as cl

        self.cl = cl
        # The broker numbers OpenCL devices the same way: every platform's devices, in order.
        devices = [d for p in cl.get_platforms() for d in p.get_devices()]
        self.dev = devices[device]
        self.ctx = cl.Context([self.dev])
        self.queue = cl.CommandQueue(self.ctx, self.dev)
        program = cl.Program(self.ctx, samples.source("opencl")).build()
        self.empty = program.empty_kernel
        self.spin = program.spin
        self.x = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, SPIN_BLOCK * 4)
        cl.enqueue_fill_buffer(self.queue, self.x, np.zeros(1, dtype=np.float32), 0, SPIN_BLOCK * 4)
        self.word = np.empty(1, dtype=np.float32)
        self._launch_empty()
        self._launch_spin(1)
        self.queue.finish()

    def info(self) -> dict[str, str]:
        import pyopencl as cl

        return {"device": str(self.dev.name), "driver": f"{self.dev.platform.name} {self.dev.driver_version}",
                "runtime": f"pyopencl {cl.VERSION_TEXT}, {self.dev.platform.version}"}

    def _launch_empty(self) -> None:
        self.cl.enqueue_nd_range_kernel(self.queue, self.empty, (1,), (1,))

    def _launch_spin(self, iters: int) -> None:
        self.spin.set_args(self.x, np.int64(iters))
        self.cl.enqueue_nd_range_kernel(self.queue, self.spin, (SPIN_BLOCK,), (SPIN_BLOCK,))

    def launch_sync(self, iterations: int) -> list[float]:
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            self._launch_empty()
            self.queue.finish()
            times.append(time.perf_counter() - t0)
        return times

    def async_launches(self, count: int) -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(count):
            self._launch_empty()
        self.queue.finish()
        return time.perf_counter() - t0, time.process_time() - c0

    def spin_chain(self, iters: int, steps: int, read_every: int) -> float:
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            self._launch_spin(iters)
            if read_every and i % read_every == 0:
                self.cl.enqueue_copy(self.queue, self.word, self.x, is_blocking=True)
        self.queue.finish()
        return time.perf_counter() - t0

    def spin_each(self, iters: int, count: int) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            self._launch_spin(iters)
            self.queue.finish()
        return time.perf_counter() - t0

    def copies(self, size: int, repeats: int, pinned: bool) -> dict[str, float]:
        cl = self.cl
        data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        staging: list[Any] = []
        if pinned:  # OpenCL's page-locked host memory: a mapped ALLOC_HOST_PTR buffer
            flags = cl.mem_flags.READ_WRITE | cl.mem_flags.ALLOC_HOST_PTR
            arrays = []
            for _ in range(2):
                buf = cl.Buffer(self.ctx, flags, size)
                array, _ = cl.enqueue_map_buffer(self.queue, buf, cl.map_flags.READ | cl.map_flags.WRITE, 0,
                                                 (size,), np.uint8)
                staging.append(buf)
                arrays.append(array)
            host, out = arrays
            host[:] = data
        else:
            host, out = data, np.empty_like(data)
        dev = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, size)
        h2d, d2h = [], []
        for i in range(repeats + 1):  # the first round warms up
            t0 = time.perf_counter()
            cl.enqueue_copy(self.queue, dev, host, is_blocking=True)
            t1 = time.perf_counter()
            cl.enqueue_copy(self.queue, out, dev, is_blocking=True)
            t2 = time.perf_counter()
            if i:
                h2d.append(t1 - t0)
                d2h.append(t2 - t1)
        if not np.array_equal(out, host):
            raise AssertionError("native copy round trip returned different bytes")
        del host, out, staging  # (a mapped buffer is released with its array, by the garbage collector)
        dev.release()
        return {"h2d_gbps": _gbps(size, h2d), "d2h_gbps": _gbps(size, d2h)}

    def close(self) -> None:
        self.queue.finish()


def open_native(backend: str, device: int) -> Native:
    return NativeCupy(device) if backend == "cuda" else NativeOpenCL(device)
