"""The client's value types, argument checks and error translation, without a broker."""

from __future__ import annotations

import msgspec
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
from gpubroker.wire.commands import encode
from gpubroker.wire.errors import Internal, WireError, decode_wire_error, error_from_wire
from gpubroker.wire.host import address_of, check_device_range, readable_bytes, writable_bytes
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
    back = error_from_wire(decode_wire_error(encode(err.as_wire())))
    assert isinstance(back, CompileError) and back.log == "line 1: error" and back.code == "INVALID_ARGUMENT"
    assert msgspec.structs.asdict(err.as_wire()) == {"code": "INVALID_ARGUMENT", "message": "bad source",
                                                     "type": "CompileError", "details": {"log": "line 1: error"}}
    assert type(error_from_wire(WireError("NOT_FOUND", "gone"))) is NotFound
    assert isinstance(error_from_wire(WireError("ABORTED", "died", "WorkerCrashed")), WorkerCrashed)
    # A type name that does not match its code falls back to the code's class.
    assert type(error_from_wire(WireError("NOT_FOUND", "x", "CompileError"))) is NotFound
    assert type(error_from_wire(WireError("WHATEVER", "x"))) is GpuBrokerError


def test_an_errors_details_are_bounded_so_that_every_receiver_decodes_them() -> None:
    """A WireError's details are a few short scalars (the front decodes a worker's as nothing else): as_wire turns
    any other value into its text, and keeps the first 32."""
    err = Internal("x", log="y" * (1 << 20), nested={"a": 1}, inf=float("inf"), dims=(1, 2), huge=1 << 70,
                   **{f"k{i}": i for i in range(40)})
    wire = err.as_wire()
    assert decode_wire_error(encode(wire)) == wire
    assert len(wire.details) == 32 and len(wire.details["log"]) == 256 * 1024
    assert wire.details["nested"] == "{'a': 1}" and wire.details["inf"] == "inf" and wire.details["dims"] == [1, 2]
    assert wire.details["huge"] == str(1 << 70)
    with pytest.raises(msgspec.DecodeError, match="unknown field"):
        decode_wire_error(msgspec.msgpack.encode({"code": "INTERNAL", "message": "m", "pad": [[]] * 100}))


def test_address_of_a_view_is_its_first_bytes_address() -> None:
    """A copy's DMA and the lookup of shared memory take a view's address: that of its first byte, writable or
    read-only, whole or a slice."""
    array = np.arange(4096, dtype=np.uint8)
    for view in (memoryview(array), memoryview(array)[100:], memoryview(array).toreadonly()[7:9],
                 memoryview(array)[:0]):
        expected = np.frombuffer(view, dtype=np.uint8).ctypes.data
        assert address_of(view) == expected
    assert address_of(memoryview(array)[100:]) == array.ctypes.data + 100
