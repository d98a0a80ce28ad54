"""A GpuCompute-like object with only what the torch device uses, for the client's tests without a worker.

Handle -> a real CPU tensor, as the spike's FakeWorker (design/torch-device/gbtorch.py): queued commands run at
the next wait, a failed one's error (as a worker sends it: InvalidArgument with ``details["torch_error"]``) is
raised there. Every command goes through msgspec's encode and decode, as on the wire, so the client's arguments
are checked against wire.torch's types.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from gpubroker.wire.errors import GpuBrokerError, InvalidArgument, NotFound, Unimplemented
from gpubroker.wire.host import HostBuffer
from gpubroker.wire.torch import (
    Complex,
    DeviceArg,
    DtypeArg,
    LayoutArg,
    MemoryFormatArg,
    TensorArg,
    TensorListArg,
    TensorMeta,
    TorchOp,
    TorchOpSync,
)
from gpubroker.wire.torch_ops import ALLOWED, split_name
from gpubroker.wire.types import Buffer, Stream

DTYPES = {str(dt).removeprefix("torch."): dt for dt in vars(torch).values() if isinstance(dt, torch.dtype)}


def _wire(op: Any) -> Any:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(op), type=type(op))


class FakeTorchGpu:
    """The torch calls of a GpuCompute over a dict of CPU tensors."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, bytearray] = {}
        self.queue: list[tuple[str, Any]] = []
        self.error: GpuBrokerError | None = None
        self.counts = {"torch_op": 0, "torch_op_sync": 0, "torch_free": 0, "torch_read": 0, "waits": 0}
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ memory
    def allocate_memory(self, size: int) -> Buffer:
        handle = f"b{next(self._ids)}"
        self.buffers[handle] = bytearray(size)
        return Buffer(handle, size)

    def free_memory(self, buf: Buffer) -> None:
        self.queue.append(("free_memory", buf.handle))

    def copy_h2d(self, src: HostBuffer, buf: Buffer, offset: int = 0, stream: Stream | None = None) -> None:
        self._wait()
        data = memoryview(src).cast("B")
        self.buffers[buf.handle][buf.offset + offset:buf.offset + offset + len(data)] = data

    def copy_d2h(self, buf: Buffer, dst: HostBuffer, offset: int = 0, stream: Stream | None = None) -> None:
        self._wait()
        out = memoryview(dst).cast("B")
        out[:] = self.buffers[buf.handle][buf.offset + offset:buf.offset + offset + len(out)]

    def synchronize(self, stream: Stream | None = None) -> None:
        self._wait()

    # ------------------------------------------------------------------ torch
    def torch_op(self, op: TorchOp) -> None:
        self.counts["torch_op"] += 1
        self.queue.append(("op", _wire(op)))

    def torch_op_sync(self, op: TorchOpSync) -> list[Any]:
        self.counts["torch_op_sync"] += 1
        self._wait()
        op = _wire(op)
        try:
            res = self._run(op.name, op.args, op.kwargs, op.outs)
        except GpuBrokerError:
            raise
        result = []
        for h, r in zip(op.outs, res, strict=True):
            if isinstance(r, torch.Tensor):
                result.append([str(r.dtype).removeprefix("torch."), list(r.shape), list(r.stride()),
                               r.storage_offset()])
            else:
                result.append(r)
            del h
        return result

    def torch_from_buffer(self, handle: str, buf: Buffer, meta: TensorMeta, stream: Stream | None = None) -> None:
        self.queue.append(("from_buffer", (handle, buf.handle, buf.offset, meta)))

    def torch_to_buffer(self, handle: str, buf: Buffer, stream: Stream | None = None) -> None:
        self.queue.append(("to_buffer", (handle, buf.handle, buf.offset)))

    def torch_read(self, handle: str, stream: Stream | None = None) -> bytes:
        self.counts["torch_read"] += 1
        self._wait()
        t = self.tensors[handle].reshape(-1).clone(memory_format=torch.contiguous_format)
        return bytes(t.view(torch.uint8).numpy()) if t.numel() else b""

    def torch_free(self, handles: Sequence[str]) -> None:
        self.counts["torch_free"] += 1
        self.queue.append(("free", list(handles)))

    def torch_seed(self, seed: int) -> None:
        self.queue.append(("seed", seed))

    # ------------------------------------------------------------------ the fake worker
    def _wait(self) -> None:
        self.counts["waits"] += 1
        queue, self.queue = self.queue, []
        for kind, value in queue:
            try:
                self._do(kind, value)
            except GpuBrokerError as exc:
                if self.error is None:
                    self.error = exc
        if self.error is not None:
            exc, self.error = self.error, None
            raise exc

    def _do(self, kind: str, value: Any) -> None:
        if kind == "op":
            self._run(value.name, value.args, value.kwargs, value.outs, value.metas)
        elif kind == "free":
            for h in value:
                self.tensors.pop(h, None)
        elif kind == "free_memory":
            del self.buffers[value]
        elif kind == "seed":
            torch.default_generator.manual_seed(value)  # the worker's generator: CPU torch's own here
        elif kind == "from_buffer":
            handle, buf, offset, (dtype, shape, _, _) = value
            dt = DTYPES[dtype]
            numel = int(np.prod(shape)) if shape else 1
            data = bytearray(self.buffers[buf][offset:offset + numel * dt.itemsize])
            self.tensors[handle] = (torch.frombuffer(data, dtype=dt) if numel else torch.empty(0, dtype=dt)
                                    ).reshape(shape).clone()
        elif kind == "to_buffer":
            handle, buf, offset = value
            t = self.tensors[handle].reshape(-1).clone(memory_format=torch.contiguous_format)
            data = t.view(torch.uint8).numpy().tobytes()
            self.buffers[buf][offset:offset + len(data)] = data

    def _arg(self, a: Any) -> Any:
        kind = type(a)
        if kind is TensorArg:
            if a.h not in self.tensors:
                raise NotFound(f"no tensor {a.h}")
            return self.tensors[a.h]
        if kind is TensorListArg:
            return [None if h is None else self._arg(TensorArg(h)) for h in a.hs]
        if kind is DtypeArg:
            return DTYPES[a.name]
        if kind is LayoutArg:
            return getattr(torch, a.name)
        if kind is MemoryFormatArg:
            return getattr(torch, a.name)
        if kind is DeviceArg:
            return torch.device("cpu")
        if kind is Complex:
            return complex(a.re, a.im)
        return a

    def _run(self, name: str, args: list[Any], kwargs: dict[str, Any], outs: list[str | None],
             metas: list[TensorMeta] | None = None) -> list[Any]:
        if name not in ALLOWED:
            raise Unimplemented(f"torch operator {name} is not on the allowlist")
        ns, op, overload = split_name(name)
        func = getattr(getattr(getattr(torch.ops, ns), op), overload)
        try:
            a = [self._arg(v) for v in args]
            k = {n: self._arg(v) for n, v in kwargs.items()}
            res = func(*a, **k)
        except GpuBrokerError:
            raise
        except Exception as exc:
            raise InvalidArgument(str(exc), torch_error=type(exc).__name__,
                                  command=f"torch operator {name}") from None
        flat: list[Any] = []
        if isinstance(res, (tuple, list)):
            for r in res:
                flat.extend(r) if isinstance(r, (list, tuple)) else flat.append(r)
        elif res is not None or outs:
            flat.append(res)
        got = flat
        for h, r in zip(outs, got, strict=False):
            if h is not None:
                self.tensors[h] = r
        if metas is not None:  # the client's announced metadata must be what the operator made
            news = [r for h, r in zip(outs, got, strict=False) if h is not None]
            for m, r in zip(metas, news, strict=True):
                real = (str(r.dtype).removeprefix("torch."), tuple(r.shape), tuple(r.stride()), r.storage_offset())
                if m[0] != real[0] or tuple(m[1]) != real[1]:  # as the worker refuses it
                    raise InvalidArgument(f"{name} made a {real[0]} tensor of shape {list(real[1])} where the client "
                                          f"worked out {m[0]} {list(m[1])} (offset {m[3]}): the client's shape "
                                          "inference disagrees with this worker's PyTorch")
                assert tuple(m) == real, f"{name}: client announced {m}, worker made {real}"
        return got
