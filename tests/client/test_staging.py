"""The staging path's pieces and the parallel copy it fills and drains slots with (no broker needed: pure functions
of sizes and host memory)."""

from __future__ import annotations

import numpy as np
import pytest

from gpubroker.client._memcpy import parallel_copy
from gpubroker.client._shm import staged_pieces

MiB = 1 << 20
SLOT = 32 * MiB


@pytest.mark.parametrize("total", [0, 1, 4 * MiB - 1, 4 * MiB, 4 * MiB + 1, 64 * MiB, 100 * MiB + 3, 512 * MiB])
@pytest.mark.parametrize("to_device", [True, False])
def test_pieces_tile_the_copy_within_a_slot_each(total: int, to_device: bool) -> None:
    sizes = staged_pieces(total, SLOT, to_device)
    assert sum(sizes) == total
    assert all(0 < n <= SLOT for n in sizes)


def test_the_ramp_is_where_the_pipeline_is_not_overlapped() -> None:
    # To the host the first copy-out waits for the first DMA; to the device the last DMA follows the last fill.
    assert staged_pieces(256 * MiB, SLOT, False) == [4 * MiB, 8 * MiB, 16 * MiB] + [SLOT] * 7 + [4 * MiB]
    assert staged_pieces(256 * MiB, SLOT, True) == [4 * MiB] + [SLOT] * 7 + [16 * MiB, 8 * MiB, 4 * MiB]
    assert staged_pieces(10, SLOT, True) == [10]
    assert staged_pieces(10, 4, False) == [1, 1, 2, 4, 2]  # (a tiny slot: no piece of 0 bytes)


@pytest.mark.parametrize("size", [0, 1, 2 * MiB - 1, 4 * MiB, 9 * MiB + 4097])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_parallel_copy_copies_every_byte(size: int, threads: int) -> None:
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros_like(src)
    parallel_copy(dst, src, threads)
    np.testing.assert_array_equal(dst, src)
    tail = np.zeros(size + 1, dtype=np.uint8)
    parallel_copy(tail[1:], src, threads)  # an unaligned destination, and the byte before it untouched
    assert tail[0] == 0
    np.testing.assert_array_equal(tail[1:], src)
