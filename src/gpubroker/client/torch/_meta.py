"""Output metadata without a round trip: operators run on meta tensors, once per (overload, input signature).

A signature (``Sig``) is what a tensor's outputs can depend on without its values: shape, strides, storage offset
and dtype. The cache key of a call is the overload and, per argument, a tensor's signature, a float's or complex's
type only (a value never changes an output's shape, and a learning rate must not miss the cache) and any other
value as it is. An entry says, per output, either "the argument itself" (in-place and out= operators return their
argument: schema annotation ``Tensor(a!)``) or the new tensor's signature. Operators whose outputs depend on the
data (``nonzero``) or that return plain values need the worker: their entry is SYNC.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from gpubroker.client.torch._session import dtype_name
from gpubroker.wire.torch import TensorMeta

__all__ = ["SYNC", "Entry", "OpInfo", "Out", "Refused", "Sig", "Source", "infer", "meta_tensor", "op_info",
           "signature", "wire_sig"]


class Refused(NotImplementedError):
    """A call the device cannot make whatever the worker says (an out= tensor it would have to resize)."""

Sig = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype]
Source = tuple[int, str, bool]  # an argument: its position, name, and whether it is keyword-only


class OpInfo:
    """What the dispatch loop needs of one overload, read once from its schema."""

    __slots__ = ("float_shaped", "func", "name", "returns", "sources", "special", "tensor_returns")

    def __init__(self, func: torch._ops.OpOverload) -> None:
        schema = func._schema
        self.func = func
        self.name: str = f"{schema.name}.{schema.overload_name or 'default'}"  # wire.torch_ops' form
        sets: dict[str, Source] = {}
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                for alias_set in arg.alias_info.before_set:
                    sets[alias_set] = (i, arg.name, arg.kwarg_only)
        # Per return: the argument it is (an in-place or out= return), or None for a new tensor (views included:
        # the worker makes a view's real tensor by running the view operator, so storage sharing is its own).
        self.sources: list[Source | None] = []
        # Per return: "t" a Tensor, "l" a Tensor[] (flattened into the outputs), "" anything else.
        self.returns: list[str] = []
        for ret in schema.returns:
            alias = ret.alias_info
            self.sources.append(sets.get(next(iter(alias.before_set))) if alias is not None and alias.is_write
                                else None)
            kind = str(ret.type)
            self.returns.append("t" if kind == "Tensor" else "l" if kind in ("List[Tensor]", "Tensor[]") else "")
        self.tensor_returns = all(self.returns)
        self.special: Callable[[Sequence[Any], dict[str, Any]], Any] | None = None  # handled by the client itself
        # Whether a float argument's value decides the output's shape (arange's end and step, upsampling's scale
        # factors): then the cache key holds the floats' values, not only their type.
        self.float_shaped = self.name.startswith(("aten::arange.", "aten::range.")) or (
            "upsample" in self.name and self.name.endswith(".vec"))


_INFOS: dict[Any, OpInfo] = {}


def op_info(func: torch._ops.OpOverload) -> OpInfo:
    info = _INFOS.get(func)
    if info is None:
        info = _INFOS[func] = OpInfo(func)
    return info


# An output: (the argument returned, None, None) for an in-place or out= return; (None, its signature, its wire
# metadata) for a new tensor; (None, None, None) for an undefined tensor (None in Python).
Out = tuple[Source | None, Sig | None, TensorMeta | None]


class Entry:
    """A cached call: per output (returns flattened), the argument returned or a new tensor's signature."""

    __slots__ = ("counts", "learn", "mutates", "outs")

    def __init__(self, outs: list[Out], counts: list[int],
                 mutates: Sig | None, *, learn: bool = False) -> None:
        self.outs = outs
        self.learn = learn  # ask the worker what comes out, once (its kernels may disagree with the meta kernel)
        self.counts = counts  # per return: -1 a Tensor, n a Tensor[] of n
        self.mutates = mutates  # an in-place view operator's (t_, squeeze_, ...) new signature of its argument


SYNC: Final = Entry([], [], None)  # the worker must say what comes out

# In-place operators that change their argument's shape or strides (not its storage): applied to the client
# tensor's metadata too. Any other in-place or out= operator whose argument would change shape (resizing an out=
# tensor, resize_, set_) is refused: a client tensor's metadata cannot grow its storage.
META_MUTATING: Final = frozenset({
    "aten::t_.default", "aten::transpose_.default", "aten::swapdims_.default", "aten::swapaxes_.default",
    "aten::squeeze_.default", "aten::squeeze_.dim", "aten::squeeze_.dims", "aten::unsqueeze_.default",
    "aten::as_strided_.default"})


def meta_tensor(sig: Sig) -> torch.Tensor:
    """A meta tensor with exactly this signature (a view of a storage large enough for it)."""
    shape, stride, offset, dtype = sig
    extent = offset + sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) + 1 if all(shape) else 0
    return torch.empty(max(extent, 1), dtype=dtype, device="meta").as_strided(shape, stride, offset)


def signature(t: torch.Tensor) -> Sig:
    return (tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)


def wire_sig(sig: Sig) -> TensorMeta:
    return (dtype_name(sig[3]), sig[0], sig[1], sig[2])


def _data_dependent(exc: Exception) -> bool:
    """Whether a meta kernel refused because the output needs the values (or it has no meta kernel)."""
    if isinstance(exc, NotImplementedError):
        return True
    text = str(exc)
    return any(s in text for s in ("data-dependent", "data dependent", "meta tensor", "Meta tensor", "'Meta'",
                                   "meta backend", "Meta backend", "DynamicOutputShape", "item()"))


def infer(info: OpInfo, args: Sequence[Any], kwargs: dict[str, Any],
          sig_of: Callable[[Source], Sig | None]) -> Entry:
    """Run the operator on meta tensors (``args``, ``kwargs`` already converted) to learn its outputs.

    ``sig_of`` gives the signature of the client tensor an in-place return names (None if it is none). Raises
    what the meta kernel raises for a call that is wrong on its face (shapes that do not broadcast, a bad dim):
    PyTorch's own error, at the call.
    """
    if not info.tensor_returns:
        return SYNC
    try:
        out = info.func(*args, **kwargs)
    except Exception as exc:
        if _data_dependent(exc):
            return SYNC
        raise
    flat: list[torch.Tensor | None] = []
    counts: list[int] = []
    if len(info.returns) == 1:
        out = (out,)
    if not info.returns:
        out = ()
    for kind, value in zip(info.returns, out, strict=True):
        if kind == "t":
            if value is not None and not isinstance(value, torch.Tensor):
                return SYNC
            flat.append(value)  # None: an undefined tensor (convolution_backward's gradients not asked for)
            counts.append(-1)
        else:
            flat.extend(value)
            counts.append(len(value))
    sources = info.sources
    outs: list[Out] = []
    mutates: Sig | None = None
    for i, t in enumerate(flat):
        source = sources[i] if i < len(sources) else (sources[0] if sources else None)  # a Tensor[] return's
        if t is None:
            outs.append((None, None, None))
            continue
        sig = signature(t)
        if source is not None:
            before = sig_of(source)
            if before is not None and before[:3] != sig[:3]:
                if info.name not in META_MUTATING:
                    raise Refused(
                        f"{info.name} would resize or restride its output tensor on the gpubroker device, which "
                        "it cannot do: pass an out= tensor of the right shape, or use the operator's result")
                mutates = sig
        outs.append((source, sig, wire_sig(sig)))
    return Entry(outs, counts, mutates)
