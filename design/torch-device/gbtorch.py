"""Spike: a pure-Python `gpubroker` torch device (client half) over a FAKE in-process worker.

The client tensor (`BTensor`) is a `_make_wrapper_subclass` tensor: metadata (shape, stride, offset, dtype,
device gpubroker:0) plus a handle. Every ATen op reaching it is turned into one queued command
``("op", name, args_with_refs, kwargs_with_refs, out_handles)``; output metadata comes from a cache keyed by
(op overload, input signature), filled once by running the op on meta tensors. Only ops whose result the host
needs (item, cpu, non-Tensor returns, data-dependent shapes) flush the queue and wait.

Not the implementation: no wire encoding, no allowlist beyond a denylist stub, no error mapping.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

aten = torch.ops.aten
NAME = "gpubroker"
STATS = {"ops": 0, "miss": 0, "sync": 0, "by_op": {}}
COUNT_OPS = os.environ.get("GB_COUNT_OPS") == "1"


# ---------------------------------------------------------------- the fake worker (a dict of real tensors)
class Ref:
    """A tensor argument on the wire: the worker's handle."""

    __slots__ = ("h",)

    def __init__(self, h: int) -> None:
        self.h = h

    def __repr__(self) -> str:
        return f"Ref({self.h})"


class FakeWorker:
    """Stands in for the tenant's worker: handle -> real torch tensor (CPU here; CUDA on GPU hosts).

    Views are made by running the real view op, so a worker-side view shares its base's storage exactly as the
    client's metadata says; in-place ops mutate the real tensor that the handle names."""

    def __init__(self, device: str = "cpu") -> None:
        self.t: dict[int, torch.Tensor] = {}
        self.q: list[tuple] = []
        self.device = torch.device(device)
        self.executed = 0
        self._ops: dict[str, Any] = {}

    def submit(self, cmd: tuple) -> None:
        self.q.append(cmd)

    def flush(self) -> None:
        q, self.q = self.q, []
        for cmd in q:
            self._run(cmd)

    def call(self, cmd: tuple) -> Any:  # a synchronous command: everything queued before it runs first
        self.flush()
        return self._run(cmd)

    def _op(self, name: str):
        f = self._ops.get(name)
        if f is None:
            ns, rest = name.split("::")
            pkt, _, ovl = rest.partition(".")
            f = self._ops[name] = getattr(getattr(getattr(torch.ops, ns), pkt), ovl or "default")
        return f

    def _deref(self, x):
        if type(x) is Ref:
            return self.t[x.h]
        if type(x) is torch.device:
            return self.device
        return x

    def _run(self, cmd: tuple) -> Any:
        kind = cmd[0]
        if kind == "op":
            _, name, args, kwargs, outs = cmd
            self.executed += 1
            if any(type(a) is Ref and a.h not in self.t for a in tree_flatten((args, kwargs))[0]):
                return None  # an input poisoned by an earlier failure: outputs stay poisoned (the error is already due)
            args = tree_map(self._deref, args)
            kwargs = tree_map(self._deref, kwargs)
            res = self._op(name)(*args, **kwargs)
            flat = tree_flatten(res)[0]
            if outs is not None:
                for h, r in zip(outs, flat):
                    if h is not None:
                        self.t[h] = r
            return res
        if kind == "upload":  # (handle, cpu tensor): a Write of the bytes
            _, h, cpu = cmd
            self.t[h] = cpu.to(self.device, copy=True)
            return None
        if kind == "read":  # (handle,): the bytes of the tensor's view, as a CPU tensor
            return self.t[cmd[1]].to("cpu", copy=True)
        if kind == "free":
            self.t.pop(cmd[1], None)
            return None
        if kind == "op_sync":  # (name, args, kwargs): result values and output metadata come back
            _, name, args, kwargs, outs = cmd
            res = self._run(("op", name, args, kwargs, outs))
            meta = [
                (tuple(r.shape), r.stride(), r.storage_offset(), r.dtype) if isinstance(r, torch.Tensor) else r
                for r in tree_flatten(res)[0]
            ]
            return meta
        raise ValueError(kind)


# ---------------------------------------------------------------- the client tensor
_DEV = None  # torch.device("gpubroker", 0) once registered
_ids = itertools.count(1)
WORKER: FakeWorker | None = None


class BTensor(torch.Tensor):
    """Metadata + a worker handle; the values live in the worker."""

    _h: int
    _sig: tuple

    @staticmethod
    def __new__(cls, shape, stride, offset, dtype, h, requires_grad=False):
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, storage_offset=offset, dtype=dtype, device=_DEV, requires_grad=requires_grad
        )
        r._h = h
        r._sig = (shape, stride, offset, dtype)
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __del__(self):  # the worker's handle dies with the client tensor (the real free is queued, batched)
        w = WORKER
        if w is not None:
            w.submit(("free", self._h))

    def tolist(self):  # Tensor.tolist/numpy refuse subclasses: wait for the values, then the CPU tensor's answer
        return self.cpu().tolist()

    def numpy(self, *, force=False):
        raise TypeError("can't convert gpubroker:0 device type tensor to numpy. Use Tensor.cpu() first.")

    def __repr__(self, *, tensor_contents=None):
        return f"{self.cpu()!r}".replace(")", f", device='{_DEV}')", 1) if self.dim() else _scalar_repr(self)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        try:
            return _dispatch(func, args, kwargs or {})
        except Exception as e:
            if torch._C._current_graph_task_id() == -1:
                raise
            return _defer_in_backward(func, args, kwargs or {}, e)


# A Python exception leaving __torch_dispatch__ while the autograd engine runs a node on this device unwinds through
# ~InlineStreamGuard -> torch::acc::PythonDeviceGuard::exchangeStream (noexcept), which calls back into Python
# (type_) and std::terminate()s the process. So inside backward an error is kept as the session's deferred error
# (raised at the next waiting call, like a queued op's), and the op returns placeholders of the right metadata.
DEFERRED: list[BaseException] = []


def _defer_in_backward(func, args, kwargs, e):
    if not DEFERRED:
        DEFERRED.append(e)
    try:
        entry = _infer(func, args, kwargs)
    except Exception:
        entry = None
    if entry is None:
        return None  # a wrong return type: C++ raises a (catchable) error, the process survives
    spec, outs = entry
    res = [
        _arg(func, args, kwargs, ret[1]) if ret is not None and ret[0] == "write" else BTensor(*md, next(_ids))
        for ret, md in outs
    ]
    return tree_unflatten(res, spec) if spec is not None else None


def check_deferred():
    """What every waiting call does first: raise the first deferred error (then the session goes on)."""
    if DEFERRED:
        e = DEFERRED.pop()
        DEFERRED.clear()
        raise e


def _scalar_repr(t):
    return f"tensor({t.cpu().item()}, device='{_DEV}')"


# ---------------------------------------------------------------- signatures and the metadata cache
_CACHE: dict[tuple, Any] = {}
_SCHEMA: dict[Any, Any] = {}


def _asig(a):
    """An argument's part of the cache key: a tensor's metadata, a float's type (a float's value never changes an
    output's shape or dtype; an int's can: sizes, dims), other values as they are."""
    ta = type(a)
    if ta is BTensor:
        return a._sig
    if ta is float or ta is complex:
        return ta
    if ta is list or ta is tuple:
        return tuple(_asig(x) for x in a)
    if isinstance(a, torch.Tensor):  # a CPU tensor argument (a 0-dim scalar, a copy_ source)
        return ("cpu", tuple(a.shape), a.stride(), a.dtype, a.device.type)
    return a


def _key(func, args, kwargs):
    k = [func]
    for a in args:
        k.append(_asig(a))
    if kwargs:
        for n, v in kwargs.items():
            k.append(n)
            k.append(_asig(v))
    return tuple(k)


def _schema_info(func):
    """Per overload, once: for each returned tensor, the input argument it aliases (views: same storage) or
    writes (in-place / out=: the very argument is returned), from the schema's alias annotations."""
    info = _SCHEMA.get(func)
    if info is None:
        sch = func._schema
        arg_sets = {}
        for i, a in enumerate(sch.arguments):
            if a.alias_info is not None:
                for s in a.alias_info.before_set:
                    arg_sets[s] = (i, a.name, a.kwarg_only)
        rets = []
        for r in sch.returns:
            ai = r.alias_info
            if ai is None:
                rets.append(None)
            else:
                src = arg_sets[next(iter(ai.before_set))]
                rets.append(("write" if ai.is_write else "view", src))
        info = _SCHEMA[func] = (rets, all(str(r.type) in ("Tensor", "Tensor[]", "Tensor?", "List[Tensor]", "Optional[Tensor]") for r in sch.returns))
    return info


def _to_meta(a):
    if type(a) is BTensor:
        shape, stride, off, dt = a._sig
        n = off + sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else 0
        return torch.empty(max(n, 1), dtype=dt, device="meta").as_strided(shape, stride, off)
    if isinstance(a, torch.Tensor):
        return a if a.dim() == 0 else a.to("meta")
    if type(a) is torch.device and a.type == NAME:
        return torch.device("meta")
    return a


class _Sync(Exception):
    pass


def _infer(func, args, kwargs):
    """Cold path: output metadata from the meta kernels (None: the op needs the worker: data-dependent shape,
    non-Tensor result)."""
    STATS["miss"] += 1
    rets, all_tensor = _schema_info(func)
    if not all_tensor and func._schema.returns:
        return None
    try:
        margs = tree_map(_to_meta, args)
        mkw = tree_map(_to_meta, kwargs)
        out = func(*margs, **mkw)
    except (NotImplementedError, RuntimeError) as e:  # no meta kernel, or data-dependent output
        if "meta" in str(e).lower() or "data-dependent" in str(e).lower() or isinstance(e, NotImplementedError):
            return None
        raise
    if not func._schema.returns:  # in-place foreach ops (`_foreach_add_`) return nothing
        return (None, [])
    flat, spec = tree_flatten(out)
    outs = []
    for i, m in enumerate(flat):
        ret = rets[i] if i < len(rets) else (rets[0] if rets else None)  # Tensor[] returns share one annotation
        md = (tuple(m.shape), tuple(m.stride()), m.storage_offset(), m.dtype)
        outs.append((ret, md))
    return (spec, outs)


def _refs(x):
    if type(x) is BTensor:
        return Ref(x._h)
    return x


def _encode(args, kwargs):
    """Tensor arguments replaced by refs (the wire form); a CPU tensor travels as a value."""
    a2 = [Ref(a._h) if type(a) is BTensor else (tree_map(_refs, a) if type(a) in (list, tuple) else a) for a in args]
    k2 = {n: (Ref(v._h) if type(v) is BTensor else tree_map(_refs, v)) for n, v in kwargs.items()} if kwargs else {}
    return a2, k2


def _arg(func, args, kwargs, src):
    i, name, kwonly = src
    if not kwonly and i < len(args):
        return args[i]
    return kwargs[name]


# ---------------------------------------------------------------- special cases: host <-> device, scalars
def _fetch(t: BTensor) -> torch.Tensor:
    check_deferred()
    STATS["sync"] += 1
    return WORKER.call(("read", t._h))


def _special(func, args, kwargs):
    if func is aten._to_copy.default:
        dev = kwargs.get("device")
        src = args[0]
        if dev is not None and dev.type == "cpu":
            kw = {k: v for k, v in kwargs.items() if k != "device"}
            return aten._to_copy.default(_fetch(src), **kw) if kw else _fetch(src)
        if type(src) is not BTensor:  # CPU -> gpubroker
            return _upload(src, kwargs)
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        if type(dst) is not BTensor:  # gpubroker -> CPU
            dst.copy_(_fetch(src))
            return dst
        if type(src) is not BTensor:  # CPU -> gpubroker: upload to a temp handle, then a device copy
            tmp = next(_ids)
            WORKER.submit(("upload", tmp, src.detach().contiguous()))
            WORKER.submit(("op", "aten::copy_", [Ref(dst._h), Ref(tmp)], {}, None))
            WORKER.submit(("free", tmp))
            return dst
    if func is aten._local_scalar_dense.default:
        check_deferred()
        STATS["sync"] += 1
        return WORKER.call(("read", args[0]._h)).item()
    return NotImplemented


def _upload(src, kwargs):
    dt = kwargs.get("dtype") or src.dtype
    cpu = src.detach().to(dt).contiguous()
    h = next(_ids)
    WORKER.submit(("upload", h, cpu))
    return BTensor(tuple(cpu.shape), cpu.stride(), 0, dt, h)


# ---------------------------------------------------------------- the dispatch loop
DENY: set[str] = set(filter(None, os.environ.get("GB_DENY", "").split(",")))  # the spike's allowlist stand-in


def _dispatch(func, args, kwargs):
    if DENY and func._schema.name in DENY:
        raise NotImplementedError(f"{func._schema.name} is not supported on the {NAME} device")
    if COUNT_OPS:
        STATS["ops"] += 1
        n = func._schema.name + "." + func._overloadname
        STATS["by_op"][n] = STATS["by_op"].get(n, 0) + 1
    if func in _SPECIAL:
        r = _special(func, args, kwargs)
        if r is not NotImplemented:
            return r
    key = _key(func, args, kwargs)
    entry = _CACHE.get(key, _MISSING)
    if entry is _MISSING:
        entry = _CACHE[key] = _infer(func, args, kwargs)
    if entry is None:
        return _dispatch_sync(func, args, kwargs)
    spec, outs = entry
    res = []
    handles = []
    for ret, md in outs:
        if ret is not None and ret[0] == "write":  # in-place / out=: the argument itself
            a = _arg(func, args, kwargs, ret[1])
            res.append(a)
            handles.append(None)
        else:
            h = next(_ids)
            handles.append(h)
            res.append(BTensor(md[0], md[1], md[2], md[3], h))
    a2, k2 = _encode(args, kwargs)
    WORKER.submit(("op", _name(func), a2, k2, handles))
    return tree_unflatten(res, spec) if spec is not None else None


def _dispatch_sync(func, args, kwargs):
    """Data-dependent or non-Tensor results: wait for the worker's answer (metadata and scalars)."""
    STATS["sync"] += 1
    rets, all_tensor = _schema_info(func)
    a2, k2 = _encode(args, kwargs)
    if not all_tensor:
        res = WORKER.call(("op", _name(func), a2, k2, None))
        return res
    # The number of outputs is static per schema except Tensor[]; the spike asks the worker for metadata.
    handles = [next(_ids) for _ in range(8)]
    meta = WORKER.call(("op_sync", _name(func), a2, k2, handles))
    res = [BTensor(m[0], m[1], m[2], m[3], h) for m, h in zip(meta, handles)]
    return res[0] if len(func._schema.returns) == 1 and str(func._schema.returns[0].type) == "Tensor" else tuple(res)


_NAMES: dict[Any, str] = {}


def _name(func):
    n = _NAMES.get(func)
    if n is None:
        n = _NAMES[func] = func._schema.name + ("." + func._overloadname if func._overloadname != "default" else "")
    return n


_MISSING = object()
_SPECIAL = {aten._to_copy.default, aten.copy_.default, aten._local_scalar_dense.default}


# ---------------------------------------------------------------- factories: ops that reach PrivateUse1 without a BTensor
def _factory_fallback(op, *args, **kwargs):
    """A boxed fallback on the PrivateUse1 key: `torch.empty(..., device=dev)` and friends (randn = empty +
    normal_, zeros = empty + zero_, a CPU tensor's `.to(dev)` = empty + copy_) arrive here."""
    return _dispatch(op, args, kwargs)


# Ops that reach the PrivateUse1 key itself (no BTensor argument, or the Python key excluded, as in torch.tensor(...,
# device=dev), whose C++ copies below the Python key): explicit kernels that join the same dispatch loop.
_FACTORIES = ("empty.memory_format", "empty_strided", "resize_", "_copy_from")


def _factory_impl(func):
    def impl(*args, **kwargs):
        if func is aten._copy_from.default:  # (src, dst, non_blocking): a host -> device copy below the Python key
            return _special(aten.copy_.default, (args[1], args[0]), {})
        if func is aten.resize_.default:
            raise NotImplementedError("resize_ of a gpubroker tensor (an out= tensor of the wrong shape)")
        return _dispatch(func, args, kwargs)

    return impl


class _BackendModule:
    """`torch.gpubroker`: what PyTorch asks of a device module (device count, RNG seeding, ...)."""

    def is_initialized(self):
        return True

    def is_available(self):
        return True

    def current_device(self):
        return 0

    def device_count(self):
        return 1

    def _is_in_bad_fork(self):
        return False

    def manual_seed_all(self, seed):  # torch.manual_seed(s) calls this: the worker's generator is seeded
        if WORKER is not None:
            WORKER.submit(("op", "aten::_gb_seed", [seed], {}, None)) if False else None

    def get_amp_supported_dtype(self):
        return [torch.float16, torch.bfloat16]


_LIB = None


def setup(worker: FakeWorker | None = None) -> torch.device:
    """Register the device once per process and attach a worker."""
    global _DEV, WORKER, _LIB
    if _DEV is None:
        _setup_privateuseone_for_python_backend(NAME, backend_module=_BackendModule())
        if os.environ.get("GB_FACTORY") == "fallback":  # one boxed fallback: trips an INTERNAL ASSERT for some ops
            _LIB = torch.library.Library("_", "IMPL")
            _LIB.fallback(_factory_fallback, "PrivateUse1")
        else:  # explicit PrivateUse1 kernels for the ops that create a tensor on the device from nothing
            _LIB = torch.library.Library("aten", "IMPL")
            for op in _FACTORIES:
                _LIB.impl(op, _factory_impl(getattr(aten, op.split(".")[0]).__getattr__(
                    op.split(".")[1] if "." in op else "default")), "PrivateUse1")
        _DEV = torch.device(NAME, 0)
    # Backward on the calling thread: no pt_autograd_0 device thread, which otherwise drops Python objects after
    # the graph task ends and can race interpreter shutdown (std::terminate at exit, 2 runs in 8 here).
    # Thread-local: a thread that runs backward needs `with torch.autograd.set_multithreading_enabled(False)`.
    torch._C._set_multithreading_enabled(False)
    WORKER = worker or FakeWorker()
    return _DEV
