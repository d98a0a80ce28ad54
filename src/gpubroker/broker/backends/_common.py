"""Pieces both in-process backends share: handle tables and launch checks."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar, cast

from gpubroker.wire.errors import InvalidArgument, NotFound
from gpubroker.wire.types import Buffer, DeviceInfo, Dim3, KernelArg, check_kernel_args, normalize_dims

__all__ = ["HandleTable", "LaunchChecker", "LaunchShape", "PlanMemo", "check_launch", "source_text"]


def source_text(source: str, language: str) -> str:
    """``source`` if it is text a compiler reads whole: one with a NUL character would be read only up to it (the
    build then "succeeded" with none of the kernels after it, and the error came at the next call)."""
    nul = source.find("\0")
    if nul >= 0:
        raise InvalidArgument(f"{language} source holds a NUL character at offset {nul}: a compiler reads source "
                              "text only up to it; send the source as text")
    return source

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

    __slots__ = ("args", "block", "grid", "kinds", "shared_mem")

    def __init__(self, grid: Dim3, block: Dim3, args: list[KernelArg], shared_mem: int,
                 kinds: tuple[type, ...] | None = None) -> None:
        self.grid = grid
        self.block = block
        self.args = args
        self.shared_mem = shared_mem
        # The type of each arg: for Buffers and numpy scalars it fixes everything a parameter check reads
        # (pointer or scalar, dtype kind, width), so backends key their memoized per-kernel checks on it.
        self.kinds = tuple(map(type, args)) if kinds is None else kinds

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


class PlanMemo:
    """A bounded memo of launch signatures whose checks passed, so a repeated launch skips re-validation.

    Only successes are stored: a new or failing signature always runs the full checks, so errors are
    exactly those of an uncached launch. When full, the oldest entry goes (insertion order): a workload
    cycling through more signatures than ``limit`` just re-validates, it never gets a wrong answer.
    """

    __slots__ = ("_entries", "_limit")

    def __init__(self, limit: int = 64) -> None:
        self._entries: dict[Hashable, object] = {}
        self._limit = limit

    def get(self, key: Hashable) -> object | None:
        return self._entries.get(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def add(self, key: Hashable, value: object = True) -> None:
        entries = self._entries
        if key not in entries and len(entries) >= self._limit:
            del entries[next(iter(entries))]
        entries[key] = value

    def __len__(self) -> int:
        return len(self._entries)


def _dims_key(value: object) -> tuple[int, ...] | None:
    """A hashable key for a grid or block that normalize_dims would accept, or None to skip the memo.

    Only exact ints (not bools, not numpy integers) qualify, so equal keys always normalize equally."""
    if type(value) is int:
        return (value,)
    if type(value) in (tuple, list):
        items = cast("Sequence[int]", value)  # a tuple or list (a type() test does not narrow); ints if all() says
        if all(type(v) is int for v in items):
            return tuple(items)
    return None


class LaunchChecker:
    """``check_launch`` for one device, with its value-independent outcomes memoized.

    The grid / block / shared_mem checks depend only on those values and the device's fixed limits, and
    the arg type checks only on the sequence of arg types; a hit skips them. Buffer view offsets are
    values, so they are checked on every call.
    """

    def __init__(self, info: DeviceInfo, limit: int = 256) -> None:
        self.info = info
        self._shapes = PlanMemo(limit)  # (grid key, block key, shared_mem) -> (grid, block)
        self._kinds = PlanMemo(limit)  # tuples of arg types that check_kernel_args accepted

    def check(self, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[object],
              shared_mem: int) -> LaunchShape:
        g, b = _dims_key(grid), _dims_key(block)
        key = (g, b, shared_mem) if g is not None and b is not None and type(shared_mem) is int else None
        dims = self._shapes.get(key) if key is not None else None
        kinds = tuple(map(type, args)) if type(args) in (list, tuple) else None
        if dims is None or kinds is None or kinds not in self._kinds:
            # A new signature: the full checks, in their usual order, so the first error is the usual one.
            shape = check_launch(self.info, grid, block, args, shared_mem)
            if key is not None and kinds is not None:
                self._shapes.add(key, (shape.grid, shape.block))
                self._kinds.add(kinds)
            return shape
        checked = list(cast("Sequence[KernelArg]", args))  # their types are in _kinds: check_kernel_args took them
        for arg in checked:
            if isinstance(arg, Buffer) and not 0 <= arg.offset <= arg.size:
                raise InvalidArgument(f"buffer view offset {arg.offset} is outside its {arg.size}-byte allocation")
        grid3, block3 = cast("tuple[Dim3, Dim3]", dims)  # what the add above stores into _shapes
        return LaunchShape(grid3, block3, checked, shared_mem, kinds)
