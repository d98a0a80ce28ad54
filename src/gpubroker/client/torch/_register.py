"""The ``gpubroker`` device in PyTorch: PrivateUse1 renamed, its device guard, hooks and device module, and the
few kernels on the PrivateUse1 key itself, registered once per process.

Why each piece (measured in design/torch-device/DESIGN.md, section 1):

- the device guard: the autograd engine asks for the device's guard; without one it throws inside a C++ thread
  and the process aborts. ``_setup_privateuseone_for_python_backend`` registers it, with the hooks and
  ``torch.gpubroker`` (this module's ``DeviceModule``);
- kernels on PrivateUse1 for the operators that reach the device with no client tensor among their arguments
  (``torch.empty(..., device=dev)`` and every factory built on it, and the copy below the Python key of
  ``torch.tensor(data, device=dev)``); they join the same dispatch loop;
- backward on the calling thread (``set_multithreading_enabled(False)``, thread-local, set by ``device()``):
  the engine's device thread otherwise drops Python objects after the graph task and can race interpreter
  shutdown (an abort at exit, 2 runs in 8).
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpubroker.client.torch._session import Session
from gpubroker.client.torch._tensor import NAME, SESSIONS, BTensor, defer, dispatch, session_of_device
from gpubroker.wire import torch_ops
from gpubroker.wire.compute import GpuCompute

__all__ = ["DeviceModule", "register", "session_for"]

aten = torch.ops.aten
_lock = threading.Lock()
_registered = False
_library: Any = None  # the torch.library.Library holding the PrivateUse1 kernels (kept alive)


class DeviceModule:
    """``torch.gpubroker``: what PyTorch asks of a device's module (device count, seeding, synchronize)."""

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        """The devices made so far by ``gpubroker.client.torch.device`` (one per GpuCompute), at least 1."""
        return max(1, len(SESSIONS))

    def manual_seed(self, seed: int) -> None:
        """Seed ``gpubroker:0``'s generator (in its worker)."""
        if SESSIONS:
            SESSIONS[0].seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device's generator; ``torch.manual_seed`` calls this."""
        for sess in SESSIONS:
            try:
                sess.seed(int(seed))
            except Exception:  # a closed session: its device has nothing left to seed
                continue

    def synchronize(self, device: torch.device | int | None = None) -> None:
        """Wait for the device's queued operators (all devices' with None); raises their deferred errors."""
        if device is None:
            for sess in SESSIONS:
                sess.synchronize()
            return
        index = device if isinstance(device, int) else device.index
        session_of_device(torch.device(NAME, index)).synchronize()

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        """None: autocast's casting kernels are not registered for the device, so ``torch.autocast("gpubroker")``
        disables itself with PyTorch's warning (ops run in their inputs' dtypes) instead of failing every op."""
        return []


def _kernel(func: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        try:
            return dispatch(func, args, kwargs)
        except Exception as exc:  # as in BTensor.__torch_dispatch__: never out of a backward node
            if torch._C._current_graph_task_id() == -1:
                raise
            return defer(func, args, kwargs, exc)

    return kernel


# Operators that reach the PrivateUse1 key with no client tensor (so not through __torch_dispatch__).
_KERNELS: Sequence[tuple[str, Any]] = (
    ("empty.memory_format", aten.empty.memory_format),
    ("empty_strided", aten.empty_strided.default),
    ("_copy_from", aten._copy_from.default),
    ("resize_", aten.resize_.default),
)


def _factories() -> list[tuple[str, Any]]:
    """The allowlisted factories (no tensor argument, a device argument): one operator each on the device, where
    PyTorch's composite kernels would make an empty tensor and then fill it, or resize an out= tensor
    (``arange``, ``linspace``, ``eye``), which a client tensor cannot do."""
    found = []
    for name in sorted(torch_ops.ALLOWED):
        namespace, op, overload = torch_ops.split_name(name)
        func = getattr(getattr(getattr(torch.ops, namespace), op, None), overload, None)
        if func is None or name in ("aten::empty.memory_format", "aten::empty_strided.default"):
            continue
        schema = func._schema
        if (any("Tensor" in str(arg.type) for arg in schema.arguments)
                or not any(arg.name == "device" for arg in schema.arguments)
                or [str(ret.type) for ret in schema.returns] != ["Tensor"]):
            continue
        found.append((f"{op}.{overload}" if overload != "default" else op, func))
    return found


def register() -> None:
    """Make the ``gpubroker`` device known to PyTorch (once per process)."""
    global _registered, _library
    with _lock:
        if _registered:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", NAME):
            raise RuntimeError(f"PyTorch's PrivateUse1 device is already {current!r} in this process: the {NAME} "
                               "device needs it (one PrivateUse1 backend per process)")
        local = torch.accelerator.current_accelerator()
        _setup_privateuseone_for_python_backend(NAME, backend_module=DeviceModule())
        if local is not None:
            # PyTorch takes a registered PrivateUse1 backend for the process's accelerator, before CUDA; its
            # autograd engine then finds no stream for a CUDA node and fails an internal assert.
            warnings.warn(f"the {NAME} device is now PyTorch's accelerator in this process, in place of "
                          f"{local.type}: backward over local {local.type} tensors fails inside PyTorch from now on "
                          "(pytorch/pytorch#161129); run local training in another process", RuntimeWarning,
                          stacklevel=4)
        library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
        for name, func in (*_KERNELS, *_factories()):
            library.impl(name, _kernel(func), "PrivateUse1")  # type: ignore[no-untyped-call]
        _library = library
        _foreach_for_device_tensors()
        _registered = True


def _foreach_for_device_tensors() -> None:
    """torch.optim's optimizers and ``clip_grad_norm_`` pick their foreach (multi-tensor) forms by default only for
    tensors whose type is in these lists, and the device's tensors are a Python subclass: without this each step
    of AdamW ran a dozen operators per parameter (about 1,000 for a 6-layer GPT) where eager CUDA runs a few
    dozen. The lists are PyTorch's private module attributes: where a version lacks one, the default stays."""
    for name in ("torch.optim.optimizer", "torch.utils._foreach_utils"):
        module = importlib.import_module(name)
        supported = getattr(module, "_foreach_supported_types", None)
        if isinstance(supported, list) and BTensor not in supported:
            supported.append(BTensor)


def session_for(gpu: GpuCompute) -> Session:
    """The session (device index) of ``gpu``: the same one each time for the same object."""
    register()
    with _lock:
        for sess in SESSIONS:
            if sess.gpu is gpu:
                return sess
        sess = Session(gpu, len(SESSIONS))
        SESSIONS.append(sess)
    # As CUDA applies a torch.manual_seed made before its first use: the new device's generator starts from the
    # process's seed (PyTorch's fixed default if none was set).
    sess.seed(torch.initial_seed())
    return sess
