"""The client tensor and the dispatch loop: each ATen operator on a gpubroker tensor becomes one TorchOp.

PyTorch's Python dispatch key sits below Autograd and above the device: autograd, ``nn.Module``, the optimizers,
views and version counters all run in PyTorch's own code, and only ATen operators reach ``__torch_dispatch__``. A
client tensor (``BTensor``, a wrapper subclass with no storage) holds metadata and its handle; the worker holds the
real tensor under that handle. Each operator is looked up by (overload, input signature) in ``_meta``'s cache for
its outputs' metadata, given handles chosen here, and queued; only what needs a value on the host waits.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import numpy as np
import torch

from gpubroker.client.torch._meta import (
    SYNC,
    Entry,
    OpInfo,
    Out,
    Refused,
    Sig,
    Source,
    infer,
    meta_tensor,
    op_info,
    signature,
    wire_sig,
)
from gpubroker.client.torch._session import DISAGREEING, DTYPES, Session, new_handle, on_disagreement
from gpubroker.wire import torch_ops
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

__all__ = ["SESSIONS", "BTensor", "defer", "dispatch", "session_of_device"]

aten = torch.ops.aten
NAME: Final = "gpubroker"

# The process's devices: gpubroker:<i> is SESSIONS[i] (PrivateUse1 has one backend name per process, so each
# GpuCompute is a device index of it, as CUDA's GPUs are cuda:0, cuda:1).
SESSIONS: list[Session] = []


class BTensor(torch.Tensor):
    """A tensor whose elements live in a session's worker: metadata, the session, and its handle there."""

    _h: str
    _s: Session
    _sig: Sig
    _ref: TensorArg

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, session: Session, sig: Sig, handle: str) -> BTensor:
        shape, stride, offset, dtype = sig
        t: BTensor = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, storage_offset=offset, dtype=dtype, device=session.device)
        t._h = handle
        t._s = session
        t._sig = sig
        t._ref = TensorArg(handle)
        return t

    def __init__(self, session: Session, sig: Sig, handle: str) -> None:
        pass  # all done in __new__ (torch.Tensor's own __init__ takes no such arguments)

    def __del__(self) -> None:
        # Only an append: a finalizer runs at any point, even inside another command's dispatch.
        try:
            self._s.dead.append(self._h)
        except AttributeError:  # __new__ did not finish
            pass

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (),  # type: ignore[override]
                           kwargs: dict[str, Any] | None = None) -> Any:
        try:
            return dispatch(func, args, kwargs or {})
        except Exception as exc:
            # While the autograd engine runs a node, an exception leaving here unwinds through a noexcept device
            # guard frame that calls back into Python: the process aborts. Keep it for the next wait instead.
            if torch._C._current_graph_task_id() == -1:
                raise
            return defer(func, args, kwargs or {}, exc)

    def tolist(self) -> Any:
        """The elements as (nested) Python numbers: waits for them, like CUDA's."""
        return fetch(self).tolist()

    def __format__(self, format_spec: str) -> str:
        # Tensor.__format__ formats a 0-dim tensor's value only for plain Tensors (f"{loss:.4f}" must work here too)
        if self.dim() == 0:
            return format(self.detach().item(), format_spec)
        return object.__format__(self, format_spec)

    def numpy(self, *, force: bool = False) -> Any:
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A wrapper has no storage to pickle: torch.save would write an empty shell. Refused rather than saving a
        # CPU copy, which would load back on another device than it was saved from.
        raise RuntimeError(f"cannot pickle (torch.save, copy.copy) a {self.device} tensor: its elements live in "
                           "the broker. Save the CPU copy: torch.save(t.cpu(), f) or "
                           "torch.save(model.to('cpu').state_dict(), f)")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        text = repr(fetch(self))
        end = len(text) - 1
        for suffix in (", size=(", ", dtype=torch."):
            at = text.find(suffix)
            if at != -1:
                end = min(end, at)
        text = f"{text[:end]}, device='{self.device}'{text[end:]}"
        if self.grad_fn is not None:
            text = f"{text[:-1]}, grad_fn=<{type(self.grad_fn).__name__}>)"
        elif self.requires_grad:
            text = f"{text[:-1]}, requires_grad=True)"
        return text


def fetch(t: BTensor) -> torch.Tensor:
    """A CPU copy of the tensor's elements (waits), with its strides where they are dense, as ``.cpu()`` keeps
    them (a transposed tensor's copy is transposed too)."""
    shape, stride, _, dtype = t._sig
    cpu = t._s.read(t._h, shape, dtype)
    if cpu.stride() != stride and _dense(shape, stride):
        cpu = torch.empty_strided(shape, stride, dtype=dtype).copy_(cpu)
    return cpu


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether the strides lay the elements out with no gap and no overlap (in some order of the dims)."""
    expected = 1
    for size, step in sorted(((size, step) for size, step in zip(shape, stride, strict=True) if size != 1),
                             key=lambda pair: pair[1]):
        if step != expected:
            return False
        expected *= size
    return True


# ---------------------------------------------------------------- argument encoding
_DTYPES: dict[torch.dtype, DtypeArg] = {dt: DtypeArg(name) for name, dt in DTYPES.items()}
_DEVICE_ARG: Final = DeviceArg()
_INTS: Final = frozenset({int})  # (a list of these alone is its own cache key part and wire value)
_CPU_INDEX_OK: Final = frozenset({  # operators whose index tensors may be CPU tensors, as on CUDA
    "aten::index.Tensor", "aten::_unsafe_index.Tensor", "aten::index_put.default", "aten::index_put_.default",
    "aten::_index_put_impl_.default", "aten::_unsafe_index_put.default"})


class _Walk:
    """What encoding the arguments found besides the wire form: the sessions named, CPU tensors to upload."""

    __slots__ = ("sessions", "uploads")

    def __init__(self) -> None:
        self.sessions: list[Session] = []
        self.uploads: list[tuple[str, torch.Tensor]] = []


def session_of_device(device: torch.device) -> Session:
    index = 0 if device.index is None else device.index
    if not 0 <= index < len(SESSIONS):
        raise RuntimeError(f"{device} is not a device of this process: a gpubroker device comes from "
                           "gpubroker.client.torch.device(gpu)")
    return SESSIONS[index]


def _encode_other(value: Any, walk: _Walk) -> tuple[Any, Any]:
    """(cache key part, wire value) of an argument that is not a client tensor, an int, a float or a str."""
    kind = type(value)
    if kind is list or kind is tuple:
        if any(isinstance(v, torch.Tensor) for v in value):  # Tensor[] / Tensor?[]
            keys: list[Any] = []
            handles: list[str | None] = []
            for v in value:
                if v is None:
                    keys.append(None)
                    handles.append(None)
                elif type(v) is BTensor:
                    walk.sessions.append(v._s)
                    keys.append(v._sig)
                    handles.append(v._h)
                else:
                    k, w = _encode_other(v, walk)
                    keys.append(k)
                    handles.append(w.h)
            return ("list", *keys), TensorListArg(handles)
        return tuple(type(v) if type(v) is float else v for v in value), list(value)
    if isinstance(value, torch.dtype):
        return value, _DTYPES[value]
    if isinstance(value, torch.device):
        if value.type != NAME:
            raise RuntimeError(f"an operator on a {NAME} tensor cannot make a {value} tensor; use .to('{value}') "
                               "on its result")
        walk.sessions.append(session_of_device(value))
        return value, _DEVICE_ARG
    if isinstance(value, torch.layout):
        return value, LayoutArg(str(value).removeprefix("torch."))
    if isinstance(value, torch.memory_format):
        return value, MemoryFormatArg(str(value).removeprefix("torch."))
    if kind is complex:
        return complex, Complex(value.real, value.imag)
    if isinstance(value, torch.Tensor):  # a CPU tensor: uploaded as a tensor of the session for this operator
        if value.device.type != "cpu":
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{value.device} and {NAME}!")
        handle = new_handle()
        walk.uploads.append((handle, value))
        return ("cpu", tuple(value.shape), value.stride(), value.dtype), TensorArg(handle)
    if isinstance(value, torch.Generator):  # the worker's own generator for its device (seeded by manual_seed)
        return None, None
    # Numbers of other types (NumPy's, an IntEnum): as the Python number they stand for.
    if isinstance(value, (bool, np.bool_)):
        return bool(value), bool(value)
    if hasattr(value, "__index__"):
        number = int(value.__index__())
        return number, number
    if isinstance(value, numbers.Real):
        return float, float(value)
    raise NotImplementedError(f"an argument of type {kind.__name__} cannot be sent to the {NAME} device")


def _mixed(a: Session, b: Session) -> RuntimeError:
    return RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                        f"{a.device} and {b.device}!")


def _encode(args: Sequence[Any], kwargs: dict[str, Any]
            ) -> tuple[Session | None, list[Any], list[Any], dict[str, Any], _Walk | None]:
    """The session, the cache key's parts, and the wire arguments of a call (the hot path: plain types inline)."""
    sess: Session | None = None
    key: list[Any] = []
    wargs: list[Any] = []
    walk: _Walk | None = None
    for a in args:
        kind = type(a)
        if kind is BTensor:
            s = a._s
            if s is not sess:
                if sess is not None:
                    raise _mixed(sess, s)
                sess = s
            key.append(a._sig)
            wargs.append(a._ref)
        elif kind is float:
            key.append(float)
            wargs.append(a)
        elif kind is int or kind is bool or a is None or kind is str:
            key.append(a)
            wargs.append(a)
        elif (kind is list or kind is tuple) and _INTS.issuperset(map(type, a)):  # sizes, strides, dims
            key.append(tuple(a))
            wargs.append(a if kind is list else list(a))
        else:
            if walk is None:
                walk = _Walk()
            k, w = _encode_other(a, walk)
            key.append(k)
            wargs.append(w)
    wkwargs: dict[str, Any] = {}
    for name, a in kwargs.items():
        kind = type(a)
        key.append(name)
        if kind is BTensor:
            s = a._s
            if s is not sess:
                if sess is not None:
                    raise _mixed(sess, s)
                sess = s
            key.append(a._sig)
            wkwargs[name] = a._ref
        elif kind is float:
            key.append(float)
            wkwargs[name] = a
        elif kind is int or kind is bool or a is None or kind is str:
            key.append(a)
            wkwargs[name] = a
        elif (kind is list or kind is tuple) and _INTS.issuperset(map(type, a)):
            key.append(tuple(a))
            wkwargs[name] = a if kind is list else list(a)
        else:
            if walk is None:
                walk = _Walk()
            k, w = _encode_other(a, walk)
            key.append(k)
            if w is not None:  # a generator: left to the worker's
                wkwargs[name] = w
    if walk is not None:
        for s in walk.sessions:
            if sess is None:
                sess = s
            elif s is not sess:
                raise _mixed(sess, s)
    return sess, key, wargs, wkwargs, walk


# ---------------------------------------------------------------- shape inference (cold path)
_CACHE: dict[tuple[Any, ...], Entry] = {}
MAX_CACHE: Final = 1 << 16  # entries (a training loop uses about 100)
on_disagreement.append(_CACHE.clear)


def _to_meta(value: Any) -> Any:
    kind = type(value)
    if kind is BTensor:
        return meta_tensor(value._sig)
    if kind is list or kind is tuple:
        return kind(_to_meta(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value if value.dim() == 0 else value.to("meta")
    if isinstance(value, torch.device) and value.type == NAME:
        return torch.device("meta")
    if isinstance(value, torch.Generator):
        return None
    return value


def _arg(args: Sequence[Any], kwargs: dict[str, Any], source: Source) -> Any:
    index, name, kwarg_only = source
    if not kwarg_only and index < len(args):
        return args[index]
    return kwargs[name]


def _entry(info: OpInfo, args: Sequence[Any], kwargs: dict[str, Any]) -> Entry:
    if info.name in torch_ops.SYNC:
        return SYNC

    def sig_of(source: Source) -> Sig | None:
        arg = _arg(args, kwargs, source)
        return arg._sig if type(arg) is BTensor else None

    margs = [_to_meta(a) for a in args]
    mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    entry = infer(info, margs, mkwargs, sig_of)
    if entry is not SYNC and (info.name in LEARN_FROM_WORKER or info.name in DISAGREEING):
        return Entry(entry.outs, entry.counts, entry.mutates, learn=True)
    return entry


def _restride(t: BTensor, sig: Sig) -> None:
    """Apply an in-place view operator (t_, squeeze_, ...) to the client tensor's own metadata."""
    with torch._C._DisableTorchDispatch():
        aten.as_strided_.default(t, sig[0], sig[1], sig[2])
    t._sig = sig


def _result(counts: list[int], values: list[Any]) -> Any:
    if counts == [-1]:
        return values[0]
    if not counts:
        return None
    out: list[Any] = []
    at = 0
    for n in counts:
        if n < 0:
            out.append(values[at])
            at += 1
        else:
            out.append(values[at:at + n])
            at += n
    return tuple(out) if len(counts) > 1 else out[0]


# ---------------------------------------------------------------- the dispatch loop
_INFOS: dict[Any, OpInfo] = {}
_LAZY: Final = frozenset({"aten::empty.memory_format", "aten::empty_strided.default"})


def _floats(values: Sequence[Any]) -> tuple[float, ...]:
    """The float values among arguments (and in their lists), for an operator whose shapes they decide."""
    found: list[float] = []
    for v in values:
        if type(v) is float:
            found.append(v)
        elif type(v) in (list, tuple):
            found.extend(_floats(v))
    return tuple(found)


def _info(func: Any) -> OpInfo:
    info = _INFOS.get(func)
    if info is None:
        info = _INFOS[func] = op_info(func)
        info.special = _SPECIAL.get(func)
        if info.special is None and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), "CompositeImplicitAutograd"):
            # Reaches the Python key only where autograd is off (inference_mode): PyTorch's own decomposition
            # into the operators it is made of, as on any device.
            info.special = functools.partial(_decompose, func)
    return info


def _decompose(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    result = func.decompose(*args, **kwargs)
    if result is NotImplemented:
        return _ordinary(_info(func), args, kwargs)
    return result


def dispatch(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Run one ATen operator on the session of its tensors (or of its device argument)."""
    info = _INFOS.get(func)  # (an OpOverload's hash is Python code: one lookup per operator, by its OpInfo after)
    if info is None:
        info = _info(func)
    special = info.special
    if special is not None:
        return special(args, kwargs)
    return _ordinary(info, args, kwargs)


def _ordinary(info: OpInfo, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if info.name not in torch_ops.ALLOWED:
        raise NotImplementedError(f"{info.name} is not supported on the {NAME} device (it is not on the allowlist, "
                                  "gpubroker.wire.torch_ops)")
    sess, key, wargs, wkwargs, walk = _encode(args, kwargs)
    if sess is None:
        raise RuntimeError(f"{info.name}: no {NAME} tensor or device among its arguments")
    if walk is not None and walk.uploads:
        if info.name not in _CPU_INDEX_OK and any(cpu.dim() for _, cpu in walk.uploads):
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{sess.device} and cpu! ({info.name})")
        try:
            for handle, cpu in walk.uploads:
                sess.upload(handle, cpu)
            return _run(sess, info, args, kwargs, key, wargs, wkwargs)
        finally:  # the uploaded CPU arguments: dropped once their operator is sent (frees go after it)
            sess.dead.extend(handle for handle, _ in walk.uploads)
    return _run(sess, info, args, kwargs, key, wargs, wkwargs)


def _run(sess: Session, info: OpInfo, args: Sequence[Any], kwargs: dict[str, Any], key: list[Any],
         wargs: list[Any], wkwargs: dict[str, Any]) -> Any:
    """The encoded call, by its cache entry: queued, waited for, or learned from the worker."""
    if info.float_shaped:
        key.append(_floats((*args, *kwargs.values())))
    cache_key = (info, *key)
    entry = _CACHE.get(cache_key)
    if entry is None:
        if len(_CACHE) >= MAX_CACHE:  # shapes that never repeat (inference over varying lengths): start over
            _CACHE.clear()
        try:
            entry = _CACHE[cache_key] = _entry(info, args, kwargs)
        except Refused:
            raise
        except Exception:
            # The meta kernel refused the call (shapes that do not broadcast, a bad dim): the worker's PyTorch
            # runs it and says why in its own words, at the call (one wait, on this error path only).
            entry = SYNC
    if entry is SYNC:
        return _dispatch_sync(sess, info, args, kwargs, wargs, wkwargs)
    if entry.learn:
        return _learn(sess, info, entry, args, kwargs, wargs, wkwargs, cache_key)
    return _dispatch_queued(sess, info, entry, args, kwargs, wargs, wkwargs)


def _dispatch_queued(sess: Session, info: OpInfo, entry: Entry, args: Sequence[Any], kwargs: dict[str, Any],
                     wargs: list[Any], wkwargs: dict[str, Any]) -> Any:
    outs: list[str | None] = []
    metas = []
    values: list[Any] = []
    for source, sig, meta in entry.outs:
        if source is None:
            if sig is None:  # an undefined tensor
                values.append(None)
                outs.append(None)
                continue
            handle = new_handle()
            values.append(BTensor(sess, sig, handle))
            outs.append(handle)
            metas.append(cast(TensorMeta, meta))
        else:
            values.append(_arg(args, kwargs, source))
            outs.append(None)
    if entry.mutates is not None:
        _restride(values[0], entry.mutates)
    op = TorchOp(info.name, wargs, wkwargs, outs, metas)
    if sess.poisoned and _uses_poisoned(sess, wargs, wkwargs):
        sess.poisoned.update(h for h in outs if h is not None)  # skipped: its inputs were never made
    elif info.name in _LAZY:
        sess.pending[cast(str, outs[0])] = op
    else:
        sess.submit(op)
    return _result(entry.counts, values)


# Operators whose outputs' shapes differ between devices' kernels where the meta kernel cannot know which device
# runs them: native_batch_norm in eval mode returns empty saved statistics on the CPU, full ones on CUDA and meta;
# _embedding_bag an empty offset2bag on the CPU in some modes. The first call of each signature waits for the
# worker's answer, which the cache keeps.
LEARN_FROM_WORKER: Final = frozenset({"aten::native_batch_norm.default",
                                      "aten::_native_batch_norm_legit_no_training.default",
                                      "aten::_native_batch_norm_legit.default",
                                      "aten::_native_batch_norm_legit.no_stats",
                                      "aten::_embedding_bag.default",
                                      "aten::_embedding_bag_forward_only.default"})


def _learn(sess: Session, info: OpInfo, entry: Entry, args: Sequence[Any], kwargs: dict[str, Any],
           wargs: list[Any], wkwargs: dict[str, Any], cache_key: tuple[Any, ...]) -> Any:
    """Run the operator once waiting, and cache the outputs' metadata the worker's PyTorch made."""
    outs: list[str | None] = [new_handle() if source is None else None for source, _, _ in entry.outs]
    result = sess.op_sync(TorchOpSync(info.name, wargs, wkwargs, outs))
    learned: list[Out] = []
    values: list[Any] = []
    for (source, sig, meta), handle, got in zip(entry.outs, outs, result, strict=True):
        if handle is None:
            learned.append((source, sig, meta))
            values.append(_arg(args, kwargs, cast(Source, source)))
        elif got is None:
            learned.append((None, None, None))
            values.append(None)
        else:
            dtype, shape, stride, offset = got
            real: Sig = (tuple(shape), tuple(stride), offset, DTYPES[dtype])
            learned.append((None, real, wire_sig(real)))
            values.append(BTensor(sess, real, handle))
    _CACHE[cache_key] = Entry(learned, entry.counts, entry.mutates)
    return _result(entry.counts, values)


def _uses_poisoned(sess: Session, wargs: list[Any], wkwargs: dict[str, Any]) -> bool:
    for w in (*wargs, *wkwargs.values()):
        if (type(w) is TensorArg and w.h in sess.poisoned) or (
                type(w) is TensorListArg and any(h in sess.poisoned for h in w.hs)):
            return True
    return False


def _dispatch_sync(sess: Session, info: OpInfo, args: Sequence[Any], kwargs: dict[str, Any], wargs: list[Any],
                   wkwargs: dict[str, Any]) -> Any:
    """An operator whose outputs depend on the data or which returns a value: the worker says what came out."""
    outs: list[str | None] = []
    for kind, source in zip(info.returns, info.sources, strict=True):
        if kind == "l":
            raise NotImplementedError(f"{info.name}: a data-dependent list of tensors is not supported on the "
                                      f"{NAME} device")
        outs.append(new_handle() if kind == "t" and source is None else None)
    if sess.poisoned and _uses_poisoned(sess, wargs, wkwargs):
        sess.before_wait()  # raises the error that poisoned them, if not raised yet
        raise RuntimeError(f"{info.name}: an input has no value: the operator that made it failed earlier")
    result = sess.op_sync(TorchOpSync(info.name, wargs, wkwargs, outs))
    values: list[Any] = []
    for handle, value, source in zip(outs, result, info.sources, strict=True):
        if source is not None:
            values.append(_arg(args, kwargs, source))
        elif handle is not None and value is not None:
            name, shape, stride, offset = value
            values.append(BTensor(sess, (tuple(shape), tuple(stride), offset, DTYPES[name]), handle))
        else:
            values.append(value)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# ---------------------------------------------------------------- errors inside backward
def _session_in(args: Sequence[Any], kwargs: dict[str, Any]) -> Session | None:
    for a in (*args, *kwargs.values()):
        if type(a) is BTensor:
            return a._s
        if isinstance(a, torch.device) and a.type == NAME:
            return session_of_device(a)
        if type(a) in (list, tuple):
            found = _session_in(a, {})
            if found is not None:
                return found
    return None


def defer(func: Any, args: Sequence[Any], kwargs: dict[str, Any], exc: Exception) -> Any:
    """Inside backward: keep ``exc`` as the session's error for its next wait, and return placeholders of the
    right metadata (never made in the worker: operators that use them are skipped), or None where even their
    metadata is unknown (PyTorch then raises an error of its own, which it can propagate)."""
    try:
        sess = _session_in(args, kwargs)
        if sess is None:
            return None
        if sess.deferred is None:
            sess.deferred = exc
        info = _info(func)
        entry = _entry(info, args, kwargs)
        if entry is SYNC:
            return None
        values: list[Any] = []
        for source, sig, _ in entry.outs:
            if sig is None:
                values.append(None)
            elif source is None:
                handle = new_handle()
                sess.poisoned.add(handle)
                values.append(BTensor(sess, sig, handle))
            else:
                values.append(_arg(args, kwargs, source))
        return _result(entry.counts, values)
    except Exception:
        return None


# ---------------------------------------------------------------- operators handled here
def _to_copy(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    src = args[0]
    device = kwargs.get("device")
    if type(src) is BTensor and device is not None and (device.type != NAME or session_of_device(device) is not src._s):
        cpu = fetch(src)
        rest = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking") and v is not None}
        if rest:
            cpu = aten._to_copy.default(cpu, **rest)
        if device.type == NAME:
            return _upload(session_of_device(device), cpu)
        return cpu if device.type == "cpu" else cpu.to(device)
    return _ordinary(_info(aten._to_copy.default), args, kwargs)


def _upload(sess: Session, cpu: torch.Tensor) -> BTensor:
    handle = new_handle()
    sess.upload(handle, cpu)
    return BTensor(sess, signature(cpu.contiguous()), handle)


def _copy(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    dst, src = args[0], args[1]
    if type(dst) is not BTensor:  # gpubroker -> CPU
        dst.copy_(fetch(src))
        return dst
    sess = dst._s
    if type(src) is BTensor and src._s is sess:
        return _ordinary(_info(aten.copy_.default), args, kwargs)
    cpu = fetch(src) if type(src) is BTensor else src.detach()
    if cpu.device.type != "cpu":
        cpu = cpu.cpu()
    shape, stride, offset, dtype = dst._sig
    if dst._h in sess.pending and tuple(cpu.shape) == shape and offset == 0 and stride == signature(
            torch.empty(shape, device="meta"))[1]:
        # A fresh empty tensor filled whole (x.to(dev), torch.tensor(..., device=dev)): made from the bytes.
        del sess.pending[dst._h]
        sess.upload(dst._h, cpu.to(dtype))
        return dst
    handle = new_handle()
    sess.upload(handle, cpu)
    tmp = BTensor(sess, signature(cpu.contiguous()), handle)
    return _ordinary(_info(aten.copy_.default), (dst, tmp, *args[2:]), kwargs)


def _copy_from(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # _copy_from(self, dst, non_blocking): a copy below the Python key (torch.tensor(data, device=dev))
    return _copy((args[1], args[0]), {})


def _local_scalar_dense(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return fetch(args[0]).item()


def _refuse(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    raise NotImplementedError(f"resizing a {NAME} tensor in place (resize_, set_, an out= tensor of another "
                              "shape) is not supported: a client tensor's metadata cannot grow its storage")


_SPECIAL: dict[Any, Callable[[Sequence[Any], dict[str, Any]], Any]] = {
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy,
    aten._copy_from.default: _copy_from,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.resize_.default: _refuse,
    aten.resize_as_.default: _refuse,
    aten.set_.source_Storage: _refuse,
    aten.set_.source_Storage_storage_offset: _refuse,
    aten.set_.source_Tensor: _refuse,
    aten.set_.default: _refuse,
}
