"""The client's value types, argument checks and error translation, without a broker."""

from __future__ import annotations

import numpy as np
import pytest

from gpubroker.client import (
    ArgumentTypeError,
    Buffer,
    CompileError,
    GpuBrokerError,
    InvalidArgument,
    NotFound,
    OutOfRange,
    WorkerCrashed,
)
from gpubroker.wire.errors import error_from_wire
from gpubroker.wire.host import check_device_range, readable_bytes, writable_bytes
from gpubroker.wire.types import check_kernel_args, normalize_dims


def test_normalize_dims() -> None:
    assert normalize_dims(5, "grid") == (5, 1, 1)
    assert normalize_dims((2, 3), "grid") == (2, 3, 1)
    assert normalize_dims([np.int64(2), 3, 4], "block") == (2, 3, 4)
    for bad in (0, (1, 0), (1, 2, 3, 4), (), "12", 1.5, (True,)):
        with pytest.raises(InvalidArgument):
            normalize_dims(bad, "grid")  # type: ignore[arg-type]


def test_kernel_args_refuse_bare_python_numbers() -> None:
    buf = Buffer("buf_x", 16)
    assert check_kernel_args([buf, np.float32(1), np.int64(2)]) == [buf, np.float32(1), np.int64(2)]
    for bad in (1, 1.0, True, "x", None, np.bool_(True), np.complex64(1)):
        with pytest.raises(ArgumentTypeError) as info:
            check_kernel_args([bad])
        assert isinstance(info.value, TypeError) and isinstance(info.value, GpuBrokerError)
    with pytest.raises(ArgumentTypeError):
        check_kernel_args(buf)  # type: ignore[arg-type]


def test_buffer_views() -> None:
    buf = Buffer("buf_x", 100)
    view = buf.at(10).at(20)
    assert view.offset == 30 and view.nbytes == 70 and view.handle == "buf_x"
    assert buf.at(100).nbytes == 0
    with pytest.raises(InvalidArgument):
        buf.at(101)
    with pytest.raises(InvalidArgument):
        buf.at(-1)


def test_device_range_checks() -> None:
    buf = Buffer("buf_x", 100, offset=10)
    assert check_device_range(buf, 5, 85) == 15
    with pytest.raises(OutOfRange):
        check_device_range(buf, 5, 86)
    with pytest.raises(InvalidArgument):
        check_device_range(buf, -1, 1)


def test_host_buffers() -> None:
    assert readable_bytes(np.arange(4, dtype=np.float32)).nbytes == 16
    assert readable_bytes(b"abc").nbytes == 3
    with pytest.raises(InvalidArgument, match="read-only"):
        writable_bytes(b"abc")
    with pytest.raises(InvalidArgument, match="contiguous"):
        readable_bytes(np.arange(10)[::2])
    with pytest.raises(InvalidArgument):
        readable_bytes(42)


def test_errors_survive_the_wire() -> None:
    err = CompileError("bad source", log="line 1: error")
    back = error_from_wire(**{k: v for k, v in err.to_wire().items() if k != "type"}, type_name="CompileError")
    assert isinstance(back, CompileError) and back.log == "line 1: error" and back.code == "INVALID_ARGUMENT"
    assert type(error_from_wire("NOT_FOUND", "gone")) is NotFound
    assert isinstance(error_from_wire("ABORTED", "died", "WorkerCrashed"), WorkerCrashed)
    # A type name that does not match its code falls back to the code's class.
    assert type(error_from_wire("NOT_FOUND", "x", "CompileError")) is NotFound
    assert type(error_from_wire("WHATEVER", "x")) is GpuBrokerError
