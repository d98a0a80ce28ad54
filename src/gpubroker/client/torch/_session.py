"""One device's session: its GpuCompute, the handles its client tensors dropped, its deferred error, and the calls
that move data or wait.

Every call into the GpuCompute goes through here, so that a worker's error that PyTorch raised comes out as the
PyTorch exception class (``_errors``), and frees and made-lazily tensors are sent before anything that waits.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any, Final, NoReturn

import torch

from gpubroker.client.torch._errors import as_torch_error
from gpubroker.wire.compute import GpuCompute
from gpubroker.wire.errors import GpuBrokerError
from gpubroker.wire.torch import (
    MAX_TORCH_READ,
    DeviceArg,
    DtypeArg,
    TensorArg,
    TensorListArg,
    TensorMeta,
    TorchOp,
    TorchOpSync,
)

__all__ = ["FREE_BATCH", "READ_INLINE", "Session", "new_handle"]

FREE_BATCH: Final = 64  # dropped tensors' handles sent in one torch_free
READ_INLINE: Final = min(MAX_TORCH_READ, 256 << 10)  # bytes up to which a read is one torch_read, not a buffer trip

# Handles of client tensors: a per-process counter (the worker keeps handles per session, and a counter is cheaper
# than a random token per operator output). "T" keeps them apart from the random handles of buffers and streams.
_counter = itertools.count(1)


def new_handle() -> str:
    """A fresh handle for a tensor (unique in this process, so in every session it opens)."""
    return f"T{next(_counter):x}"


# Operators whose outputs the worker's PyTorch made otherwise than the client's meta kernels said (a kernel of the
# worker's device that disagrees with meta, as eval-mode batch norm's on the CPU): found from the worker's refusal,
# after which their calls ask the worker what comes out (once per signature). ``on_disagreement`` empties the
# client's caches that hold the wrong answer.
DISAGREEING: set[str] = set()
on_disagreement: list[Callable[[], None]] = []
_DISAGREES = re.compile(r"(\w+::[\w.]+) made an? .* shape inference disagrees")


def raise_error(exc: GpuBrokerError) -> NoReturn:
    """Raise a worker's error as PyTorch would have raised it (a GpuBrokerError of the broker's own as it is)."""
    found = _DISAGREES.search(exc.message)
    if found is not None and found.group(1) not in DISAGREEING:
        DISAGREEING.add(found.group(1))
        for forget in on_disagreement:
            forget()
        exc.message += " (the next calls of this operator ask the worker what it makes)"
        exc.args = (exc.message,)
    torch_exc = as_torch_error(exc)
    if torch_exc is None:
        raise exc
    raise torch_exc from exc


DTYPES: Final[dict[str, torch.dtype]] = {
    str(dt).removeprefix("torch."): dt for dt in vars(torch).values() if isinstance(dt, torch.dtype)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_meta(shape: Sequence[int], dtype: torch.dtype) -> TensorMeta:
    """A contiguous tensor's metadata as the wire gives it."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return (dtype_name(dtype), tuple(shape), tuple(reversed(stride)), 0)


class Session:
    """A GpuCompute serving as the device ``gpubroker:<index>``."""

    def __init__(self, gpu: GpuCompute, index: int) -> None:
        self.gpu = gpu
        self.index = index
        self.device = torch.device("gpubroker", index)
        # Handles of client tensors that died (BTensor.__del__ appends; nothing else may run there), sent in one
        # torch_free once FREE_BATCH gather or before anything that waits.
        self.dead: list[str] = []
        # Empty tensors not made yet: torch.empty / x.to(dev)'s destination, usually filled by an upload next,
        # which then makes the tensor from the uploaded bytes directly (one command instead of three). Made when an
        # operator names them or something waits; never, if dropped first (batch norm's 0-byte reserve, which an
        # inference pass makes at every layer and nothing reads).
        self.pending: dict[str, TorchOp] = {}
        # An error raised inside backward (where raising would abort the process), raised at the next wait; and
        # the handles of the placeholder tensors returned instead, which the worker never made.
        self.deferred: BaseException | None = None
        self.poisoned: set[str] = set()

    # ------------------------------------------------------------------ queued work
    def submit(self, op: TorchOp) -> None:
        if self.pending:
            self._make_named(op)
        try:
            self.gpu.torch_op(op)
        except GpuBrokerError as exc:
            raise_error(exc)
        if len(self.dead) >= FREE_BATCH:  # after the operator: a handle it made may be among them already
            self.flush_frees()

    def _make_named(self, op: TorchOp) -> None:
        """Make the pending tensors the operator names, before it."""
        pending = self.pending
        for arg in (*op.args, *op.kwargs.values()):
            if isinstance(arg, TensorArg):
                made = pending.pop(arg.h, None)
                if made is not None:
                    self.submit(made)
            elif isinstance(arg, TensorListArg):
                for h in arg.hs:
                    made = pending.pop(h, None) if h is not None else None
                    if made is not None:
                        self.submit(made)

    def make_pending(self) -> None:
        while self.pending:
            _, op = self.pending.popitem()
            self.submit(op)

    def flush_frees(self) -> None:
        # Taken by count, not by swapping the list: a finalizer may append while this runs.
        count = len(self.dead)
        dead = self.dead[:count]
        del self.dead[:count]
        if self.pending or self.poisoned:  # neither was ever made in the worker
            made = [h for h in dead if self.pending.pop(h, None) is None and h not in self.poisoned]
            self.poisoned.difference_update(dead)
            dead = made
        if dead:
            try:
                self.gpu.torch_free(dead)
            except GpuBrokerError as exc:
                raise_error(exc)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A call into the GpuCompute that may raise a worker's torch error."""
        try:
            return fn(*args)
        except GpuBrokerError as exc:
            raise_error(exc)

    # ------------------------------------------------------------------ waits
    def before_wait(self) -> None:
        """What every waiting call does first: send what is due, then raise the error kept from backward."""
        if self.dead:
            self.flush_frees()  # (first: a pending tensor dropped already is never made)
        if self.pending:
            self.make_pending()
        if self.deferred is not None:
            exc, self.deferred = self.deferred, None
            raise exc

    def op_sync(self, op: TorchOpSync) -> list[Any]:
        self.before_wait()
        result: list[Any] = self.call(self.gpu.torch_op_sync, op)
        return result

    def synchronize(self) -> None:
        self.before_wait()
        self.call(self.gpu.synchronize)

    def seed(self, seed: int) -> None:
        self.call(self.gpu.torch_seed, seed)

    def read(self, handle: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor's elements as a new contiguous CPU tensor (waits for the work queued before)."""
        self.before_wait()
        if handle in self.poisoned:
            raise RuntimeError("this gpubroker tensor has no value: the operator that made it failed earlier")
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            self.call(self.gpu.synchronize)  # still a waiting call: earlier errors surface here as anywhere
            return torch.empty(shape, dtype=dtype)
        host = bytearray(nbytes)
        if nbytes <= READ_INLINE:
            data: bytes = self.call(self.gpu.torch_read, handle)
            if len(data) != nbytes:
                raise RuntimeError(f"gpubroker: the worker returned {len(data)} bytes for a {nbytes}-byte tensor")
            host[:] = data
        else:
            buf = self.call(self.gpu.allocate_memory, nbytes)
            try:
                self.call(self.gpu.torch_to_buffer, handle, buf)
                self.call(self.gpu.copy_d2h, buf, host)
            finally:
                self.call(self.gpu.free_memory, buf)
        return torch.frombuffer(host, dtype=dtype).reshape(shape)

    def upload(self, handle: str, cpu: torch.Tensor) -> None:
        """Make tensor ``handle`` of the session from a CPU tensor's elements (contiguous, of its dtype)."""
        meta = wire_meta(tuple(cpu.shape), cpu.dtype)
        if not cpu.numel():  # no bytes to send (and no buffer of 0 bytes): an empty tensor of the shape
            self.submit(TorchOp("aten::empty.memory_format", [list(cpu.shape)],
                                {"dtype": DtypeArg(meta[0]), "device": DeviceArg()}, [handle], [meta]))
            return
        flat = cpu.detach().contiguous().reshape(-1)
        if flat.stride() != (1,):  # one element broadcast (stride 0) still counts as contiguous
            flat = flat.clone(memory_format=torch.contiguous_format)
        host = flat.view(torch.uint8).numpy()
        buf = self.call(self.gpu.allocate_memory, host.nbytes)
        try:
            self.call(self.gpu.copy_h2d, host, buf)
            self.call(self.gpu.torch_from_buffer, handle, buf, meta)
        finally:
            self.call(self.gpu.free_memory, buf)
