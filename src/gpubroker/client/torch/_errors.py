"""The worker's torch errors, raised as the PyTorch exception classes PyTorch itself raises."""

from __future__ import annotations

from typing import Final

import torch

from gpubroker.wire.errors import GpuBrokerError

__all__ = ["TORCH_ERROR_DETAIL", "as_torch_error"]

# The detail a worker's error carries when PyTorch raised it: the exception class's name ("IndexError").
TORCH_ERROR_DETAIL: Final = "torch_error"

# The classes an operator may raise, by name. A name the worker sends that is not here (a class of a newer torch)
# becomes RuntimeError, the class every ATen error derives from in Python unless it says otherwise.
_CLASSES: Final[dict[str, type[Exception]]] = {
    "RuntimeError": RuntimeError,
    "IndexError": IndexError,
    "ValueError": ValueError,
    "TypeError": TypeError,
    "NotImplementedError": NotImplementedError,
    "OverflowError": OverflowError,
    "ZeroDivisionError": ZeroDivisionError,
    "OutOfMemoryError": torch.OutOfMemoryError,
    "LinAlgError": torch.linalg.LinAlgError,  # type: ignore[attr-defined]
}
_accelerator_error = getattr(torch, "AcceleratorError", None)  # a device-side assert on CUDA (torch >= 2.8)
if isinstance(_accelerator_error, type) and issubclass(_accelerator_error, Exception):
    _CLASSES["AcceleratorError"] = _accelerator_error


def as_torch_error(exc: GpuBrokerError) -> Exception | None:
    """The PyTorch exception for a worker's error that PyTorch raised (None for the broker's own errors, such as
    ResourceExhausted past the quota, which stay GpuBrokerErrors).

    The message is PyTorch's, led by the operator that raised it where the worker's message does not name it
    already; the GpuBrokerError (its details: the command's sequence number, ...) is kept as ``__cause__``.
    """
    name = exc.details.get(TORCH_ERROR_DETAIL)
    if name is None and exc.details.get("cuda_error") is not None and exc.details.get("fatal"):
        # A CUDA error that broke the worker's context (a device-side assert a queued operator hit), found by a
        # wait that is not an operator's (synchronize): PyTorch raises AcceleratorError for it, so this does too.
        name = "AcceleratorError"
    if not isinstance(name, str):
        return None
    cls = _CLASSES.get(name, RuntimeError)
    message = exc.message.replace(f"{name}: ", "", 1)  # the class is the exception's own, not its text
    command = exc.details.get("command")
    if isinstance(command, str) and command not in message:
        message = f"{command}: {message}"
    if exc.details.get("fatal"):
        message += ("; the worker restarts with a fresh context and this device's tensors are gone: connect again "
                    "and make a new device")
    return cls(message)
