"""Driver-API calls CuPy does not wrap, made through ctypes on libcuda.so.1.

Everything here is best-effort: a missing library or symbol (an older driver) makes the call
return None, and the caller carries on without the extra check or detail.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_void_p
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # CFuncPtr is the base of every foreign function; ctypes re-exports these only under private names.
    from _ctypes import CFuncPtr, _Pointer, _SimpleCData

__all__ = ["DriverExtras", "driver_extras"]

_SUCCESS = 0
_INVALID_VALUE = 1
# CUDA 12.1+ allows 32764 bytes of kernel parameters, so never more parameters than that.
_MAX_PARAMS = 32764


class DriverExtras:
    """cuFuncGetParamInfo, module enumeration and a context-free cuMemGetInfo (CUDA >= 12.4)."""

    def __init__(self) -> None:
        try:
            self._lib: ctypes.CDLL | None = ctypes.CDLL("libcuda.so.1")
        except OSError:
            self._lib = None
        self._param_info = self._fn("cuFuncGetParamInfo", c_void_p, c_size_t, POINTER(c_size_t), POINTER(c_size_t))
        self._func_count = self._fn("cuModuleGetFunctionCount", POINTER(c_uint), c_void_p)
        self._enum_funcs = self._fn("cuModuleEnumerateFunctions", POINTER(c_void_p), c_uint, c_void_p)
        self._func_name = self._fn("cuFuncGetName", POINTER(c_char_p), c_void_p)
        self._init = self._fn("cuInit", c_uint)
        self._device_get = self._fn("cuDeviceGet", POINTER(c_int), c_int)
        self._ctx_state = self._fn("cuDevicePrimaryCtxGetState", c_int, POINTER(c_uint), POINTER(c_int))
        self._ctx_retain = self._fn("cuDevicePrimaryCtxRetain", POINTER(c_void_p), c_int)
        self._ctx_release = self._fn("cuDevicePrimaryCtxRelease_v2", c_int)
        self._ctx_push = self._fn("cuCtxPushCurrent_v2", c_void_p)
        self._ctx_pop = self._fn("cuCtxPopCurrent_v2", POINTER(c_void_p))
        self._mem_info = self._fn("cuMemGetInfo_v2", POINTER(c_size_t), POINTER(c_size_t))

    def _fn(self, name: str, *argtypes: type[_SimpleCData[Any] | _Pointer[Any]]) -> CFuncPtr | None:
        if self._lib is None:
            return None
        try:
            fn: CFuncPtr = getattr(self._lib, name)
        except AttributeError:
            return None
        fn.argtypes = list(argtypes)
        fn.restype = c_int
        return fn

    def param_sizes(self, func_ptr: int) -> list[int] | None:
        """The byte size of each parameter of a CUfunction, or None when the driver cannot say."""
        if self._param_info is None:
            return None
        offset, size = c_size_t(), c_size_t()
        sizes: list[int] = []
        for index in range(_MAX_PARAMS + 1):
            rc = self._param_info(c_void_p(func_ptr), index, byref(offset), byref(size))
            if rc == _INVALID_VALUE:  # one past the last parameter
                return sizes
            if rc != _SUCCESS:
                return None
            sizes.append(size.value)
        return None

    def function_names(self, module_ptr: int) -> tuple[str, ...]:
        """Names of the kernels in a CUmodule (mangled for C++ kernels); () when unavailable."""
        if self._func_count is None or self._enum_funcs is None or self._func_name is None:
            return ()
        count = c_uint()
        if self._func_count(byref(count), c_void_p(module_ptr)) != _SUCCESS or count.value == 0:
            return ()
        funcs = (c_void_p * count.value)()
        if self._enum_funcs(funcs, count.value, c_void_p(module_ptr)) != _SUCCESS:
            return ()
        names = []
        for func in funcs:
            name = c_char_p()
            if self._func_name(byref(name), func) != _SUCCESS or name.value is None:
                return ()
            names.append(name.value.decode("utf-8", "replace"))
        return tuple(sorted(names))

    def primary_context_active(self, ordinal: int) -> bool | None:
        if self._ctx_state is None or self._init is None or self._device_get is None:
            return None
        dev, flags, active = c_int(), c_uint(), c_int()
        if (self._init(0) != _SUCCESS or self._device_get(byref(dev), ordinal) != _SUCCESS
                or self._ctx_state(dev, byref(flags), byref(active)) != _SUCCESS):
            return None
        return bool(active.value)

    def free_memory_transient(self, ordinal: int) -> int | None:
        """cuMemGetInfo in a primary context retained only for the call.

        Listing devices must not leave a ~500 MiB context behind on every GPU it looked at: when
        nothing else in the process holds the context, releasing it here destroys it again.
        """
        # Locals, one None test each: that is what lets the type checker see every call below is not None.
        init, device_get, ctx_retain = self._init, self._device_get, self._ctx_retain
        ctx_release, ctx_push, ctx_pop, mem_info = self._ctx_release, self._ctx_push, self._ctx_pop, self._mem_info
        if (device_get is None or ctx_retain is None or ctx_release is None or ctx_push is None or ctx_pop is None
                or mem_info is None or init is None or init(0) != _SUCCESS):
            return None
        dev, ctx, popped = c_int(), c_void_p(), c_void_p()
        if device_get(byref(dev), ordinal) != _SUCCESS:
            return None
        if ctx_retain(byref(ctx), dev) != _SUCCESS:
            return None
        try:
            if ctx_push(ctx) != _SUCCESS:
                return None
            try:
                free, total = c_size_t(), c_size_t()
                if mem_info(byref(free), byref(total)) != _SUCCESS:
                    return None
                return free.value
            finally:
                ctx_pop(byref(popped))
        finally:
            ctx_release(dev)


_EXTRAS: DriverExtras | None = None


def driver_extras() -> DriverExtras:
    """One DriverExtras per process, made on first use."""
    global _EXTRAS
    if _EXTRAS is None:
        _EXTRAS = DriverExtras()
    return _EXTRAS
