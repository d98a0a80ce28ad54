"""The namespace object: every function of the standard, bound to one device session.

``namespace(gpu)`` returns the one Namespace of that GpuCompute (made on first use). What it holds is listed in
``_standard``. Functions that take arrays are the modules' plain functions (the device comes from their arrays);
functions that make arrays from nothing (creation functions, ``from_dlpack``, ``__array_namespace_info__``) take
the Context as their first parameter, named ``ctx``, and are bound to this namespace's (``types.MethodType``:
their signatures read as the standard's).

This module is the top of the package's import order: it also installs the array object's operators
(``_array.install_operators``), which are functions of the modules above ``_array``.
"""

from __future__ import annotations

import inspect
import threading
import types
from typing import Any

from gpubroker.client import GpuCompute
from gpubroker.client.array import _elementwise, _indexing, _linear, _standard
from gpubroker.client.array._array import Operators, install_operators
from gpubroker.client.array._context import Context

__all__ = ["Namespace", "namespace", "namespace_of", "release_memory"]

API_VERSION = "2024.12"

_lock = threading.Lock()


def _bind(ctx: Context, fn: Any) -> Any:
    if inspect.isfunction(fn):
        params = list(inspect.signature(fn).parameters)
        if params and params[0] == "ctx":
            return types.MethodType(fn, ctx)
    return fn


class _Sub(types.SimpleNamespace):
    pass


class Namespace(types.SimpleNamespace):
    """``xp``: the standard's functions and constants for one device session.

    Made by [`namespace`][gpubroker.client.array.namespace], one per session. Its attributes are the Python
    Array API standard's (version `__array_api_version__`, 2024.12), bound to the session's device:

    - data types (`xp.float32`, ... are NumPy dtype objects), `can_cast`, `result_type`, `finfo`, `iinfo`,
      `isdtype`, and the constants `e`, `inf`, `nan`, `newaxis`, `pi`;
    - creation functions (`asarray` uploads a NumPy array, `zeros`, `arange`, `linspace`, `eye`, `meshgrid`,
      `from_dlpack`, ...);
    - elementwise functions, reductions and statistics, manipulation, indexing (`take`, `take_along_axis`),
      searching, sorting, set functions, `matmul`, `tensordot`, `vecdot`, cumulative sums and products, `all`,
      `any`, `diff`;
    - the `linalg` and `fft` extensions, as `xp.linalg` and `xp.fft`;
    - `__array_namespace_info__()`, whose `dtypes()` leaves out what the device lacks (float64 on some OpenCL
      devices).

    Elementwise functions and reductions run as kernels generated for the device; `matmul`, `linalg`, `fft`,
    sorting and set functions run as library operations in the worker
    ([`run_library`][gpubroker.client.GpuCompute.run_library]). Namespaces compare and hash by identity.
    """

    __array_api_version__ = API_VERSION

    # Identity, as a module's: SimpleNamespace compares attributes and so is unhashable, but libraries keep
    # namespaces in sets and caches (array-api-extra's is_numpy_namespace, which scikit-learn's GaussianNB
    # reaches), and two sessions' namespaces are never the same one.
    def __hash__(self) -> int:  # type: ignore[override]  # (SimpleNamespace declares itself unhashable)
        return object.__hash__(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._ctx = ctx
        # What tools that report on namespaces print (array-api-tests, array-api-compat's messages).
        self.__name__ = "gpubroker.client.array"
        for name in _standard.__all__:
            setattr(self, name, _bind(ctx, getattr(_standard, name)))
        for sub, (module, names) in _standard.EXTENSIONS.items():
            setattr(self, sub, _Sub(**{n: _bind(ctx, getattr(module, n)) for n in names}))

    def __repr__(self) -> str:
        return f"<Array API namespace on {self._ctx.info_name}>"


def namespace_of(ctx: Context, api_version: str | None = None) -> Namespace:
    if api_version is not None and api_version not in ("2021.12", "2022.12", "2023.12", API_VERSION):
        raise ValueError(f"api_version {api_version!r} is not supported (this namespace is {API_VERSION})")
    return namespace(ctx.gpu)


def namespace(gpu: GpuCompute) -> Namespace:
    """The Array API namespace whose arrays live on ``gpu`` (a RemoteGpu or an in-process backend); one per gpu.

    On a RemoteGpu, connect with ``async_commands=True``: array operations then queue as commands and only host
    conversions and data-dependent shapes wait for the device.

    ```python
    xp = gpubroker.client.array.namespace(gpu)
    x = xp.reshape(xp.asarray(np.arange(6, dtype=np.float32)), (2, 3))
    print(np.asarray(xp.sum(x * 2, axis=1)))  # [ 6. 24.]
    ```

    Args:
        gpu: Any [GpuCompute][gpubroker.client.GpuCompute]: a session from `connect`, or an in-process backend.

    Returns:
        The session's namespace: the same object at every call for one `gpu`, and the one every array of the
            session answers `__array_namespace__()` with.
    """
    # Kept on the gpu object itself: the namespace lives as long as its session, and every array of the session
    # answers __array_namespace__ with this same object (array-api-compat refuses arrays of two namespaces).
    with _lock:
        ns = getattr(gpu, "_array_namespace", None)
        if ns is None:
            ns = Namespace(Context(gpu))
            gpu._array_namespace = ns  # type: ignore[attr-defined]
        return ns


def release_memory(gpu: GpuCompute) -> None:
    """Free now the device buffers that the namespace of ``gpu`` keeps pooled for reuse.

    Dead arrays' buffers go to a per-session pool (at most 256 MiB and a quarter of the tenant's quota) so that a
    loop of same-shaped operations allocates nothing; the pool counts against the quota. The memory of live
    arrays stays. Does nothing when ``gpu`` has no namespace yet.

    Args:
        gpu: the session whose namespace's pool to empty.

    Raises:
        GpuBrokerError: what freeing raises (see [GpuCompute.free_memory][gpubroker.client.GpuCompute.free_memory]);
            on a session with `async_commands` the frees are queued and their errors come at the next wait.
    """
    ns = getattr(gpu, "_array_namespace", None)
    if ns is not None:
        ns._ctx.release_memory()


install_operators(Operators(
    binary=_elementwise.binary, inplace=_elementwise.inplace, inplace_result=_elementwise.inplace_result,
    negative=_elementwise.negative, positive=_elementwise.positive, abs=_elementwise.abs,
    bitwise_invert=_elementwise.bitwise_invert, matmul=_linear.matmul, getitem=_indexing.getitem,
    setitem=_indexing.setitem, namespace=namespace_of,
))
