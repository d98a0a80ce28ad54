"""The torch device's worker half: one session's tensors, and the real PyTorch running ATen operators on them.

A ``TorchSession`` keeps the client's handles -> real ``torch.Tensor`` and runs each allowlisted operator
(``gpubroker.wire.torch_ops``) as ``torch.ops.aten.<name>.<overload>`` on the backend's device:

- on an OpenCL backend, PyTorch's CPU kernels on CPU tensors: PoCL's device is the host CPU here, so PyTorch's own
  CPU kernels are the device's library, as library operations use NumPy there (``OpenCLBackend.run_library``); a
  discrete OpenCL GPU would have its tensors in host memory all the same (there is no OpenCL PyTorch);
- on a CUDA backend, CUDA tensors on the backend's device, each operator on the session's stream (PyTorch's
  ``ExternalStream`` over the CuPy stream), charged as device time by the backend's timer.

A backend makes one per session (``torch_session``): the in-process backend one for itself, the worker one per
session of its handle table, so two sessions' handles never meet. PyTorch is imported at the first session, never
at the worker's start.

Memory: every new output's storage is charged to the session's ``TorchAccounts`` (the worker's: the tenant's
memory quota on the device) before the operator runs, from what the worker itself works out it makes, whatever the
client announced (a run on meta tensors, once per operator and input signature: ``_Predicted``; for an operator
whose outputs depend on the data, a bound from its inputs: ``_BOUNDS``), and settled on what PyTorch really made
once it has (the announced metadata is checked against that); a view shares its base's storage and is not charged
again, and a storage is released when the last handle that references it is freed. Errors PyTorch raises running an
operator are the tenant's: they become gpubroker errors carrying PyTorch's class name (``details["torch_error"]``)
and message (a call its meta kernel refuses, in the meta kernel's words: it is refused before it runs).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import numpy as np

from gpubroker.wire import torch_ops
from gpubroker.wire.errors import (
    Aborted,
    GpuBrokerError,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unimplemented,
)
from gpubroker.wire.torch import (
    MAX_TORCH_READ,
    ArgValue,
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
from gpubroker.wire.types import Buffer, Stream

if TYPE_CHECKING:
    import torch

__all__ = ["CpuPlacement", "CudaPlacement", "TorchAccounts", "TorchCache", "TorchPart", "TorchPlacement",
           "TorchSession", "import_torch"]

_import_lock = threading.Lock()
_torch: Any = None  # the torch module, once imported (import_torch)


def import_torch() -> Any:
    """PyTorch, imported at the first use (a worker that runs no torch operator never pays for it).

    Its CPU thread pool is kept to the CPUs this process may run on: PyTorch sizes it by the machine's cores, and
    a sandboxed worker's share is fewer (more threads than CPUs only contend).
    """
    global _torch
    if _torch is not None:
        return _torch
    with _import_lock:
        if _torch is None:
            # PyTorch's C++ warnings about a tenant's operators (a deprecated argument, too few degrees of
            # freedom) would go to the worker's stderr, the broker's log, as often as tenants make them: nobody
            # reads them there. Its errors still do (read once, as PyTorch starts).
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            try:
                import torch
            except (ImportError, OSError, MemoryError) as exc:  # (absent, or its libraries failed to load)
                raise Unimplemented(f"this broker has no PyTorch for the torch device: {exc}") from None
            # (and its Python warnings, raised where this module calls an operator)
            warnings.filterwarnings("ignore", module=re.escape(__name__))
            cpus = len(os.sched_getaffinity(0))
            if torch.get_num_threads() > cpus:
                torch.set_num_threads(cpus)
            _torch = torch
    return _torch


class TorchAccounts:
    """Where a session's torch handles and memory are counted. This one counts nothing (an in-process backend:
    the device's own memory is the limit); the worker's counts them in its handle table, against the quota."""

    def claim(self, handles: Sequence[str]) -> None:
        """Check that these new handles are free in the session's namespace and that it has room for them."""

    def bind(self, handle: str) -> None:
        """The handle now names a tensor."""

    def unbind(self, handles: Sequence[str]) -> None:
        """These handles name nothing any more."""

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` against the quota (ResourceExhausted past it)."""

    def unreserve(self, nbytes: int) -> None:
        """Give ``nbytes`` back."""

    def quota(self) -> int | None:
        """The most bytes the tenant may hold on the device; None: no quota."""
        return None


class TorchPlacement(Protocol):
    """What a backend supplies to a TorchSession: where its tensors live and how its buffers' bytes reach them."""

    def device(self) -> torch.device:
        """The device every tensor of the session lives on (a DeviceArg becomes this)."""
        ...

    def running(self, stream: Stream | None) -> AbstractContextManager[None]:
        """Around an operator: on ``stream``, its time charged as the tenant's device time."""
        ...

    def from_buffer(self, buf: Buffer, nbytes: int, stream: Stream | None) -> torch.Tensor:
        """A new uint8 tensor on the device holding ``nbytes`` bytes of ``buf`` from its view's offset."""
        ...

    def to_buffer(self, data: torch.Tensor, buf: Buffer, stream: Stream | None) -> None:
        """Write a contiguous uint8 tensor's bytes into ``buf`` at its view's offset."""
        ...

    def host_bytes(self, data: torch.Tensor, stream: Stream | None) -> bytes:
        """A contiguous uint8 tensor's bytes, on the host."""
        ...

    def generator(self) -> torch.Generator:
        """The device's default generator."""
        ...

    def freed(self, nbytes: int) -> None:
        """Tensors' storages of ``nbytes`` were freed (a caching allocator may keep them for the next operators;
        the backend gives them back before it allocates otherwise)."""
        ...

    def bound(self, quota: int | None) -> None:
        """Where an allocator of PyTorch's own holds device memory, keep it within the tenant's quota."""
        ...

    def error(self, what: str, exc: Exception) -> GpuBrokerError | None:
        """The backend's own reading of an exception (a CUDA fault that broke the context), or None."""
        ...


@dataclass(slots=True)
class _OpInfo:
    """What the session needs of an operator overload, worked out once per name."""

    overload: Any  # torch._ops.OpOverload
    makes: bool  # returns a tensor that is not an in-place / out= argument (a new storage, or a view)
    params: tuple[tuple[str, bool, Any], ...]  # per parameter: its name, whether it has a default, and the default
    devices: tuple[int, ...]  # positions of Device parameters: only DeviceArg or None may go there
    device_names: frozenset[str]
    generator: int  # position of the Generator parameter, -1 if none
    generator_name: str
    # ScalarType, Layout and MemoryFormat parameters: only their wrappers (DtypeArg, ...) or None may go there (PyTorch
    # takes a plain int as the enum, which would reach dtypes and layouts the device does not have)
    enums: frozenset[int | str]
    guarded: bool  # has a Device, Generator, ScalarType, Layout or MemoryFormat parameter
    # No Tensor parameter (a factory: arange, full, linspace): a float's value may decide its outputs' shape, so it
    # is part of the signature (_Predicted); elsewhere only a float's type is (a learning rate must not miss).
    valued: bool
    restrides: bool  # an in-place view operator (t_, squeeze_, as_strided_: PyTorch's inplace_view tag)
    writes: bool  # writes an argument (in-place, out=)


@dataclass(slots=True)
class _Storage:
    nbytes: int
    refs: int  # handles of the session whose tensors use it


_INTS: Final = frozenset({int})  # (an argument list of these alone is its own part of a call's signature)
_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128", "uint8", "int8",
                "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz")
_ENUM_PARAMETER = re.compile(r"\b(?:ScalarType|Layout|MemoryFormat)\?? (\w+)")
_FORMAT_NAMES = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")


# What a meta kernel cannot tell (no kernel for meta tensors, or outputs that depend on the data) says so this way.
_DATA_DEPENDENT = re.compile(r"data.dependent|[Mm]eta tensor|'Meta'|[Mm]eta backend|DynamicOutputShape|item\(\)")


def _broadcast(tm: Any, *shapes: Sequence[int]) -> Any:
    """The shapes broadcast together (refused in the words of PyTorch's kernels, which the operator would use)."""
    shape = tm.Size(shapes[0])
    for other in shapes[1:]:
        shape = tm._C._infer_size(shape, tm.Size(other))
    return shape


def _elements(tm: Any, *tensors: Any) -> int:
    """The elements of the tensors' broadcast shape (a Python int: no wrap)."""
    return math.prod(_broadcast(tm, *(t.shape for t in tensors)))


def _most(value: Any) -> int:
    """The largest of a list of lengths, as a tensor or a list (0 if none)."""
    if isinstance(value, list | tuple):
        return max((int(v) for v in value), default=0)
    return int(value.max()) if value.numel() else 0


def _unique_bytes(tm: Any, p: dict[str, Any]) -> int:
    t, dim = p["self"], p.get("dim")
    if dim is None:
        # values, inverse and counts (n x (s + 16)) and the sort's or hash set's own (measured up to 48 B/element)
        return int(t.numel() * (2 * t.element_size() + 48))
    # row-wise: an index and comparator state per row (measured up to 275 B/row) and copies of the rows
    return int(t.size(dim) * 320 + t.numel() * (4 * t.element_size() + 16))


def _repeat_self_bytes(tm: Any, p: dict[str, Any]) -> int:
    t, repeats, dim = p["self"], p["repeats"], p.get("dim")
    n = t.numel()
    d = n if dim is None else t.size(dim)
    rest = n // d if d else 0
    total = max(0, int(repeats.item()) * d if repeats.numel() == 1 else int(repeats.sum()))
    # the output (total rows of rest elements), its index (int64), the repeats expanded and summed, the input flattened
    return int(total * (rest * t.element_size() + 8) + d * 24 + n * t.element_size())


def _ctc_bytes(tm: Any, p: dict[str, Any]) -> int:
    log_probs = p["log_probs"]
    steps, batch = log_probs.size(0), (log_probs.size(1) if log_probs.dim() == 3 else 1)
    alpha = batch * steps * (2 * _most(p["target_lengths"]) + 1) * log_probs.element_size()
    return int(2 * alpha + 2 * log_probs.numel() * log_probs.element_size() + batch * 8)


def _nonzero_bytes(tm: Any, p: dict[str, Any]) -> int:
    """int64 indices: one row of ndim per nonzero element."""
    return int(tm.count_nonzero(p["self"])) * int(p["self"].dim()) * 8


def _margin_backward_bytes(tm: Any, p: dict[str, Any]) -> int:
    """The gradient, and an int64 per element of its input."""
    return int(p["self"].numel() * (p["self"].element_size() + 8))


def _index_bytes(tm: Any, p: dict[str, Any]) -> int:
    """``t[indices]``: a boolean mask selects its true elements (made into int64 indices first, as nonzero does);
    the index tensors broadcast together, and the dimensions none indexes are kept whole."""
    t, shapes, kept, dim, made = p["self"], [], 1, 0, 0
    for index in p["indices"]:
        if index is None:
            kept *= t.size(dim)
            dim += 1
        elif index.dtype in (tm.bool, tm.uint8):
            count = int(tm.count_nonzero(index))
            shapes.append((count,))
            made += count * index.dim() * 8
            dim += index.dim()
        else:
            shapes.append(tuple(index.shape))
            dim += 1
    kept *= math.prod(t.shape[dim:])
    return int(math.prod(_broadcast(tm, *shapes) if shapes else ()) * kept * t.element_size() + made)


# The operators sent as TorchOpSync whose bytes a meta run cannot tell (their outputs depend on the data, or PyTorch
# has no meta kernel for them): the most bytes each holds while it runs, from its inputs (params: the schema's
# parameters by name), counted on the device where the output depends on the values. Temporaries are counted where
# they grow with the inputs: measured on PyTorch 2.13's CPU kernels (tests/broker/backends/test_torch_session.py
# checks each bound against the memory the kernel really touched). Every other operator of the allowlist has a meta
# kernel, or makes no tensor (tests check that too).
_BOUNDS: dict[str, Callable[[Any, dict[str, Any]], int]] = {
    "aten::nonzero.default": _nonzero_bytes,
    "aten::argwhere.default": _nonzero_bytes,
    # (advanced indexing by a boolean mask: its meta kernel cannot count the mask)
    "aten::index.Tensor": _index_bytes,
    # the selected elements, and the mask as int64 and its prefix sum (PyTorch's parallel kernel)
    "aten::masked_select.default": lambda tm, p: (
        _elements(tm, p["self"], p["mask"]) * 18 + p["self"].element_size() * int(tm.count_nonzero(
            p["mask"].expand(_broadcast(tm, p["self"].shape, p["mask"].shape))))),
    "aten::masked_select_backward.default": lambda tm, p: _elements(tm, p["input"], p["mask"]) * (
        max(p["grad"].element_size(), p["input"].element_size()) + 8),
    "aten::_unique.default": _unique_bytes,
    "aten::_unique2.default": _unique_bytes,
    "aten::unique_consecutive.default": _unique_bytes,
    "aten::unique_dim.default": _unique_bytes,
    "aten::unique_dim_consecutive.default": _unique_bytes,
    # int64 indices, one per repeat, and the repeats' cumulative sum
    "aten::repeat_interleave.Tensor": lambda tm, p: (
        max(0, int(p["repeats"].sum()) if p["repeats"].numel() else 0) * 8 + p["repeats"].numel() * 24),
    "aten::repeat_interleave.self_Tensor": _repeat_self_bytes,
    # isclose's elementwise temporaries (a bool result, and differences in the inputs' dtype)
    "aten::allclose.default": lambda tm, p: _elements(tm, p["self"], p["other"]) * (
        4 * max(p["self"].element_size(), p["other"].element_size()) + 16),
    # int64 or float64 counts, one per value up to the largest; the weights as float64
    "aten::bincount.default": lambda tm, p: (
        max(int(p["self"].max()) + 1 if p["self"].numel() else 0, p["minlength"]) * 8 + p["self"].numel() * 8),
    "aten::_logcumsumexp.default": lambda tm, p: 2 * p["self"].numel() * p["self"].element_size(),
    "aten::multi_margin_loss_backward.default": _margin_backward_bytes,
    "aten::multilabel_margin_loss_backward.default": _margin_backward_bytes,
    "aten::_ctc_loss.Tensor": _ctc_bytes,
    "aten::_ctc_loss_backward.Tensor": _ctc_bytes,
    "aten::_ctc_loss_backward.default": _ctc_bytes,
}


class _Sig:
    """A tensor's signature, interned (TorchSession._sig): what its part in an operator's outputs' sizes may be,
    without its values: shape, strides, storage offset, dtype, and its conjugate and negative bits (``resolve_conj``
    copies a conjugate view). Compared by identity: cheap to hash, and never equal to an argument's value."""

    __slots__ = ("sig",)

    def __init__(self, sig: tuple[Any, ...]) -> None:
        self.sig = sig


def _weight(part: Any) -> int:
    """About how many objects a call's signature holds (what _Predicted bounds, besides its entries)."""
    if isinstance(part, tuple):
        return 1 + sum(_weight(p) for p in part)
    if isinstance(part, _Sig):
        return 6 + 2 * len(part.sig[0])
    return 1


# The calls whose outputs a session keeps (_Predicted): a training step makes a few hundred signatures; a client
# that never repeats one (or a hostile one) only makes the least recently used go. Their size is bounded too (about
# 16 bytes an object): a call may name 1,024 tensors of 32 dimensions.
_PREDICTED_ENTRIES = 4096
_PREDICTED_WEIGHT = 1 << 18
_INTERNED_MAX = 1 << 16  # distinct tensor signatures interned at once (TorchSession._sig)
_DATA_DEPENDENT_BYTES = -1  # (what a meta run cannot tell: the outputs' sizes depend on the data)


@dataclass(slots=True)
class _Prediction:
    nbytes: int  # of new storage, or _DATA_DEPENDENT_BYTES
    restrides: bool  # changes the shape or strides of a tensor it writes (TorchSession._sigs must be worked out again)
    weight: int
    # The new outputs' metadata as the client announced it at the last call of this signature, and the signatures
    # the outputs had then (each as announced): a call announcing the same gets its outputs checked against them in
    # one comparison each, and their signatures without working them out again (TorchSession._outputs).
    announced: Sequence[TensorMeta] | None = None
    made: tuple[_Sig, ...] = ()


class _Predicted:
    """What an operator makes, by the call's signature (TorchSession._arguments): worked out once per signature
    on meta tensors (PyTorch's own shape functions), then found in a dict. A bounded LRU."""

    __slots__ = ("_entries", "_weight")

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[Any, ...], _Prediction] = OrderedDict()
        self._weight = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[Any, ...]) -> _Prediction | None:
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
        return hit

    def put(self, key: tuple[Any, ...], nbytes: int, restrides: bool) -> _Prediction:
        found = _Prediction(nbytes, restrides, _weight(key))
        if found.weight > _PREDICTED_WEIGHT // 4:
            return found  # (a call this large is worked out each time: it would push out most of the others)
        entries = self._entries
        while entries and (len(entries) >= _PREDICTED_ENTRIES or self._weight + found.weight > _PREDICTED_WEIGHT):
            _, gone = entries.popitem(last=False)
            self._weight -= gone.weight
        entries[key] = found
        self._weight += found.weight
        return found


class TorchSession:
    """One session's tensors by the client's handles, and the operators run on them."""

    def __init__(self, placement: TorchPlacement, accounts: TorchAccounts | None = None) -> None:
        tm = self._t = import_torch()
        self.placement = placement
        self.accounts = accounts if accounts is not None else TorchAccounts()
        self._device = placement.device()
        placement.bound(self.accounts.quota())
        self._tensors: dict[str, torch.Tensor] = {}
        self._storage_of: dict[str, int] = {}  # handle -> its tensor's storage key
        self._storages: dict[int, _Storage] = {}  # storage key (the StorageImpl's address) -> size and references
        self._ops: dict[str, _OpInfo] = {}
        self._predicted = _Predicted()
        self._sigs: dict[str, _Sig] = {}  # handle -> its tensor's signature, worked out at its first use
        self._interned: dict[tuple[Any, ...], _Sig] = {}
        self._dtypes: dict[str, torch.dtype] = {
            n: d for n in _DTYPE_NAMES if isinstance(d := getattr(tm, n, None), tm.dtype)}
        self._formats = {n: getattr(tm, n) for n in _FORMAT_NAMES}
        self._tensor_type: type = tm.Tensor

    # -- the table -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def storage_bytes(self) -> int:
        """The bytes of every storage the session's tensors use (what its accounts were charged)."""
        return sum(s.nbytes for s in self._storages.values())

    def tensor(self, handle: str) -> torch.Tensor:
        t: torch.Tensor | None = self._tensors.get(handle)
        if t is None:
            raise NotFound(f"no tensor {handle!r} in this session")
        return t

    def _claim(self, handles: Sequence[str]) -> None:
        tensors = self._tensors
        for h in handles:
            if h in tensors:
                raise InvalidArgument(f"handle {h!r} is already in use in this session (a tensor)")
        if len(handles) > 1 and len(set(handles)) != len(handles):
            raise InvalidArgument("an operator's new outputs need a handle each; these repeat one")
        self.accounts.claim(handles)

    def _store(self, handle: str, t: torch.Tensor, key: int) -> None:
        self._tensors[handle] = t
        self._storage_of[handle] = key
        self.accounts.bind(handle)

    def free(self, handles: Sequence[str]) -> None:
        """Drop the tensors; a storage goes back to the accounts with its last handle. A handle that names no
        tensor is skipped: the client frees the handles of an operator that failed, which never named one."""
        released = 0
        tensors, sigs, storage_of, storages = self._tensors, self._sigs, self._storage_of, self._storages
        gone: list[str] = []
        for h in handles:
            if tensors.pop(h, None) is None:
                continue
            gone.append(h)
            sigs.pop(h, None)
            key = storage_of.pop(h)
            storage = storages[key]
            storage.refs -= 1
            if storage.refs == 0:
                del storages[key]
                released += storage.nbytes
        if gone:
            self.accounts.unbind(gone)
        if released:
            self.accounts.unreserve(released)
            self.placement.freed(released)

    def close(self) -> None:
        """Drop every tensor (the session ended)."""
        self.free(list(self._tensors))

    # -- operators -------------------------------------------------------------------------------
    def _info(self, name: str) -> _OpInfo:
        info = self._ops.get(name)
        if info is not None:
            return info
        if not torch_ops.allowed(name):
            raise Unimplemented(f"the torch operator {name!r:.140} is not on the broker's allowlist")
        namespace, op, overload_name = torch_ops.split_name(name)
        try:
            overload = getattr(getattr(getattr(self._t.ops, namespace), op), overload_name)
        except (AttributeError, RuntimeError):
            raise Unimplemented(f"this worker's PyTorch {self._t.__version__} has no operator {name}") from None
        schema = overload._schema
        makes = any(str(r.type) in ("Tensor", "Optional[Tensor]", "List[Tensor]")
                    and (r.alias_info is None or not r.alias_info.is_write) for r in schema.returns)
        params = tuple((a.name, a.has_default_value(), a.default_value if a.has_default_value() else None)
                       for a in schema.arguments)
        devices, device_names, generator, generator_name = [], set(), -1, ""
        enums: set[int | str] = set()
        # (the Python schema's types say int for these enums; its text says what they are)
        enum_names = set(_ENUM_PARAMETER.findall(str(schema)))
        for i, arg in enumerate(schema.arguments):
            kind = str(arg.type).removeprefix("Optional[").rstrip("]?")  # ("Device", "Optional[Device]", "Device?")
            if kind == "Device":
                devices.append(i)
                device_names.add(arg.name)
            elif kind == "Generator":
                generator, generator_name = i, arg.name
            elif arg.name in enum_names:
                enums.update((i, arg.name))
        valued = not any("Tensor" in str(a.type) for a in schema.arguments)
        info = self._ops[name] = _OpInfo(overload, makes, params, tuple(devices),
                                         frozenset(device_names), generator,
                                         generator_name, frozenset(enums),
                                         bool(devices) or generator >= 0 or bool(enums), valued,
                                         self._t.Tag.inplace_view in overload.tags,
                                         any(a.alias_info is not None and a.alias_info.is_write
                                             for a in schema.arguments))
        return info

    def _arg(self, value: ArgValue) -> Any:
        if isinstance(value, TensorArg):
            return self.tensor(value.h)
        if isinstance(value, TensorListArg):
            return [None if h is None else self.tensor(h) for h in value.hs]
        if isinstance(value, DeviceArg):
            return self._device
        if isinstance(value, DtypeArg):
            dtype = self._dtypes.get(value.name)
            if dtype is None:
                raise InvalidArgument(f"unknown torch dtype {value.name!r}")
            return dtype
        if isinstance(value, MemoryFormatArg):
            fmt = self._formats.get(value.name)
            if fmt is None:
                raise InvalidArgument(f"unknown torch memory format {value.name!r}")
            return fmt
        if isinstance(value, LayoutArg):
            if value.name != "strided":
                raise InvalidArgument(f"the torch device has strided tensors only, not {value.name!r}")
            return self._t.strided
        if isinstance(value, Complex):
            return complex(value.re, value.im)
        return value

    def _sig(self, handle: str, t: torch.Tensor) -> _Sig:
        """The tensor's signature, kept by handle until the tensor goes or an operator restrides a tensor (views
        of one storage, and handles of one tensor, see it change: every handle's is worked out again)."""
        sig = (t.shape, t.stride(), t.storage_offset(), t.dtype, t.is_conj(), t.is_neg())
        interned = self._interned.get(sig)
        if interned is None:
            if len(self._interned) >= _INTERNED_MAX:
                self._interned.clear()  # (a new _Sig for a signature seen before only misses _Predicted once)
            interned = self._interned[sig] = _Sig(sig)
        self._sigs[handle] = interned
        return interned

    def _key(self, value: ArgValue, valued: bool) -> Any:
        """An argument's part of the call's signature (not a tensor's, an int's, a str's or None's: _arguments')."""
        if isinstance(value, TensorArg):
            return self._sigs.get(value.h) or self._sig(value.h, self.tensor(value.h))
        if isinstance(value, bool):  # (True == 1: add(bool_t, True) is bool, add(bool_t, 1) int64: never one entry)
            return (bool, value)
        if isinstance(value, float):
            return (float, value) if valued else float
        if isinstance(value, list):
            return tuple(v if type(v) is int or v is None else self._key(v, valued) for v in value)
        if isinstance(value, TensorListArg):
            sigs = self._sigs
            return (TensorListArg, *(None if h is None else sigs.get(h) or self._sig(h, self.tensor(h))
                                     for h in value.hs))
        if isinstance(value, Complex):
            return (complex, value.re, value.im) if valued else complex
        return value  # (a dtype, layout, memory format or device argument: hashable, compared by type and name)

    def _arguments(self, info: _OpInfo, cmd: TorchOp | TorchOpSync
                   ) -> tuple[list[Any], dict[str, Any], tuple[Any, ...]]:
        """The operator's arguments, and the call's signature: what its outputs' sizes may depend on without its
        tensors' values (_Predicted's key; the hot path: tensors and plain numbers inline)."""
        tensors = self._tensors
        sigs = self._sigs
        valued = info.valued
        key: list[Any] = [cmd.name]
        args: list[Any] = []
        for a in cmd.args:
            kind = type(a)
            if kind is TensorArg:
                h = a.h  # type: ignore[union-attr]
                t = tensors.get(h)
                if t is None:
                    raise NotFound(f"no tensor {h!r} in this session")
                args.append(t)
                key.append(sigs.get(h) or self._sig(h, t))
            elif kind is int or kind is str or a is None:
                args.append(a)
                key.append(a)
            elif kind is float:
                args.append(a)
                key.append((float, a) if valued else float)
            elif kind is bool:  # (True == 1: add(bool_t, True) is bool, add(bool_t, 1) int64: never one entry)
                args.append(a)
                key.append((bool, a))
            elif kind is list:  # (sizes, dims)
                args.append(a)
                key.append(tuple(a) if _INTS.issuperset(map(type, a))  # type: ignore[arg-type]
                           else tuple(v if type(v) is int or v is None else self._key(v, valued)
                                      for v in a))  # type: ignore[union-attr]
            elif kind is TensorListArg:  # (an optimizer's foreach operators: every parameter, at each step)
                listed: list[torch.Tensor | None] = []
                parts: list[Any] = [TensorListArg]
                for h in a.hs:  # type: ignore[union-attr]
                    if h is None:
                        listed.append(None)
                        parts.append(None)
                        continue
                    t = tensors.get(h)
                    if t is None:
                        raise NotFound(f"no tensor {h!r} in this session")
                    listed.append(t)
                    parts.append(sigs.get(h) or self._sig(h, t))
                args.append(listed)
                key.append(tuple(parts))
            else:
                args.append(self._arg(a))
                key.append(self._key(a, valued))
        kwargs: dict[str, Any] = {}
        for k, a in cmd.kwargs.items():
            kwargs[k] = self._arg(a)
            key.append(k)
            key.append(a if type(a) is int or type(a) is str or a is None else self._key(a, valued))
        if not info.guarded:
            return args, kwargs, tuple(key)
        # A device is always the worker's own, and a generator the session's: a client's string ("cuda:1") or
        # number there would reach another device or another session's numbers.
        for i in info.devices:
            if i < len(cmd.args) and not isinstance(cmd.args[i], DeviceArg | None):
                raise InvalidArgument(f"{cmd.name}: a device argument must be the torch device itself")
        for k in info.device_names.intersection(cmd.kwargs):
            if not isinstance(cmd.kwargs[k], DeviceArg | None):
                raise InvalidArgument(f"{cmd.name}: a device argument must be the torch device itself")
        for where, value in itertools.chain(enumerate(cmd.args), cmd.kwargs.items()):
            if where in info.enums and not isinstance(value, DtypeArg | LayoutArg | MemoryFormatArg | None):
                raise InvalidArgument(f"{cmd.name}: a dtype, layout or memory format argument is sent by name, not "
                                      f"as {type(value).__name__}")
        # Random operators draw from the device's default generator (TorchSeed seeds it): most random overloads
        # have no generator parameter, so one of the session's own could not serve them all.
        if info.generator >= 0 and (args[info.generator] if info.generator < len(args)
                                    else kwargs.get(info.generator_name)) is not None:
            raise InvalidArgument(f"{cmd.name}: random operators use the device's generator; pass none")
        return args, kwargs, tuple(key)

    def _run(self, info: _OpInfo, name: str, args: list[Any], kwargs: dict[str, Any],
             stream: Stream | None) -> list[Any]:
        """Run the operator; its returns, Tensor[] ones flattened."""
        try:
            with self.placement.running(stream):
                result = info.overload(*args, **kwargs)
        except GpuBrokerError:
            raise
        except Exception as exc:
            raise self._error(name, exc) from None
        if type(result) is self._tensor_type:
            return [result]
        if result is None:
            return []
        if isinstance(result, tuple | list):
            flat: list[Any] = []
            for item in result:
                if isinstance(item, tuple | list):
                    flat.extend(item)
                else:
                    flat.append(item)
            return flat
        return [result]

    def _error(self, name: str, exc: Exception) -> GpuBrokerError:
        """PyTorch's exception as the tenant's error: its class name and message, naming the operator."""
        own = self.placement.error(name, exc)
        if own is not None:
            return own
        kind = type(exc).__name__
        message = f"{name}: {kind}: {exc}"[:4096]
        if isinstance(exc, self._t.OutOfMemoryError | MemoryError) or "can't allocate memory" in str(exc):
            return ResourceExhausted(message, torch_error=kind)
        if isinstance(exc, NotImplementedError):
            return Unimplemented(message, torch_error=kind)
        return InvalidArgument(message, torch_error=kind)

    def _keep(self, name: str, outs: Sequence[tuple[str, torch.Tensor]], reserved: int) -> None:
        """Settle the accounts on the outputs' real storages (``reserved`` was charged before the run), then
        store them; past the quota, the outputs are dropped and the error names the operator."""
        keys: list[int] = []
        fresh: dict[int, int] = {}  # storages no tensor of the session uses yet -> their bytes
        storages = self._storages
        for _, t in outs:
            storage = t.untyped_storage()
            key = storage._cdata  # (the StorageImpl's address: the same for every view of one storage)
            keys.append(key)
            if key not in storages and key not in fresh:
                fresh[key] = storage.nbytes()
        new = sum(fresh.values())
        if new != reserved:
            self.accounts.unreserve(reserved)
            try:
                self.accounts.reserve(new)
            except ResourceExhausted as exc:
                raise ResourceExhausted(f"{name}: {exc.message}", **exc.details) from None
        for (handle, t), key in zip(outs, keys, strict=True):
            storage_entry = storages.get(key)
            if storage_entry is None:
                storages[key] = _Storage(fresh[key], 1)
            else:
                storage_entry.refs += 1
            self._store(handle, t, key)

    def op(self, cmd: TorchOp, stream: Stream | None = None) -> None:
        """Run a queued operator and keep its new outputs under the client's handles."""
        info = self._info(cmd.name)
        news = [h for h in cmd.outs if h is not None]
        if len(cmd.metas) != len(news):
            raise InvalidArgument(f"{cmd.name}: {len(cmd.metas)} metadata for {len(news)} new outputs")
        self._claim(news)
        args, kwargs, key = self._arguments(info, cmd)
        # What the operator makes, worked out by this worker before it runs (the client's announcement is checked
        # against what it made, after: PyTorch's own kernels may differ from its meta kernels there, as
        # native_batch_norm's do on the CPU, and the client then announces what this worker said). A client that
        # announces less than the operator makes is charged all the same, and past the quota nothing runs.
        found = self._prediction(info, cmd.name, args, kwargs, key)
        reserved = found.nbytes
        if reserved == _DATA_DEPENDENT_BYTES:  # (an operator of torch_ops.SYNC, sent queued: bounded as op_sync's)
            reserved = self._bound(info, cmd.name, args, kwargs, stream, key)
        if reserved:
            self._reserve(cmd.name, reserved)
        try:
            results = self._run(info, cmd.name, args, kwargs, stream)
            outs, relaid = self._outputs(cmd.name, cmd.outs, results, cmd.metas, stream, found)
        except BaseException:
            self.accounts.unreserve(reserved)
            raise
        self._keep(cmd.name, outs, reserved + relaid)

    def op_sync(self, cmd: TorchOpSync, stream: Stream | None = None) -> list[TensorMeta | int | float | bool | None]:
        """Run an operator whose outputs depend on the data, or that returns a value: what came out, per return.

        Nothing says beforehand what it makes (a client sends any operator this way): the bytes are bounded before
        it runs, from its inputs (``_BOUNDS``, for operators whose outputs depend on the data) or from a run on meta
        tensors, and charged; the accounts settle on what it made."""
        info = self._info(cmd.name)
        news = [h for h in cmd.outs if h is not None]
        self._claim(news)
        args, kwargs, key = self._arguments(info, cmd)
        reserved = self._bound(info, cmd.name, args, kwargs, stream, key)
        if reserved:
            self._reserve(cmd.name, reserved)
        try:
            results = self._run(info, cmd.name, args, kwargs, stream)
            outs, _ = self._outputs(cmd.name, cmd.outs, results, None, stream)
            answer: list[TensorMeta | int | float | bool | None] = []
            for item in results:
                if isinstance(item, self._t.Tensor):
                    answer.append(self.meta(item))
                elif item is None or isinstance(item, bool | int | float):
                    answer.append(item)
                else:
                    raise Unimplemented(f"{cmd.name} returned a {type(item).__name__}, which the torch device "
                                        "cannot carry back")
        except BaseException:
            self.accounts.unreserve(reserved)
            raise
        self._keep(cmd.name, outs, reserved)
        return answer

    def _reserve(self, name: str, nbytes: int) -> None:
        try:
            self.accounts.reserve(nbytes)
        except ResourceExhausted as exc:
            raise ResourceExhausted(f"{name}: {exc.message}", **exc.details) from None

    def _bound(self, info: _OpInfo, name: str, args: list[Any], kwargs: dict[str, Any],
               stream: Stream | None, key: tuple[Any, ...]) -> int:
        """The most bytes an operator sent as a TorchOpSync holds while it runs (its outputs, and its temporaries
        where they grow with its inputs), found without running it."""
        bound = _BOUNDS.get(name)
        if bound is None:
            nbytes = self._predict(info, name, args, kwargs, key)
            if nbytes == _DATA_DEPENDENT_BYTES:
                raise Unimplemented(f"{name}: what it makes is not known before it runs (PyTorch has no meta kernel "
                                    "for it, or its outputs depend on the data), so it cannot be charged to the "
                                    "memory quota first")
            return nbytes
        params: dict[str, Any] = {}
        for i, (param, has_default, default) in enumerate(info.params):
            if i < len(args):
                params[param] = args[i]
            elif param in kwargs:
                params[param] = kwargs[param]
            elif has_default:
                params[param] = default
        try:
            with self.placement.running(stream):  # (counting is the tenant's device work: timed, on its stream)
                return max(0, bound(self._t, params))
        except GpuBrokerError:
            raise
        except Exception as exc:  # (arguments the operator itself would refuse: a bad dim, a missing one)
            raise self._error(name, exc) from None

    def _meta_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of the meta device with ``t``'s dtype and layout (its conjugate and negative bits too)."""
        tm = self._t
        shape, stride, offset = t.shape, t.stride(), t.storage_offset()
        if offset:
            extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
            m = tm.empty((extent,), dtype=t.dtype, device="meta").as_strided(shape, stride, offset)
        else:
            m = tm.empty_strided(shape, stride, dtype=t.dtype, device="meta")
        if t.is_conj():
            m = m.conj()
        if t.is_neg():
            m = tm._neg_view(m)
        copy: torch.Tensor = m
        return copy

    def _predict(self, info: _OpInfo, name: str, args: list[Any], kwargs: dict[str, Any],
                 key: tuple[Any, ...]) -> int:
        """The bytes of the new storages the operator makes (_DATA_DEPENDENT_BYTES: not known before it runs), by
        the call's signature: from the session's cache, or from a run on meta copies of its inputs, kept."""
        return self._prediction(info, name, args, kwargs, key).nbytes

    def _prediction(self, info: _OpInfo, name: str, args: list[Any], kwargs: dict[str, Any],
                    key: tuple[Any, ...]) -> _Prediction:
        found = self._predicted.get(key)
        if found is None:
            nbytes, restrides = self._meta_bytes(info, name, args, kwargs)
            found = self._predicted.put(key, nbytes, restrides or info.restrides)
        if found.restrides:
            self._sigs.clear()  # (before it runs: an error after its first change must not leave a stale one)
        return found

    def _meta_bytes(self, info: _OpInfo, name: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[int, bool]:
        """The bytes of the new storages the operator makes, from a run on meta copies of its inputs (no memory;
        a return that is a view of an input takes none), _DATA_DEPENDENT_BYTES where a meta run cannot tell; and
        whether it changes the shape or strides of a tensor it writes."""
        tm = self._t
        inputs: dict[int, tuple[Any, int]] = {}  # the meta inputs' storages -> the storage and its bytes
        layouts: list[tuple[torch.Tensor, tuple[Any, ...]]] = []  # the meta inputs and their layouts

        def meta(value: Any) -> Any:
            if isinstance(value, tm.Tensor):
                m = self._meta_copy(value)
                storage = m.untyped_storage()
                inputs[storage._cdata] = (storage, storage.nbytes())
                layouts.append((m, (m.shape, m.stride(), m.storage_offset())))
                return m
            if isinstance(value, list | tuple):
                return [meta(v) for v in value]
            if isinstance(value, tm.device):
                return tm.device("meta")
            return value

        try:
            margs = [meta(a) for a in args]
            mkwargs = {k: meta(v) for k, v in kwargs.items()}
            # A factory's device when none is given is the CPU's: made for real there. Always meta.
            for i in info.devices:
                if i < len(margs):
                    margs[i] = tm.device("meta")
                else:
                    mkwargs[info.params[i][0]] = tm.device("meta")
            result = info.overload(*margs, **mkwargs)
        except Exception as exc:
            if not info.makes:
                # (it returns values, or writes its own arguments: no new storage; what it does to their layout is
                # not known, so as if it changed it)
                return 0, info.writes
            if isinstance(exc, NotImplementedError) or _DATA_DEPENDENT.search(str(exc)):
                return _DATA_DEPENDENT_BYTES, info.writes
            raise self._error(name, exc) from None
        for storage, before in inputs.values():
            if storage.nbytes() > before:  # (an in-place or out= argument resized: a storage already charged)
                raise InvalidArgument(f"{name} would grow the storage of a tensor it writes from {before} to "
                                      f"{storage.nbytes()} bytes, which the torch device cannot do: pass a "
                                      "tensor of the right shape")
        restrides = info.writes and any((m.shape, m.stride(), m.storage_offset()) != layout for m, layout in layouts)
        fresh: dict[int, int] = {}
        for item in result if isinstance(result, tuple | list) else (result,):
            for t in item if isinstance(item, tuple | list) else (item,):
                if isinstance(t, tm.Tensor):
                    storage = t.untyped_storage()
                    if storage._cdata not in inputs:
                        fresh[storage._cdata] = storage.nbytes()
        return sum(fresh.values()), restrides

    def _outputs(self, name: str, handles: Sequence[str | None], results: list[Any],
                 metas: Sequence[TensorMeta] | None, stream: Stream | None,
                 found: _Prediction | None = None) -> tuple[list[tuple[str, torch.Tensor]], int]:
        """The new outputs by handle, each checked against the metadata the client announced (``metas``), and the
        bytes reserved for outputs laid out again as announced (each charged before its copy is made). With the
        call's prediction (``found``), the outputs' signatures are kept, and used to check the next call's."""
        if len(results) != len(handles):
            raise InvalidArgument(f"{name} returned {len(results)} values; the command names {len(handles)} outputs")
        outs: list[tuple[str, torch.Tensor]] = []
        for h, item in zip(handles, results, strict=True):
            if h is None:
                continue
            if not isinstance(item, self._t.Tensor):
                raise InvalidArgument(f"{name} returned a {type(item).__name__} where the command names a tensor")
            outs.append((h, item))
        relaid = 0
        if found is not None and metas is not None and metas == found.announced:
            # The hot path: the same announcement as the last call of this signature, whose outputs matched it.
            made = found.made
            if len(made) == len(outs):
                for (_, t), m in zip(outs, made, strict=True):
                    if (t.shape, t.stride(), t.storage_offset(), t.dtype, t.is_conj(), t.is_neg()) != m.sig:
                        break
                else:
                    sigs = self._sigs
                    for (h, _), m in zip(outs, made, strict=True):
                        sigs[h] = m
                    return outs, 0
        if metas is not None:
            dtypes = self._dtypes
            try:
                for i, ((h, t), meta) in enumerate(zip(outs, metas, strict=True)):
                    dtype, shape, stride, offset = meta
                    # (tuple(): free on the decoded tuples; an in-process caller may pass lists)
                    if (t.dtype is not dtypes.get(dtype) or t.shape != tuple(shape) or t.stride() != tuple(stride)
                            or t.storage_offset() != offset):
                        fixed, extent = self._as_announced(name, t, self.meta(t), meta, stream)
                        relaid += extent
                        outs[i] = (h, fixed)
            except BaseException:
                self.accounts.unreserve(relaid)
                raise
            if found is not None and not relaid:
                found.announced = metas
                found.made = tuple(self._sig(h, t) for h, t in outs)
        return outs, relaid

    def _as_announced(self, name: str, t: torch.Tensor, actual: TensorMeta, meta: TensorMeta,
                      stream: Stream | None) -> tuple[torch.Tensor, int]:
        """An output laid out as the client announced it: a copy with its strides where only the layout differs
        (the client's views of it follow its strides); an error where the shape or dtype differ. With the bytes
        charged for the copy, before it is made (a view's announced strides may span any size)."""
        dtype, shape, stride, offset = meta
        if actual[0] != dtype or actual[1] != tuple(shape) or offset != 0:
            raise InvalidArgument(f"{name} made a {actual[0]} tensor of shape {list(actual[1])} where the client "
                                  f"worked out {dtype} {list(shape)} (offset {offset}): the client's shape "
                                  "inference disagrees with this worker's PyTorch")
        extent = self._extent(meta)
        self._reserve(name, extent)
        try:
            # (device work of the tenant's like the operator's own: timed, on the session's stream)
            with self.placement.running(stream):
                fixed: torch.Tensor = self._t.empty_strided(tuple(shape), tuple(stride), dtype=t.dtype,
                                                            device=t.device)
                fixed.copy_(t)
        except Exception as exc:
            self.accounts.unreserve(extent)
            raise self._error(name, exc) from None
        return fixed, extent

    def _extent(self, meta: TensorMeta) -> int:
        """The bytes a tensor of this metadata spans in its storage."""
        dtype, shape, stride, offset = meta
        if any(n == 0 for n in shape):
            return 0
        dt = self._dtypes.get(dtype)
        if dt is None:
            raise InvalidArgument(f"unknown torch dtype {dtype!r}")
        span = offset + 1 + sum((n - 1) * abs(s) for n, s in zip(shape, stride, strict=False))
        return int(span * dt.itemsize)

    @staticmethod
    def meta(t: torch.Tensor) -> TensorMeta:
        return (str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    # -- data ------------------------------------------------------------------------------------
    def _nbytes(self, meta: TensorMeta) -> tuple[torch.dtype, tuple[int, ...], int]:
        dtype_name, shape, _, _ = meta
        dtype = self._dtypes.get(dtype_name)
        if dtype is None:
            raise InvalidArgument(f"unknown torch dtype {dtype_name!r}")
        numel = math.prod(shape)  # (Python ints: a product of int64s wraps)
        if any(n < 0 for n in shape) or numel > 1 << 48:
            raise InvalidArgument(f"a tensor of shape {list(shape)} is too large")
        return dtype, tuple(shape), numel * dtype.itemsize

    def from_buffer(self, handle: str, buf: Buffer, meta: TensorMeta, stream: Stream | None = None) -> None:
        """A new contiguous tensor of ``meta``'s dtype and shape holding the buffer's bytes (row-major)."""
        dtype, shape, nbytes = self._nbytes(meta)
        self._claim([handle])
        try:
            self.accounts.reserve(nbytes)
        except ResourceExhausted as exc:
            raise ResourceExhausted(f"torch_from_buffer: {exc.message}", **exc.details) from None
        try:
            raw = self._on_device("torch_from_buffer", self.placement.from_buffer, buf, nbytes, stream)
            try:
                t = raw.view(dtype).reshape(shape)
            except RuntimeError as exc:
                raise InvalidArgument(f"torch_from_buffer: {exc}") from None
        except BaseException:
            self.accounts.unreserve(nbytes)
            raise
        self._keep("torch_from_buffer", [(handle, t)], nbytes)

    def _on_device(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, device work of a copy, with PyTorch's exceptions as the tenant's errors (a device-side assert
        an earlier operator queued surfaces at the copy that waits for it: the backend's fatal error, not Internal)."""
        try:
            return fn(*args)
        except GpuBrokerError:
            raise
        except Exception as exc:
            raise self._error(what, exc) from None

    def _flat_bytes(self, what: str, t: torch.Tensor) -> torch.Tensor:
        """The tensor's elements, row-major, as a contiguous uint8 tensor (a conjugate or negative view resolved)."""
        flat: torch.Tensor = self._on_device(what, self._flat, t)
        return flat

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.resolve_conj().resolve_neg().reshape(-1)
        if flat.stride() != (1,):
            # (also a one-element tensor of stride 0, which PyTorch calls contiguous but will not view as bytes)
            flat = self._t.empty_like(flat, memory_format=self._t.contiguous_format).copy_(flat)
        if flat.dtype == self._t.bool:
            flat = flat.view(self._t.uint8)
        return flat.view(self._t.uint8)

    def to_buffer(self, handle: str, buf: Buffer, stream: Stream | None = None) -> None:
        """The tensor's elements, row-major, into the buffer at its view's offset."""
        t = self.tensor(handle)
        nbytes = t.numel() * t.element_size()
        if nbytes > buf.size - buf.offset:  # (before the elements are gathered: an expanded view may be huge)
            raise OutOfRange(f"torch_to_buffer of {nbytes} bytes into a view of {buf.size - buf.offset}")
        with self.placement.running(stream):
            data = self._flat_bytes("torch_to_buffer", t)
        self._on_device("torch_to_buffer", self.placement.to_buffer, data, buf, stream)

    def read(self, handle: str, stream: Stream | None = None) -> bytes:
        """A small tensor's elements, row-major (at most MAX_TORCH_READ bytes)."""
        t = self.tensor(handle)
        nbytes = t.numel() * t.element_size()
        if nbytes > MAX_TORCH_READ:
            raise OutOfRange(f"torch_read of {nbytes} bytes: at most {MAX_TORCH_READ} are read at once; copy larger "
                             "tensors through a buffer")
        with self.placement.running(stream):
            data = self._flat_bytes("torch_read", t)
        data_bytes: bytes = self._on_device("torch_read", self.placement.host_bytes, data, stream)
        return data_bytes

    def seed(self, seed: int) -> None:
        """Seed the device's default generator, which every random operator draws from (``torch.manual_seed``'s
        part for this device). The worker serves one tenant: only its own sessions share it."""
        try:
            self.placement.generator().manual_seed(seed)
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise InvalidArgument(f"torch_seed: {exc}") from None


class _Timed:
    """Around an operator on the CPU: its time charged as device time (a plain class: cheaper to enter than a
    generator-based context manager, on every operator)."""

    __slots__ = ("_charge", "_started")

    def __init__(self, charge: Callable[[float], None]) -> None:
        self._charge = charge
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._charge(time.perf_counter() - self._started)


class _Segment:
    """Around an operator on CUDA: the backend's device-time segment open on its stream, under the timer's lock
    throughout (as run_library's). A plain class: cheaper to enter than a generator-based context manager."""

    __slots__ = ("_ptr", "_timer")

    def __init__(self, timer: Any, ptr: int) -> None:
        self._timer = timer
        self._ptr = ptr

    def __enter__(self) -> None:
        timer = self._timer
        timer.lock.acquire()
        try:
            timer.begin(self._ptr)
        except BaseException:
            timer.lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        self._timer.lock.release()


class CpuPlacement:
    """PyTorch's CPU kernels on CPU tensors, for an OpenCL backend (PoCL: the device is the host CPU). Buffers'
    bytes move with the backend's own host copies; an operator's host time is charged as device time, as a
    library operation's is."""

    def __init__(self, copy_d2h: Callable[[Buffer, Any, int, Stream | None], None],
                 copy_h2d: Callable[[Any, Buffer, int, Stream | None], None], charge: Callable[[float], None],
                 check_stream: Callable[[Stream], object]) -> None:
        self._check_stream = check_stream
        self._copy_d2h = copy_d2h
        self._copy_h2d = copy_h2d
        self._timed = _Timed(charge)
        self._torch = import_torch()

    def device(self) -> torch.device:
        device: torch.device = self._torch.device("cpu")
        return device

    def running(self, stream: Stream | None) -> AbstractContextManager[None]:
        # CPU operators run at once, in order: the stream orders nothing more here, but it must be one of the
        # backend's (NotFound otherwise, as on every other backend call).
        if stream is not None:
            self._check_stream(stream)
        return self._timed


    def from_buffer(self, buf: Buffer, nbytes: int, stream: Stream | None) -> torch.Tensor:
        host = np.empty(nbytes, dtype=np.uint8)
        if nbytes:
            self._copy_d2h(buf, host, 0, stream)  # (OutOfRange past the view: nothing read)
        t: torch.Tensor = self._torch.from_numpy(host)
        return t

    def to_buffer(self, data: torch.Tensor, buf: Buffer, stream: Stream | None) -> None:
        if data.numel():
            self._copy_h2d(data.numpy(), buf, 0, stream)

    def host_bytes(self, data: torch.Tensor, stream: Stream | None) -> bytes:
        return bytes(data.numpy().tobytes())

    def generator(self) -> torch.Generator:
        gen: torch.Generator = self._torch.default_generator
        return gen

    def freed(self, nbytes: int) -> None:
        pass  # (CPU tensors are freed with their last reference)

    def bound(self, quota: int | None) -> None:
        pass  # (host memory: the sandbox's memory limit holds the worker, kernel-enforced)

    def error(self, what: str, exc: Exception) -> GpuBrokerError | None:
        return None


# What PyTorch's caching allocator may hold past a tenant's quota (TorchCache.bound).
_ALLOCATOR_HEADROOM = 96 << 20


class TorchCache:
    """PyTorch's CUDA caching allocator on one device, shared by the backend's torch sessions (one per process).

    What tensors free stays cached for the next operators, as in eager PyTorch: emptying the cache mid-stream
    waits for the whole device (cudaFree) and makes the next operators cudaMalloc again (a ResNet forward pass took
    5x eager's time while the cache was emptied every 256 MiB freed). Its bound keeps it within the tenant's quota
    anyway: the allocator's per-process fraction is the quota plus ``_ALLOCATOR_HEADROOM`` less what the backend
    allocated otherwise (buffers, exact cudaMallocs), and the allocator meets it by giving cached blocks back
    itself when it needs room. Before the backend allocates otherwise, ``make_room`` gives back what tensors freed,
    so cached and other memory together stay within the bound whichever came first."""

    def __init__(self, index: int, total: int, others: int) -> None:
        self._index = index
        self._total = total
        self._quota: int | None = None  # (None until a torch session sets the bound, or where it has no quota)
        self._others = others  # bytes the backend allocated otherwise
        self._freed = 0  # tensor bytes freed since the last make_room
        self.stream: Any = None  # PyTorch's current stream on the device, as CudaPlacement.running last set it

    def freed(self, nbytes: int) -> None:
        self._freed += nbytes

    def bound(self, quota: int | None) -> None:
        """The tenant's quota (set again as each session starts: it may have changed)."""
        self._quota = quota
        self._apply()

    def others(self, nbytes: int) -> None:
        """The backend now holds ``nbytes`` of its own allocations on the device."""
        self._others = nbytes
        if self._quota is not None:  # (without a quota the fraction is the whole device whatever they hold)
            self._apply()

    def make_room(self) -> None:
        """The backend is about to allocate otherwise: give cached blocks freed since the last call back."""
        if self._freed:
            self._freed = 0
            cuda = import_torch().cuda
            if cuda.memory_reserved(self._index) > cuda.memory_allocated(self._index):
                cuda.empty_cache()

    def _apply(self) -> None:
        # The quota is charged from what the client announces before an operator runs, and settled on what it
        # made; a client that announces less would have the allocator take more in between. Its per-process
        # fraction bounds what it may hold at all: a tenant's worker serves that tenant alone, so this is the
        # tenant's bound. Past the quota it may hold _ALLOCATOR_HEADROOM more: its rounding (a 4 MiB tensor takes a
        # 20 MiB segment) and cuBLAS's workspace (32 MiB per stream on Hopper), which no tensor counts; without it
        # a 16 MiB quota could not run one matmul.
        quota = self._quota
        room = self._total if quota is None else quota + _ALLOCATOR_HEADROOM - self._others
        fraction = min(1.0, max(room, _ALLOCATOR_HEADROOM) / self._total)
        import_torch().cuda.set_per_process_memory_fraction(fraction, self._index)


class CudaPlacement:
    """CUDA tensors on the backend's device, each operator on the session's CuPy stream (PyTorch's
    ``ExternalStream`` over it), bracketed by the backend's device timer; buffers' bytes move through DLPack views
    of the allocations, on the stream. A CUDA error that breaks the context is the backend's to report (fatal)."""

    def __init__(self, dev: Any, cache: TorchCache) -> None:  # (dev: a CudaDevice, whose module imports CuPy)
        self._dev = dev
        self._cache = cache
        self._torch = import_torch()
        self._streams: dict[int, Any] = {}  # CuPy stream pointer -> torch.cuda.ExternalStream

    def device(self) -> torch.device:
        device: torch.device = self._torch.device("cuda", self._dev.index)
        return device

    def _stream(self, stream: Stream | None) -> tuple[Any, Any]:
        s = self._dev.stream(stream)
        ext = self._streams.get(s.ptr)
        if ext is None:
            if len(self._streams) > 1024:
                self._streams.clear()
            # The default stream (CuPy's null stream, pointer 0) is PyTorch's default stream too: both are the
            # legacy default stream; any other is the CuPy stream itself, wrapped.
            ext = self._streams[s.ptr] = (self._torch.cuda.default_stream(self.device()) if s.ptr == 0
                                          else self._torch.cuda.ExternalStream(s.ptr, device=self.device()))
        return s, ext

    def running(self, stream: Stream | None) -> AbstractContextManager[None]:
        self._dev.use()
        s, ext = self._stream(stream)
        cache = self._cache
        if cache.stream is not ext:
            # PyTorch's current stream stays the last operator's: nothing in the worker runs torch work outside
            # this, and entering and leaving torch.cuda.stream(ext) at each operator cost more than some operators.
            self._torch.cuda.set_stream(ext)
            cache.stream = ext
        return _Segment(self._dev.timer, s.ptr)

    def _view(self, buf: Buffer, nbytes: int) -> torch.Tensor:
        import cupy

        from gpubroker.wire.host import check_device_range

        mem, view = self._dev.resolve(buf)
        check_device_range(view, 0, nbytes, "torch copy")
        arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, view.offset))
        t: torch.Tensor = self._torch.from_dlpack(arr)
        return t

    def from_buffer(self, buf: Buffer, nbytes: int, stream: Stream | None) -> torch.Tensor:
        with self.running(stream):
            out: torch.Tensor = self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device())
            if nbytes:
                out.copy_(self._view(buf, nbytes))
        return out

    def to_buffer(self, data: torch.Tensor, buf: Buffer, stream: Stream | None) -> None:
        if data.numel():
            with self.running(stream):
                self._view(buf, data.numel()).copy_(data)

    def host_bytes(self, data: torch.Tensor, stream: Stream | None) -> bytes:
        with self.running(stream):
            host = data.to("cpu")  # (synchronous on the stream)
        return bytes(host.numpy().tobytes())

    def generator(self) -> torch.Generator:
        self._dev.use()
        self._torch.cuda.init()  # (the default generators exist once CUDA is initialized)
        gen: torch.Generator = self._torch.cuda.default_generators[self._dev.index]
        return gen

    def freed(self, nbytes: int) -> None:
        self._cache.freed(nbytes)

    def bound(self, quota: int | None) -> None:
        self._cache.bound(quota)

    def error(self, what: str, exc: Exception) -> GpuBrokerError | None:
        text = str(exc)
        if "CUDA error" in text or "device-side assert" in text or type(exc).__name__ == "AcceleratorError":
            err = Aborted(f"{what}: {type(exc).__name__}: {text[:2000]} (the CUDA context is now unusable)",
                          fatal=True, torch_error=type(exc).__name__)
            self._dev.fatal = err
            return err
        return None


def _stream_of(handle: str) -> Stream | None:
    return Stream(handle) if handle else None


def _handle(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"a tensor handle is a non-empty str, got {value!r:.80}")
    return value


class TorchPart:
    """An in-process backend's torch device methods (GpuCompute's ``torch_*``), on one TorchSession made at the
    first use; the backend binds them onto itself, as it does its other parts' methods."""

    def __init__(self, make: Callable[[], TorchSession]) -> None:
        self._make = make
        self._session: TorchSession | None = None
        self._lock = threading.Lock()

    def session(self) -> TorchSession:
        session = self._session
        if session is None:
            with self._lock:
                if self._session is None:
                    self._session = self._make()
                session = self._session
        return session

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def torch_op(self, op: TorchOp) -> None:
        if not isinstance(op, TorchOp):
            raise InvalidArgument(f"torch_op takes a TorchOp, got {type(op).__name__}")
        self.session().op(op, _stream_of(op.stream))

    def torch_op_sync(self, op: TorchOpSync) -> list[TensorMeta | int | float | bool | None]:
        if not isinstance(op, TorchOpSync):
            raise InvalidArgument(f"torch_op_sync takes a TorchOpSync, got {type(op).__name__}")
        return self.session().op_sync(op, _stream_of(op.stream))

    def torch_from_buffer(self, handle: str, buf: Buffer, meta: TensorMeta, stream: Stream | None = None) -> None:
        self.session().from_buffer(_handle(handle), buf, meta, stream)

    def torch_to_buffer(self, handle: str, buf: Buffer, stream: Stream | None = None) -> None:
        self.session().to_buffer(_handle(handle), buf, stream)

    def torch_read(self, handle: str, stream: Stream | None = None) -> bytes:
        return self.session().read(_handle(handle), stream)

    def torch_free(self, handles: Sequence[str]) -> None:
        self.session().free([_handle(h) for h in handles])

    def torch_seed(self, seed: int) -> None:
        if not isinstance(seed, int | np.integer) or isinstance(seed, bool):
            raise InvalidArgument(f"a seed is an int, got {type(seed).__name__}")
        self.session().seed(int(seed))
