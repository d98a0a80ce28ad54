"""Several devices from one client: a broker's device list, and copies between two sessions' devices."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from gpubroker.client._channel import make_channel, translated
from gpubroker.client._tls import TlsOptions
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.errors import InvalidArgument
from gpubroker.wire.types import Buffer, DeviceInfo

if TYPE_CHECKING:
    from gpubroker.client._remote import RemoteGpu

__all__ = ["copy_peer", "device_info_from_pb", "list_devices"]


def device_info_from_pb(msg: pb.DeviceInfo) -> DeviceInfo:
    return DeviceInfo(
        id=msg.id, name=msg.name, vendor=msg.vendor, backend=msg.backend, total_memory=msg.total_memory,
        free_memory=msg.free_memory, multiprocessor_count=msg.multiprocessor_count, clock_mhz=msg.clock_mhz,
        l2_cache_bytes=msg.l2_cache_bytes, unified_memory=msg.unified_memory,
        max_threads_per_block=msg.max_threads_per_block,
        # Repeated fields of three (and two) on the wire: the broker fills them from a checked DeviceInfo
        max_block_dims=cast("tuple[int, int, int]", tuple(msg.max_block_dims)),
        max_grid_dims=cast("tuple[int, int, int]", tuple(msg.max_grid_dims)),
        compute_capability=cast("tuple[int, int]", tuple(msg.compute_capability)) if msg.compute_capability else None,
        opencl_version=msg.opencl_version or None, driver_version=msg.driver_version,
        memory_quota=msg.memory_quota if msg.HasField("memory_quota") else None,
        memory_used=msg.memory_used if msg.HasField("memory_used") else None,
        memory_available=msg.memory_available if msg.HasField("memory_available") else None,
        health=msg.health or None, health_reason=msg.health_reason, sandbox=msg.sandbox or None)


def list_devices(target: str, token: str | None = None, *, tls: TlsOptions | None = None,
                 timeout: float = 30.0) -> list[DeviceInfo]:
    """Every device the broker at ``target`` serves, with its health and the caller's quota and use there.

    Needs no session: use it to choose a `device=` for [`connect`][gpubroker.client.connect]. A session has the
    same as a method, [`RemoteGpu.list_devices`][gpubroker.client.RemoteGpu.list_devices].

    Args:
        target: The broker's address (`unix:/path` or `host:port`).
        token: The tenant's token; None with a client certificate that names the tenant.
        tls: TLS settings for `host:port` targets.
        timeout: Seconds to wait for the answer.

    Returns:
        One [DeviceInfo][gpubroker.client.DeviceInfo] per device, in the broker's order (its `id` is the index to
            pass as `device=`), with `health` and the tenant's `memory_quota` and `memory_used` there.

    Raises:
        Unauthenticated: the token is missing or wrong.
        Unavailable: the broker cannot be reached.
        DeadlineExceeded: no answer within `timeout`.
    """
    channel, metadata = make_channel(target, token, tls)
    try:
        reply = translated(pb_grpc.GpuBrokerStub(channel).ListDevices, pb.ListDevicesRequest(), metadata=metadata,
                           timeout=timeout)
    finally:
        channel.close()
    return [device_info_from_pb(d) for d in reply.devices]


def _ref(buf: Buffer, what: str) -> pb.BufferRef:
    if not isinstance(buf, Buffer):
        raise InvalidArgument(f"{what} must be a Buffer, got {type(buf).__name__}")
    return pb.BufferRef(handle=buf.handle, offset=buf.offset)


def copy_peer(src_gpu: RemoteGpu, src: Buffer, dst_gpu: RemoteGpu, dst: Buffer, size: int, src_offset: int = 0,
              dst_offset: int = 0) -> str:
    """Copy ``size`` bytes from ``src`` (of ``src_gpu``'s session) to ``dst`` (of ``dst_gpu``'s): two sessions of one
    tenant on one broker, usually on two devices. Runs after the work both sessions queued before it and is done
    when it returns. Returns the path the broker took: "peer" (GPU to GPU), "host" (staged through host memory),
    "device" (both sessions on one device) or "none" (size 0).

    The bytes go from device to device inside the broker, never through the client. The same as
    `src_gpu.copy_peer(src, dst_gpu, dst, size, ...)` ([`RemoteGpu.copy_peer`][gpubroker.client.RemoteGpu.copy_peer]).

    Args:
        src_gpu: The session that holds `src`.
        src: The source allocation or view.
        dst_gpu: The session that holds `dst`: the same tenant, on the same broker.
        dst: The destination allocation or view.
        size: The number of bytes, >= 0.
        src_offset: Where to start reading, in bytes from `src`'s view start.
        dst_offset: Where to start writing, in bytes from `dst`'s view start.

    Returns:
        The path taken: `"peer"`, `"host"`, `"device"` or `"none"`.

    Raises:
        InvalidArgument: the sessions are on two brokers; `size` is not an int; `src` or `dst` is not a Buffer;
            a negative size or offset.
        OutOfRange: either range runs past the end of its allocation.
        NotFound: `src` or `dst` names no allocation of its session, or `dst_gpu` is another tenant's session.
        ResourceExhausted: the copy goes through host memory and the tenant's shared memory cannot take the
            staging it needs (a quarter of its `shared_memory`, 128 MiB at most, kept while its workers live).
        GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]). Deferred
            errors of either session stay kept for its next wait.
    """
    if dst_gpu.target != src_gpu.target:
        raise InvalidArgument(f"both sessions must be on one broker, not {src_gpu.target} and {dst_gpu.target}")
    if not isinstance(size, int) or isinstance(size, bool):
        raise InvalidArgument(f"size must be an int, got {type(size).__name__}")
    request = pb.CopyPeerRequest(src_session=src_gpu.session, src=_ref(src, "src"), src_offset=src_offset,
                                 dst_session=dst_gpu.session, dst=_ref(dst, "dst"), dst_offset=dst_offset, size=size)
    dst_gpu._drain()  # program order in both sessions: what each queued runs first
    src_gpu._drain()
    return str(src_gpu._call("CopyPeer", request).path)
