"""Pieces both in-process backends share: handle tables and launch checks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Generic, TypeVar

from gpubroker.client import (
    Buffer,
    DeviceInfo,
    InvalidArgument,
    NotFound,
)
from gpubroker.client._types import Dim3, KernelArg, check_kernel_args, normalize_dims

__all__ = ["HandleTable", "LaunchShape", "check_launch"]

T = TypeVar("T")


class HandleTable(Generic[T]):
    """Objects behind string handles; an unknown or freed handle is NOT_FOUND."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._objects: dict[str, T] = {}
        self._ids = itertools.count(1)

    def add(self, obj: T) -> str:
        handle = f"{self.kind}-{next(self._ids)}"
        self._objects[handle] = obj
        return handle

    def get(self, handle: str) -> T:
        try:
            return self._objects[handle]
        except KeyError:
            raise NotFound(f"unknown {self.kind} handle {handle!r} (never created, or already freed)") from None

    def pop(self, handle: str) -> T:
        obj = self.get(handle)
        del self._objects[handle]
        return obj

    def handles(self) -> list[str]:
        return list(self._objects)

    def __len__(self) -> int:
        return len(self._objects)


class LaunchShape:
    """A checked launch: grid (blocks per dimension), block (threads per block), args."""

    def __init__(self, grid: Dim3, block: Dim3, args: list[KernelArg], shared_mem: int) -> None:
        self.grid = grid
        self.block = block
        self.args = args
        self.shared_mem = shared_mem

    @property
    def global_size(self) -> Dim3:
        return (self.grid[0] * self.block[0], self.grid[1] * self.block[1], self.grid[2] * self.block[2])


def check_launch(info: DeviceInfo, grid: int | Sequence[int], block: int | Sequence[int],
                 args: Sequence[object], shared_mem: int) -> LaunchShape:
    """Validate a launch against the device's limits before it reaches the runtime."""
    checked_args = check_kernel_args(args)
    g = normalize_dims(grid, "grid")
    b = normalize_dims(block, "block")
    for axis, (extent, limit) in enumerate(zip(b, info.max_block_dims, strict=True)):
        if extent > limit:
            raise InvalidArgument(f"block extent {extent} on axis {'xyz'[axis]} exceeds the device limit {limit}")
    threads = b[0] * b[1] * b[2]
    if threads > info.max_threads_per_block:
        raise InvalidArgument(
            f"block of {threads} threads exceeds the device limit of {info.max_threads_per_block} per block")
    for axis, (extent, limit) in enumerate(zip(g, info.max_grid_dims, strict=True)):
        if extent > limit:
            raise InvalidArgument(f"grid extent {extent} on axis {'xyz'[axis]} exceeds the device limit {limit}")
    if not isinstance(shared_mem, int) or shared_mem < 0:
        raise InvalidArgument(f"shared_mem must be a non-negative int, got {shared_mem!r}")
    for arg in checked_args:
        if isinstance(arg, Buffer) and not 0 <= arg.offset <= arg.size:
            raise InvalidArgument(f"buffer view offset {arg.offset} is outside its {arg.size}-byte allocation")
    return LaunchShape(g, b, checked_args, shared_mem)
