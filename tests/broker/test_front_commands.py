"""The front's one conversion per typed RPC (src/gpubroker/broker/front/_commands.py): every RPC is accounted for,
each request
becomes protocol commands that survive the one encoding, and bad requests are refused with a clear status."""

from __future__ import annotations

import pytest

from gpubroker.broker.front._commands import RPC_COMMANDS, command_of, copy_shared_commands, pack
from gpubroker.client import GpuBrokerError, InvalidArgument, NotFound
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.wire.commands import CopyShared, Launch, Memset, ScalarArg


def test_every_rpc_of_the_service_maps_onto_commands_or_is_control_plane() -> None:
    rpcs = set(pb.DESCRIPTOR.services_by_name["GpuBroker"].methods_by_name)
    assert set(RPC_COMMANDS) == rpcs
    assert {name for name, convert in RPC_COMMANDS.items() if convert is None} == {
        "OpenSession", "CloseSession", "Heartbeat", "ListDevices", "CopyPeer"}


def test_typed_requests_become_commands_that_survive_the_encoding() -> None:
    launch = pb.LaunchKernelRequest(kernel="k1", grid=[2, 1], block=[64], stream="s1", args=[
        pb.KernelArg(buffer=pb.BufferRef(handle="b1", offset=8)),
        pb.KernelArg(scalar=pb.ScalarArg(dtype="<f4", value=b"\0\0\0@"))])
    memset = pb.MemsetRequest(buffer=pb.BufferRef(handle="b1"), size=-1, value=7)
    batch, _ = pack([command_of(pb.Command(seq=1, launch=launch)), command_of(pb.Command(seq=2, memset=memset))])
    first, second = batch.commands
    assert isinstance(first, Launch) and first.grid == (2, 1) and first.stream == "s1"
    assert first.args[1] == ScalarArg("<f4", b"\0\0\0@")
    assert isinstance(second, Memset) and (second.buf, second.value, second.size) == (("b1", 0), 7, -1)
    pieces = copy_shared_commands(pb.CopySharedRequest(segment="g1", buffer=pb.BufferRef(handle="b1"),
                                                       size=(600 << 20) + 3, to_device=True))
    assert [p.size for p in pieces if isinstance(p, CopyShared)] == [256 << 20, 256 << 20, (88 << 20) + 3]


@pytest.mark.parametrize(("command", "error", "message"), [
    (pb.Command(seq=1), InvalidArgument, "names no operation"),
    (pb.Command(launch=pb.LaunchKernelRequest(kernel="k", grid=[1, 1, 1, 1], block=[1])), InvalidArgument,
     "1 to 3 extents"),
    (pb.Command(launch=pb.LaunchKernelRequest(kernel="", grid=[1], block=[1])), NotFound, "no kernel ''"),
    (pb.Command(launch=pb.LaunchKernelRequest(kernel="k", grid=[1], block=[1], args=[pb.KernelArg()])),
     InvalidArgument, "kernel arg 0 is empty"),
    (pb.Command(memset=pb.MemsetRequest(buffer=pb.BufferRef(handle="b"), value=256)), InvalidArgument, "a byte"),
    (pb.Command(memset=pb.MemsetRequest(buffer=pb.BufferRef(handle="b" * 65))), NotFound, "no buf"),
    (pb.Command(copy_d2d=pb.CopyDeviceToDeviceRequest(src=pb.BufferRef(handle="a"), dst=pb.BufferRef(handle="b"),
                                                      size=-4)), InvalidArgument, "copy size must be >= 0"),
], ids=["empty", "dims", "no-kernel", "empty-arg", "value", "long-handle", "negative"])
def test_bad_typed_requests_are_refused_clearly(command: pb.Command, error: type[GpuBrokerError],
                                                message: str) -> None:
    with pytest.raises(error, match=message):
        pack([command_of(command)])
