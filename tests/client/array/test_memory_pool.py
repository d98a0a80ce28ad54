"""The namespace's pool of dead buffers (``_memory.Memory``) on a real device: a loop reuses its results' memory
whatever the loops before it left in the pool. A pool full of one loop's buffers used to refuse every later size,
so each result of the next loop was a fresh allocation and a free (a free waits for the whole device on CUDA)."""

from __future__ import annotations

from typing import Any

from gpubroker.client import Buffer, GpuCompute
from gpubroker.client.array._memory import Memory

KiB = 1024


class CountingGpu:
    """A real device's GpuCompute, counting its allocations and frees."""

    def __init__(self, gpu: GpuCompute) -> None:
        self._gpu = gpu
        self.allocations = 0
        self.frees = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gpu, name)

    def allocate_memory(self, size: int) -> Buffer:
        self.allocations += 1
        return self._gpu.allocate_memory(size)

    def free_memory(self, buf: Buffer) -> None:
        self.frees += 1
        self._gpu.free_memory(buf)


def _loop(memory: Memory, nbytes: int, steps: int) -> None:
    """``steps`` results of ``nbytes``, each alive until the next (``r = f(x)`` in a loop)."""
    result = memory.allocate(nbytes)
    for _ in range(steps):
        result = memory.allocate(nbytes)
    del result


def test_a_loop_reuses_its_results_memory_after_a_loop_of_another_size_filled_the_pool(xp: Any) -> None:
    gpu = CountingGpu(xp._ctx.gpu)
    memory = Memory(gpu, memory_quota=4096 * KiB)  # a pool of at most 1 MiB
    _loop(memory, 512 * KiB, 20)  # leaves two 512 KiB buffers: the pool is full
    assert gpu.allocations <= 3
    before = gpu.allocations
    _loop(memory, 64 * KiB, 50)
    assert gpu.allocations - before <= 3, f"{gpu.allocations - before} allocations for 51 results, two alive at a time"
    assert gpu.frees <= 2  # the pool made room once, freeing the buffers it had kept longest
    before = gpu.allocations
    _loop(memory, 512 * KiB, 20)  # and back
    assert gpu.allocations - before <= 3
    memory.release()
    assert gpu.frees == gpu.allocations  # every buffer went back to the device


def test_a_buffer_larger_than_the_pool_is_freed_not_pooled(xp: Any) -> None:
    gpu = CountingGpu(xp._ctx.gpu)
    memory = Memory(gpu, memory_quota=256 * KiB)  # a pool of at most 64 KiB
    _loop(memory, 128 * KiB, 5)
    assert gpu.allocations == 6 and gpu.frees == 4  # each result freed once it died and the next was made
    memory.allocate(16 * KiB)  # collects the last two
    assert gpu.allocations == 7 and gpu.frees == 6


def test_two_large_results_stay_pooled_while_a_loop_of_small_ones_runs(xp: Any) -> None:
    # bench arrays' order: 50 calls of x * x on 8192 x 4096 float32 (two 128 MiB results alive at a time), then a
    # row sum's 32 KiB results. A pool of 256 MiB freed a 128 MiB buffer at the row sum's first result, inside its
    # timed loop (a cudaFree: ~0.4 ms on an H200). Without a tight quota the pool keeps them.
    gpu = CountingGpu(xp._ctx.gpu)
    memory = Memory(gpu, memory_quota=None)
    _loop(memory, 128 * 1024 * KiB + 256, 3)
    _loop(memory, 32 * KiB, 50)
    assert gpu.frees == 0
    _loop(memory, 128 * 1024 * KiB + 256, 3)
    assert gpu.frees == 0 and gpu.allocations == 4  # both large buffers reused, then the two small ones
    memory.release()
    assert gpu.frees == gpu.allocations
