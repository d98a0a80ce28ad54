"""What makes backward() abort on a wrapper-subclass device, and what fixes it.

    python repro_abort.py MODE      MODE in: rename | rename+guard | rename+hooks | full | full-raise | full-nomt | full-raise-nomt | rename-nomt | full-badshape | full-retnone
Each mode registers a different subset of what `_setup_privateuseone_for_python_backend` does, then runs
(a * 2).sum().backward() on a gpubroker:0 wrapper tensor.
"""
import sys
import torch
from torch.utils._pytree import tree_map
import torch.utils.backend_registration as br

MODE = sys.argv[1] if len(sys.argv) > 1 else "full"
torch.utils.rename_privateuse1_backend("gpubroker")
if MODE.startswith("full") or "guard" in MODE:
    torch._C._acc.register_python_privateuseone_device_guard(br._DummyDeviceGuard())
if MODE.startswith("full") or "hooks" in MODE:
    torch._C._acc.register_python_privateuseone_hook(br._DummyPrivateUse1Hook())
if MODE.startswith("full"):
    torch.utils.generate_methods_for_privateuse1_backend()
    torch._register_device_module("gpubroker", br._DummyBackendModule())


class T(torch.Tensor):
    @staticmethod
    def __new__(cls, real):
        r = torch.Tensor._make_wrapper_subclass(cls, real.shape, strides=real.stride(), dtype=real.dtype,
                                                device="gpubroker:0", requires_grad=real.requires_grad)
        r._r = real
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if "raise" in MODE and func is torch.ops.aten.mul.Tensor and torch.is_grad_enabled() is False:
            raise RuntimeError("an op failing inside backward")
        if "retnone" in MODE and func is torch.ops.aten.mul.Tensor and torch.is_grad_enabled() is False:
            return None  # what C++ makes of a wrong return (a C++ error or a Python one?)
        if "badshape" in MODE and func is torch.ops.aten.mul.Tensor and torch.is_grad_enabled() is False:
            return T(torch.zeros(5))  # a C++ error (validate_outputs), no Python exception in flight
        un = lambda x: x._r if isinstance(x, T) else x
        out = func(*tree_map(un, args), **tree_map(un, kwargs or {}))
        return tree_map(lambda x: T(x) if isinstance(x, torch.Tensor) else x, out)


a = T(torch.randn(3)).requires_grad_()
print(MODE, a.device, flush=True)
try:
    if "nomt" in MODE:
        with torch.autograd.set_multithreading_enabled(False):
            (a * 2).sum().backward()
    else:
        (a * 2).sum().backward()
    print(MODE, "backward ok", a.grad.device, flush=True)
except Exception as e:
    print(MODE, "backward raised", type(e).__name__, str(e).splitlines()[0][:150], flush=True)
