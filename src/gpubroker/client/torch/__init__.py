"""``gpubroker.client.torch``: a PyTorch device whose operators run in the tenant's worker.

```python
import torch
import gpubroker.client.torch as gbtorch

dev = gbtorch.device(gpu)                 # gpu: a RemoteGpu (connect(...)) or an in-process backend
model = torch.nn.Linear(32, 10).to(dev)
loss = model(torch.randn(8, 32, device=dev)).square().mean()
loss.backward()
print(loss.item())
```

Tensors on the device report ``device(type='gpubroker', index=i)``; their elements live in the worker, which runs
each ATen operator with the real PyTorch (CUDA on GPU hosts, PyTorch's CPU kernels on PoCL). The client works out
every output's shape, strides and dtype itself (cached per operator and input signature), so operators are queued:
only what needs a value on the host waits (``.item()``, ``.cpu()``, ``.tolist()``, ``print``, ``bool(t)``, and
operators whose output shape depends on the data: ``nonzero``, ``unique``, ``masked_select``, boolean indexing).

**Errors** are PyTorch's: an operator the worker's PyTorch refuses raises the same exception class with PyTorch's
message naming the operator, at the call when the call waits, else at the next waiting call (a shape mismatch
is found on the client, at the call). An operator outside the allowlist (``gpubroker.wire.torch_ops``) raises
``NotImplementedError`` naming it, before anything is sent. The broker's own errors (``ResourceExhausted`` past
the memory quota, ``DeadlineExceeded`` past the kernel time limit, ...) stay ``GpuBrokerError``s.

**Devices.** Each GpuCompute is one device index (``gpubroker:0``, ``gpubroker:1``, ...: PyTorch allows one
renamed backend per process); an operator mixing tensors of two devices raises RuntimeError, as cuda:0 and cuda:1
do; ``t.to(other_dev)`` copies through the host.

**Not supported**: ``torch.compile``, custom operators, ``resize_``/``set_`` and out= tensors of the wrong shape
(NotImplementedError), explicit ``torch.Generator`` objects (the worker's generator is used: seed it with
``torch.manual_seed``), ``t.numpy()`` (TypeError, as on CUDA: use ``t.cpu().numpy()``), pickling a device tensor
(``torch.save(t)`` raises: save ``t.cpu()`` or ``model.to('cpu').state_dict()``). ``data_ptr()`` is 0. Local CUDA
training in the same process: the device becomes PyTorch's accelerator in CUDA's place, and backward over local
``cuda`` tensors then fails inside PyTorch (pytorch/pytorch#161129; ``device()`` warns): run it in another process.

**Threads.** Backward runs on the calling thread: ``device()`` turns PyTorch's multithreaded backward off for the
thread that calls it (the setting is per thread); another thread that runs backward on the device must do so
inside ``with torch.autograd.set_multithreading_enabled(False):``.
"""

from __future__ import annotations

import torch

from gpubroker.client.torch._register import register, session_for
from gpubroker.client.torch._tensor import SESSIONS
from gpubroker.wire.compute import GpuCompute

__all__ = ["device", "synchronize"]


def device(gpu: GpuCompute) -> torch.device:
    """The PyTorch device of a GpuCompute: its tensors live in ``gpu``'s session, its operators run there.

    The first call registers the ``gpubroker`` device with PyTorch (once per process). The same ``gpu`` gives the
    same device each time; another ``gpu`` (another session) gives the next index.

    Args:
        gpu: A [`RemoteGpu`][gpubroker.client.RemoteGpu] or an in-process backend (any GpuCompute with the torch
            methods), initialized.

    Returns:
        `torch.device("gpubroker", i)`, for `.to(dev)`, `device=dev`, `model.to(dev)`.

    Raises:
        TypeError: `gpu` is not a GpuCompute with the torch methods (`torch_op`, ...).
        RuntimeError: another PyTorch backend already took PyTorch's PrivateUse1 device in this process.
    """
    if not callable(getattr(gpu, "torch_op", None)):
        raise TypeError(f"gpubroker.client.torch.device takes a GpuCompute (a RemoteGpu or an in-process backend), "
                        f"got {type(gpu).__name__}")
    register()
    sess = session_for(gpu)
    # Backward on this thread (see _register): per thread, so set by each thread that makes a device.
    torch._C._set_multithreading_enabled(False)
    return sess.device


def synchronize(dev: torch.device) -> None:
    """Wait until the device's queued operators are done; raises their deferred error, if any (as PyTorch would
    have). ``torch.gpubroker.synchronize(dev)`` does the same."""
    index = 0 if dev.index is None else dev.index
    if dev.type != "gpubroker" or not 0 <= index < len(SESSIONS):
        raise ValueError(f"{dev} is not a gpubroker device of this process")
    SESSIONS[index].synchronize()
