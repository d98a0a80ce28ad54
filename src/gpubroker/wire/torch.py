"""The torch device's commands: PyTorch's ATen operators, run by the tenant's worker with the real PyTorch.

The client's torch device (``gpubroker.client.torch``) keeps, for each of its tensors, only metadata (dtype,
shape, strides, storage offset) and a handle the client chose; the worker keeps the real ``torch.Tensor`` under that
handle, in the session's table (one namespace with buffers, streams, ...). A view's real tensor is made by running
the real view operator in the worker, so storage sharing lives where the storage is.

Each ATen operator the client dispatches is one ``TorchOp``: the operator's overload name (``"aten::add.Tensor"``,
on the allowlist of ``gpubroker.wire.torch_ops``), its arguments (tensors by handle), the handles the client chose
for its new outputs and the metadata the client worked out for them (cached per operator and input signature, so
no round trip). The worker reserves each new output's bytes against the tenant's memory quota before it runs the
operator (from its own reckoning, never the client's), runs it on the session's device and stream, checks the
outputs against the metadata and stores them. It is queued like a launch; its
errors are deferred to the next waiting call. An operator whose output shapes depend on the data (``nonzero``,
``unique``, boolean indexing) or that returns a plain value (``equal``, ``_local_scalar_dense``) is a
``TorchOpSync``: the same, whose result tells the client what came out.

Data moves through the session's buffers, so tensors use every transport's copy path (shared memory, striping,
lz4): ``TorchFromBuffer`` makes a tensor from a buffer's bytes, ``TorchToBuffer`` writes a tensor's elements (in
row-major order) into one; ``TorchRead`` returns a small tensor's elements at once (``.item()``, ``print``).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

from gpubroker.wire.commands import BufRef, Command, Handle, OptionalStream

__all__ = [
    "MAX_TORCH_ARGS",
    "MAX_TORCH_READ",
    "ArgValue",
    "Complex",
    "DeviceArg",
    "DtypeArg",
    "LayoutArg",
    "MemoryFormatArg",
    "OpResult",
    "TensorArg",
    "TensorListArg",
    "TensorMeta",
    "TorchFree",
    "TorchFromBuffer",
    "TorchOp",
    "TorchOpSync",
    "TorchRead",
    "TorchSeed",
    "TorchToBuffer",
]

MAX_TORCH_ARGS: Final = 64  # positional arguments, keyword arguments, outputs: each at most this many
MAX_TORCH_READ: Final = 1 << 20  # bytes a TorchRead returns at most (larger reads go through a buffer)
_MAX_DIMS: Final = 32
_NAME = Annotated[str, msgspec.Meta(max_length=128)]
_SHORT = Annotated[str, msgspec.Meta(max_length=64)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
Stride = Annotated[int, msgspec.Meta(ge=-(1 << 62), le=1 << 62)]

# A tensor as the client sees it: torch dtype name ("float32"), shape, strides (in elements), storage offset.
TensorMeta = tuple[_SHORT, Annotated[tuple[Dim, ...], msgspec.Meta(max_length=_MAX_DIMS)],
                   Annotated[tuple[Stride, ...], msgspec.Meta(max_length=_MAX_DIMS)], Dim]


class _Arg(msgspec.Struct, frozen=True, gc=False, tag_field="k"):
    """An operator argument that is not a plain number, string, None or list of numbers (map-encoded and tagged,
    so it can share a union with those)."""


class TensorArg(_Arg, tag="t", frozen=True):
    """A tensor of the session, by handle."""

    h: Handle


class TensorListArg(_Arg, tag="tl", frozen=True):
    """``Tensor[]`` or ``Tensor?[]``: handles, None for an absent optional tensor."""

    hs: Annotated[list[Handle | None], msgspec.Meta(max_length=1024)]


class DtypeArg(_Arg, tag="dt", frozen=True):
    """A ``torch.dtype`` by its name ("float32")."""

    name: _SHORT


class LayoutArg(_Arg, tag="ly", frozen=True):
    name: _SHORT  # "strided"


class MemoryFormatArg(_Arg, tag="mf", frozen=True):
    name: _SHORT  # "contiguous_format", "channels_last", "preserve_format"


class DeviceArg(_Arg, tag="dv", frozen=True):
    """A ``torch.device``: always the worker's own (the client never names a device the worker would use)."""


class Complex(_Arg, tag="c", frozen=True):
    re: float
    im: float


Scalar = int | float | bool | None
ArgValue = (TensorArg | TensorListArg | DtypeArg | LayoutArg | MemoryFormatArg | DeviceArg | Complex | int | float
            | bool | None | _SHORT | Annotated[list[int | float | bool | None], msgspec.Meta(max_length=1024)])
_Args = Annotated[list[ArgValue], msgspec.Meta(max_length=MAX_TORCH_ARGS)]
_Kwargs = Annotated[dict[_SHORT, ArgValue], msgspec.Meta(max_length=MAX_TORCH_ARGS)]
# One per returned tensor, in the order the operator returns them (a Tensor[] return flattened): the handle the
# client chose for a new tensor, or None where the return is an input itself (in-place and out= operators).
_Outs = Annotated[list[Handle | None], msgspec.Meta(max_length=1024)]
_Metas = Annotated[list[TensorMeta], msgspec.Meta(max_length=1024)]
# What a TorchOpSync returns, one per return of the operator: a tensor's metadata, or a plain value.
OpResult = Annotated[list[TensorMeta | Scalar], msgspec.Meta(max_length=1024)]


class TorchOp(Command, tag="torch_op", frozen=True):
    """One ATen operator, queued. ``metas`` holds the client's metadata for each new output (each ``outs`` that is
    not None, in order): the worker checks what the operator made against it (and lays an output out with its
    strides), having charged what the operator makes to the quota before running it."""

    front_skips = ("args", "kwargs", "outs", "metas")
    name: _NAME  # the overload ("aten::add.Tensor"): gpubroker.wire.torch_ops' allowlist
    args: _Args
    kwargs: _Kwargs
    outs: _Outs
    metas: _Metas
    stream: OptionalStream = ""

    def describe(self) -> str:
        return f"torch operator {self.name}"


class TorchOpSync(Command, tag="torch_op_sync", frozen=True):
    """One ATen operator whose output shapes depend on the data or which returns a plain value: its result is one
    entry per return (a new tensor's metadata, or the value). ``outs`` as for TorchOp; no metadata is announced."""

    front_skips = ("args", "kwargs")  # (not ``outs``: the front holds the result to their number)
    result = OpResult
    name: _NAME
    args: _Args
    kwargs: _Kwargs
    outs: _Outs
    stream: OptionalStream = ""

    def describe(self) -> str:
        return f"torch operator {self.name}"

    def check_result(self, result: Any) -> None:
        if len(result) != len(self.outs):
            raise ValueError(f"{len(result)} results for {len(self.outs)} outputs of {self.name}")


class TorchFromBuffer(Command, tag="torch_from_buffer", frozen=True):
    """A new contiguous tensor ``handle`` of ``meta``'s dtype and shape, holding the bytes of ``buf`` (row-major)."""

    handle: Handle
    buf: BufRef
    meta: TensorMeta
    stream: OptionalStream = ""


class TorchToBuffer(Command, tag="torch_to_buffer", frozen=True):
    """The elements of tensor ``handle``, in row-major order, written into ``buf`` (``.cpu()``, ``.tolist()``)."""

    handle: Handle
    buf: BufRef
    stream: OptionalStream = ""


class TorchRead(Command, tag="torch_read", frozen=True):
    """The elements of a small tensor (at most MAX_TORCH_READ bytes), row-major: ``.item()``, ``print``."""

    host_work = True
    result = Annotated[bytes, msgspec.Meta(max_length=MAX_TORCH_READ)]
    handle: Handle
    stream: OptionalStream = ""


class TorchFree(Command, tag="torch_free", frozen=True):
    """Drop the session's references to tensors (the storage goes with its last view): batched, as the client
    collects them."""

    device_work = False
    front_skips = ("handles",)
    handles: Annotated[list[Handle], msgspec.Meta(max_length=4096)]

    def describe(self) -> str:
        return f"torch_free of {len(self.handles)} tensors"


class TorchSeed(Command, tag="torch_seed", frozen=True):
    """Seed the worker's generator for this device (``torch.manual_seed``)."""

    device_work = False
    seed: int  # (torch.manual_seed takes any int64 or uint64)
