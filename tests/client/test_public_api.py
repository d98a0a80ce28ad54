"""What a user's tools see of the SDK: exceptions under their public module, `connect`'s typed options (py.typed, read
by mypy in a client-only virtualenv: tests/test_layout.py)."""

from __future__ import annotations

import inspect
import pickle
import traceback
from pathlib import Path

import pytest

import gpubroker.client
from gpubroker.client import CompileError, GpuBrokerError, RemoteGpu, ResourceExhausted, connect

ROOT = Path(__file__).resolve().parents[2]
ERRORS = [cls for cls in vars(gpubroker.client).values()
          if isinstance(cls, type) and issubclass(cls, GpuBrokerError)]


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_each_error_is_named_by_the_module_that_exports_it(cls: type[GpuBrokerError]) -> None:
    assert cls.__module__ == "gpubroker.client"
    assert getattr(gpubroker.client, cls.__qualname__) is cls


def test_a_traceback_and_a_pickle_show_the_public_name() -> None:
    error = CompileError("kernel.cl:3: error: expected ';'", log="kernel.cl:3: error: expected ';'")
    try:
        raise error
    except CompileError as exc:
        text = "".join(traceback.format_exception(exc))
    assert "gpubroker.client.CompileError: kernel.cl:3" in text
    assert "gpubroker.wire" not in text
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is CompileError and back.message == error.message and back.details == error.details
    quota = pickle.loads(pickle.dumps(ResourceExhausted("over quota", quota=1 << 30, used=1 << 29)))
    assert quota.details == {"quota": 1 << 30, "used": 1 << 29}
    assert repr(back).startswith("CompileError(")


def test_connect_takes_every_option_of_remote_gpu_by_name() -> None:
    """connect's keywords are RemoteGpu's (same names, defaults and types), written out so IDEs and type checkers
    see them, not hidden behind **kwargs."""
    ours = inspect.signature(connect).parameters
    theirs = inspect.signature(RemoteGpu.__init__).parameters
    assert not [p for p in ours.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert list(ours)[:3] == ["target", "token", "device"]
    for name, param in theirs.items():
        if name in ("self", "target"):
            continue
        assert name in ours, f"connect lacks RemoteGpu's {name}"
        assert ours[name].default == param.default, name
        assert ours[name].annotation == param.annotation, name

