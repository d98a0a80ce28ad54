"""The workloads a load-test tenant runs: each a setup and a repeatable, verified step.

A step is one operation as the report counts it (one latency sample): a copy round trip, a kernel and its
synchronize, or a batch of asynchronous launches and its synchronize. Every workload checks what the device
computed, and a wrong result raises ``WrongResult``, which the tenant counts as an error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from gpubroker.broker import samples
from gpubroker.client import Buffer, GpuCompute, Kernel

__all__ = ["WORKLOADS", "CopyRoundTrip", "CountingKernel", "LongKernel", "Workload", "WorkloadSpec", "WrongResult",
           "make_workload"]

# Name -> what one operation of it is (shown in --help and written to the JSON).
WORKLOADS: dict[str, str] = {
    "copies": "H2D then D2H of a host buffer (4 MiB by default), bytes compared",
    "short": "a saxpy over 256 Ki floats, then synchronize",
    "long": "a spin kernel calibrated to a few ms (5 by default), then synchronize",
    "sync": "the smallest launch (256 floats), then synchronize: round-trip bound",
    "async": "64 launches sent as asynchronous commands, then one synchronize",
}


class WrongResult(Exception):
    """A step finished without an error but the device's result is not the expected one."""


@dataclass(frozen=True)
class WorkloadSpec:
    """What a tenant process needs to build its workload (picklable, for the spawn start method)."""

    name: str
    copy_bytes: int = 4 << 20
    long_iters: int = 100_000
    long_expected: float | None = None  # the spin kernel's result from calibration, on the same device


class Workload(ABC):
    async_commands = False  # connect with async_commands=True

    @abstractmethod
    def setup(self, gpu: GpuCompute) -> None:
        """Allocate and compile; not timed."""

    @abstractmethod
    def step(self, gpu: GpuCompute) -> int:
        """One operation; returns the bytes it moved between host and device."""

    @abstractmethod
    def recover(self, gpu: GpuCompute) -> None:
        """After a failed step: return to a state whose next result is known."""


def _kernel(gpu: GpuCompute, name: str) -> Kernel:
    return gpu.compile_kernel(samples.source(gpu.device_info().backend), name)


class CopyRoundTrip(Workload):
    """H2D then D2H; a stamp that changes every step makes stale data show up as a mismatch."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(16, nbytes)
        self.count = 0

    def setup(self, gpu: GpuCompute) -> None:
        self.buf = gpu.allocate_memory(self.nbytes)
        self.host = np.random.default_rng().integers(0, 256, self.nbytes, dtype=np.uint8)
        self.back = np.empty_like(self.host)

    def step(self, gpu: GpuCompute) -> int:
        self.count += 1
        stamp = np.frombuffer(np.int64(self.count).tobytes(), dtype=np.uint8)
        self.host[:8], self.host[-8:] = stamp, stamp
        gpu.copy_h2d(self.host, self.buf)
        gpu.copy_d2h(self.buf, self.back)
        if not np.array_equal(self.back, self.host):
            wrong = int(np.count_nonzero(self.back != self.host))
            raise WrongResult(f"copy round trip {self.count}: {wrong} of {self.nbytes} bytes differ")
        return 2 * self.nbytes

    def recover(self, gpu: GpuCompute) -> None:
        pass  # every step overwrites the whole buffer


class CountingKernel(Workload):
    """Launches of a kernel that adds 1 to every element of a zeroed buffer, read back every few steps.

    ``scale_inplace`` (x = x * 1 + 1) and ``saxpy`` (y = 1 * x + y, x = ones) both count exactly in float32;
    the buffer is zeroed after each check, so the count never nears 2**24.
    """

    def __init__(self, kernel: str, n: int, launches: int, verify_every: int, async_commands: bool = False) -> None:
        self.kernel_name, self.n, self.launches, self.verify_every = kernel, n, launches, verify_every
        self.async_commands = async_commands
        self.count = 0  # launches since the buffer was zeroed
        self.steps = 0

    def setup(self, gpu: GpuCompute) -> None:
        self.kernel = _kernel(gpu, self.kernel_name)
        self.y = gpu.allocate_memory(4 * self.n)
        self.back = np.empty(self.n, dtype=np.float32)
        if self.kernel_name == "saxpy":
            self.x = gpu.allocate_memory(4 * self.n)
            gpu.copy_h2d(np.ones(self.n, dtype=np.float32), self.x)
        self._zero(gpu)

    def _args(self) -> list[object]:
        n = np.int32(self.n)
        if self.kernel_name == "saxpy":
            return [np.float32(1.0), self.x, self.y, n]
        return [self.y, np.float32(1.0), n]

    def _zero(self, gpu: GpuCompute) -> None:
        gpu.memset(self.y, 0)
        gpu.synchronize()
        self.count = 0

    def step(self, gpu: GpuCompute) -> int:
        block = 256
        grid = (self.n + block - 1) // block
        args = self._args()
        for _ in range(self.launches):
            gpu.execute_kernel(self.kernel, grid, block, args)
        gpu.synchronize()
        self.count += self.launches
        self.steps += 1
        if self.steps % self.verify_every:
            return 0
        gpu.copy_d2h(self.y, self.back)
        wrong = int(np.count_nonzero(self.back != np.float32(self.count)))
        if wrong:
            first = float(self.back[np.argmax(self.back != np.float32(self.count))])
            self.recover(gpu)
            raise WrongResult(f"{self.kernel_name}: {wrong} of {self.n} elements wrong after {self.steps} steps "
                              f"(e.g. {first}, expected {self.count})")
        self._zero(gpu)
        return self.back.nbytes

    def recover(self, gpu: GpuCompute) -> None:
        self._zero(gpu)


class LongKernel(Workload):
    """One thread of ``spin`` from zero: a few ms of dependent multiply-adds whose result calibration knows."""

    def __init__(self, iters: int, expected: float | None) -> None:
        self.iters, self.expected = iters, expected

    def setup(self, gpu: GpuCompute) -> None:
        self.kernel = _kernel(gpu, "spin")
        self.buf: Buffer = gpu.allocate_memory(4)
        self.back = np.empty(1, dtype=np.float32)

    def step(self, gpu: GpuCompute) -> int:
        gpu.memset(self.buf, 0)
        gpu.execute_kernel(self.kernel, 1, 1, [self.buf, np.int64(self.iters)])
        gpu.synchronize()
        gpu.copy_d2h(self.buf, self.back)
        got = float(self.back[0])
        # The chain tends to 0.5 / (1 - 0.999999) = 500000 from below; beyond that the result is garbage.
        if self.expected is not None and got != self.expected:
            raise WrongResult(f"spin({self.iters}) gave {got!r}, expected {self.expected!r}")
        if not 0.0 < got <= 500_001.0:
            raise WrongResult(f"spin({self.iters}) gave {got!r}, outside (0, 500000]")
        return self.back.nbytes

    def recover(self, gpu: GpuCompute) -> None:
        pass  # every step starts from a zeroed buffer


def make_workload(spec: WorkloadSpec) -> Workload:
    if spec.name == "copies":
        return CopyRoundTrip(spec.copy_bytes)
    if spec.name == "short":
        return CountingKernel("saxpy", 256 * 1024, launches=1, verify_every=16)
    if spec.name == "long":
        return LongKernel(spec.long_iters, spec.long_expected)
    if spec.name == "sync":
        return CountingKernel("scale_inplace", 256, launches=1, verify_every=64)
    if spec.name == "async":
        return CountingKernel("scale_inplace", 256, launches=64, verify_every=4, async_commands=True)
    raise ValueError(f"unknown workload {spec.name!r}; expected one of {', '.join(WORKLOADS)}")
