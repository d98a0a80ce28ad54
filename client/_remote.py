"""RemoteGpu: GpuCompute on a gpubroker session: device commands through one transport, the control plane on gRPC."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ._channel import make_channel, translated
from ._devices import copy_peer, device_info_from_pb
from ._errors import FailedPrecondition, GpuBrokerError, InvalidArgument
from ._host import check_device_range, readable_bytes, writable_bytes
from ._library import check_library_call
from ._protocol import (
    CODECS,
    MAX_HANDLE,
    Allocate,
    BufferArg,
    Command,
    CopyD2D,
    CreateEvent,
    CreateStream,
    DestroyEvent,
    DestroyStream,
    Free,
    KernelArg,
    Launch,
    Memset,
    RecordEvent,
    RunLibrary,
    ScalarArg,
    Synchronize,
    SynchronizeEvent,
    WaitEvent,
    new_handle,
)
from ._shm import SharedMemory
from ._tls import TlsOptions
from ._transports import TRANSPORTS, Transport, choose_transport
from ._types import (
    ArrayRef,
    Buffer,
    DeviceInfo,
    Event,
    Kernel,
    Module,
    ModuleFormat,
    Stream,
    check_kernel_args,
    normalize_dims,
)
from ._wire import FORMATS as _FORMATS
from ._wire import buf_ref as _ref
from ._wire import handle as _handle
from ._wire import stream_handle as _stream

__all__ = ["RemoteGpu"]


class RemoteGpu:
    """A session on one device of a broker. Same interface as the in-process backends.

    ``device=None`` lets the broker choose: the least loaded device that serves and where the tenant has quota
    room (``gpu.device`` then says which).

    Every device command (allocate, free, memset, copies, launches, streams, synchronize) is built once
    (``client/_protocol.py``) and goes through the one transport chosen at connect (``gpu.transport``):
    ``transport="auto"`` takes a framed link straight to the session's worker where the broker offers one (the
    same host's ``<socket>.fast``, upgraded to a shared-memory ring with doorbells where the worker takes it,
    ``"ring"`` insisting on that; a VM guest's vsock port, ``vsock=None`` probing for one; the broker's TCP link
    port, with the same TLS options), else gRPC's ``Commands`` stream; ``"link"`` insists on a link, ``"grpc"``
    never takes one. The control plane (sessions, devices, modules, kernels, CopyPeer) is typed gRPC.

    With ``async_commands``, launches, memsets, device copies, allocations, frees, stream creation and events
    (create, record, wait, destroy) return at once and their errors surface at the next ``synchronize`` naming
    the command (as in CUDA); without, each is a round trip that raises its own error. ``synchronize_event``
    always waits (the host's wait for an event).

    ``timeout`` bounds each call (seconds) and each wait for an acknowledgement; a background thread sends
    heartbeats within the lease. ``tls`` (a TlsOptions) is for TCP listeners with TLS or mTLS; with a client
    certificate the token may be None. On a unix: target copies use the broker's shared-memory side channel when
    it is there (``shared_memory=False``: never). ``compress`` ("auto", "lz4" or None) asks the link for lz4 on
    copies' bytes, each chunk sent compressed only where that shrinks it: "auto" on TCP and vsock links only (on the
    same host bytes move faster than lz4 packs them), "lz4" on any link, None never; gRPC never compresses.
    """

    def __init__(self, target: str, token: str | None = None, device: int | None = None, *,
                 timeout: float | None = 300.0,
                 chunk_bytes: int | None = None, client_name: str = "gpubroker-python",
                 tls: TlsOptions | None = None, async_commands: bool = False, transport: str = "auto",
                 vsock: bool | None = None, shared_memory: bool = True, compress: str | None = "auto") -> None:
        if transport not in TRANSPORTS:
            raise InvalidArgument(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if compress not in (None, "auto", *CODECS):
            raise InvalidArgument(f"compress must be None, 'auto' or one of {', '.join(CODECS)}, got {compress!r}")
        self._compress = compress
        self.target = target
        self._token = token or ""
        self._tls = tls
        self._want_transport = transport
        self._vsock = vsock
        self._transport: Transport | None = None
        # Same host (a unix: target with the broker's "<socket>.shm"): copies go through shared memory.
        self._shm = SharedMemory(target, token, lambda: self._session, lambda: self.transport,
                                 timeout) if shared_memory else None
        self.async_commands = async_commands
        self.timeout = timeout
        self._channel, self._metadata = make_channel(target, token, tls)
        self._stub = pb_grpc.GpuBrokerStub(self._channel)
        self._device = device
        self._client_name = client_name
        self._requested_chunk = chunk_bytes
        self._session = ""
        self._info: DeviceInfo | None = None
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.chunk_bytes = 1024 * 1024
        self.lease_seconds = 0.0

    # -- plumbing ----------------------------------------------------------------------------------
    @property
    def transport(self) -> Transport:
        """The transport every device command takes (its ``kind``: "ring", "unix", "tcp", "vsock" or "grpc")."""
        if self._closed.is_set():
            raise FailedPrecondition("this RemoteGpu is closed")
        if self._transport is None:
            raise FailedPrecondition("this RemoteGpu is not initialized (use connect(), or call initialize())")
        return self._transport

    def _call(self, method: str, request: Any) -> Any:
        """A control-plane call (typed gRPC). It sees the effects of every command queued before it: program order
        across the two planes (a queued error stays kept for the next synchronize)."""
        if self._closed.is_set():
            raise FailedPrecondition("this RemoteGpu is closed")
        self._drain()
        return translated(getattr(self._stub, method), request, metadata=self._metadata, timeout=self.timeout)

    def _command(self, command: Command) -> None:
        """Queued with async_commands (errors deferred to the next synchronize), else a round trip."""
        transport = self._transport
        if transport is None:
            transport = self.transport  # (raises: closed, or not initialized)
        if self.async_commands:
            transport.submit(command)
        else:
            transport.call(command)

    def _drain(self) -> None:
        """Wait for every queued command (its error stays kept for the next synchronize)."""
        if self._transport is not None:
            self._transport.wait(raise_error=False)

    def _heartbeat_loop(self) -> None:
        interval = max(0.05, self.lease_seconds / 3)
        while not self._closed.wait(interval):
            try:
                self._stub.Heartbeat(pb.SessionRequest(session=self._session), metadata=self._metadata,
                                     timeout=max(1.0, self.lease_seconds))
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED,
                                  grpc.StatusCode.UNAUTHENTICATED):
                    return  # the session is gone; the next call reports why

    # -- GpuCompute --------------------------------------------------------------------------------
    def initialize(self) -> None:
        if self._session:
            return
        resp = self._call("OpenSession", pb.OpenSessionRequest(
            device=self._device or 0, any_device=self._device is None, client_name=self._client_name))
        self._session = resp.session
        self._info = device_info_from_pb(resp.device)
        self.lease_seconds = resp.lease_seconds
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="gpubroker-heartbeat", daemon=True)
        self._heartbeat.start()
        chunk = min(self._requested_chunk or resp.max_chunk_bytes, resp.max_chunk_bytes)
        try:
            self._transport = choose_transport(
                self._want_transport, target=self.target, tls=self._tls, token=self._token, session=self._session,
                link_port=resp.link_port, link_vsock_port=resp.link_vsock_port, vsock=self._vsock, stub=self._stub,
                metadata=self._metadata, timeout=self.timeout, max_data=chunk, compress=self._compress)
        except BaseException:
            self.close()  # (transport="link" with none there): the session is not left to expire
            raise
        self.chunk_bytes = min(chunk, self._transport.max_data)

    @property
    def session(self) -> str:
        return self._session

    @property
    def device(self) -> int | None:
        """The broker's index of this session's device (None before ``initialize`` when the broker chooses)."""
        return self._info.id if self._info is not None else self._device

    def list_devices(self) -> list[DeviceInfo]:
        """Every device of this broker, with its health and this tenant's quota and use there."""
        return [device_info_from_pb(d) for d in self._call("ListDevices", pb.ListDevicesRequest()).devices]

    def copy_peer(self, src: Buffer, dst_gpu: RemoteGpu, dst: Buffer, size: int, src_offset: int = 0,
                  dst_offset: int = 0) -> str:
        """Copy from ``src`` here to ``dst`` in ``dst_gpu``, another session of this tenant on this broker (usually on
        another device); returns the path taken: "peer", "host", "device" or "none". See ``copy_peer``."""
        return copy_peer(self, src, dst_gpu, dst, size, src_offset, dst_offset)

    def device_info(self) -> DeviceInfo:
        return device_info_from_pb(self._call("GetDeviceInfo", pb.SessionRequest(session=self._session)))

    def allocate_memory(self, size: int) -> Buffer:
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool):
            raise InvalidArgument(f"size must be an int, got {type(size).__name__}")
        if size <= 0:
            raise InvalidArgument(f"allocation size must be > 0, got {size}")
        # The handle is ours: an allocation queues like a launch (an over-quota one fails at the next sync).
        handle = new_handle("buf")
        self._command(Allocate(handle, int(size)))
        return Buffer(handle, int(size))

    def free_memory(self, buf: Buffer) -> None:
        self._command(Free(_ref(buf)[0]))

    def host_array(self, shape: int | Sequence[int], dtype: Any = np.uint8) -> np.ndarray:
        """A numpy array in memory shared with the broker's worker (same host, unix: target): copies to and from
        it, or any view of it, are a single CopyShared with no bytes through a socket. Valid for this session."""
        if self._shm is None:
            raise FailedPrecondition("host_array needs shared memory; this RemoteGpu has shared_memory=False")
        return self._shm.host_array(shape, dtype)

    def copy_h2d(self, src: Any, buf: Buffer, offset: int = 0, stream: Stream | None = None) -> None:
        data = readable_bytes(src)
        ref, where = _ref(buf), _stream(stream)
        transport = self.transport
        if self._shm is not None and self._shm.copy(data, buf, offset, where, to_device=True):
            return
        # Up front: a bad range must not leave a partial copy behind.
        check_device_range(buf, offset, data.nbytes, "copy_h2d")
        transport.copy_in(ref, offset, data, where, self.chunk_bytes)

    def copy_d2h(self, buf: Buffer, dst: Any, offset: int = 0, stream: Stream | None = None) -> None:
        out = writable_bytes(dst)
        ref, where = _ref(buf), _stream(stream)
        transport = self.transport
        if self._shm is not None and self._shm.copy(out, buf, offset, where, to_device=False):
            return
        check_device_range(buf, offset, out.nbytes, "copy_d2h")
        transport.copy_out(ref, offset, out, where, self.chunk_bytes)

    def copy_d2d(self, src: Buffer, dst: Buffer, size: int, src_offset: int = 0, dst_offset: int = 0,
                 stream: Stream | None = None) -> None:
        _check_counts(size=size, src_offset=src_offset, dst_offset=dst_offset)
        self._command(CopyD2D(_ref(src), _ref(dst), size, src_offset, dst_offset, _stream(stream)))

    def memset(self, buf: Buffer, value: int, size: int | None = None, offset: int = 0,
               stream: Stream | None = None) -> None:
        if not isinstance(value, (int, np.integer)) or not 0 <= value <= 255:
            raise InvalidArgument(f"memset value must be a byte (0..255), got {value!r}")
        _check_counts(offset=offset, size=0 if size is None else size)
        self._command(Memset(_ref(buf), int(value), -1 if size is None else size, offset, _stream(stream)))

    def compile_kernel(self, source: str, name: str, options: Sequence[str] = ()) -> Kernel:
        backend = self._info.backend if self._info else "opencl"
        fmt = ModuleFormat.CUDA_C if backend == "cuda" else ModuleFormat.OPENCL_C
        return self.get_kernel(self.load_module(source, fmt, options), name)

    def load_module(self, image: str | bytes, format: ModuleFormat, options: Sequence[str] = ()) -> Module:
        raw = image.encode() if isinstance(image, str) else bytes(image)
        resp = self._call("LoadModule", pb.LoadModuleRequest(session=self._session, format=_FORMATS[format],
                                                              image=raw, options=list(options)))
        return Module(resp.handle, tuple(resp.kernel_names))

    def get_kernel(self, module: Module, name: str) -> Kernel:
        resp = self._call("GetKernel", pb.GetKernelRequest(session=self._session, module=module.handle, name=name))
        return Kernel(resp.handle, resp.name)

    def execute_kernel(self, kernel: Kernel, grid: int | Sequence[int], block: int | Sequence[int],
                       args: Sequence[object], shared_mem: int = 0, stream: Stream | None = None) -> None:
        # The hot path of asynchronous work: checks cost a type test each where the arguments are well formed.
        checked = check_kernel_args(args) if args or type(args) not in (list, tuple) else []
        if type(kernel) is not Kernel:
            raise InvalidArgument(f"expected a Kernel, got {type(kernel).__name__}")
        if type(shared_mem) is not int or shared_mem < 0:
            _check_counts(shared_mem=shared_mem)
        wire: list[KernelArg] = [BufferArg(*_ref(a)) if isinstance(a, Buffer) else _scalar(a) for a in checked]
        handle = kernel.handle if type(kernel.handle) is str and 0 < len(kernel.handle) <= MAX_HANDLE \
            else _handle(kernel.handle, "kernel")
        self._command(Launch(handle, normalize_dims(grid, "grid"), normalize_dims(block, "block"), wire, shared_mem,
                             _stream(stream) if stream is not None else ""))

    def run_library(self, op: str, inputs: Sequence[ArrayRef], outputs: Sequence[ArrayRef],
                    params: Mapping[str, object] | None = None, stream: Stream | None = None) -> None:
        # Checked here too (the table is pure): a mistake raises at the call, not at the next synchronize, and
        # only what encodes is sent. The worker checks again against the real allocations.
        ins, outs, checked = check_library_call(op, inputs, outputs, params)
        self._command(RunLibrary(op, [(_ref(r.buffer), r.dtype, r.shape) for r in ins],
                                 [(_ref(r.buffer), r.dtype, r.shape) for r in outs], checked,
                                 _stream(stream) if stream is not None else ""))

    def create_stream(self) -> Stream:
        handle = new_handle("stream")
        self._command(CreateStream(handle))
        return Stream(handle)

    def destroy_stream(self, stream: Stream) -> None:
        self.transport.call(DestroyStream(_stream_ref(stream)))

    def synchronize(self, stream: Stream | None = None) -> None:
        # One round trip carrying what is queued and the sync; an asynchronous command's error surfaces here.
        self.transport.call(Synchronize(_stream(stream)))

    # Events are commands like stream creation: queued with async_commands, the handle chosen here.
    def create_event(self) -> Event:
        handle = new_handle("event")
        self._command(CreateEvent(handle))
        return Event(handle)

    def record_event(self, event: Event, stream: Stream | None = None) -> None:
        self._command(RecordEvent(_event_ref(event), _stream(stream)))

    def wait_event(self, event: Event, stream: Stream | None = None) -> None:
        self._command(WaitEvent(_event_ref(event), _stream(stream)))

    def synchronize_event(self, event: Event) -> None:
        # The host waits: one round trip carrying what is queued, as synchronize.
        self.transport.call(SynchronizeEvent(_event_ref(event)))

    def destroy_event(self, event: Event) -> None:
        self._command(DestroyEvent(_event_ref(event)))

    def close(self) -> None:
        """End the session (the broker frees its buffers, modules and streams) and the channel."""
        if self._closed.is_set():
            return
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        try:
            if self._session:
                self._call("CloseSession", pb.SessionRequest(session=self._session))
        except GpuBrokerError:
            pass  # already gone (expired, worker lost): nothing left to free
        finally:
            self._closed.set()
            self._channel.close()
            if self._shm is not None:
                self._shm.close()

    def __enter__(self) -> RemoteGpu:
        self.initialize()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_counts(**values: object) -> None:
    """Offsets and sizes the protocol carries as non-negative ints, checked here: a command the worker cannot
    decode would fail its whole batch."""
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise InvalidArgument(f"{name} must be >= 0, got {value}")


def _event_ref(event: Event) -> str:
    if type(event) is not Event:
        raise InvalidArgument(f"expected an Event, got {type(event).__name__}")
    return _handle(event.handle, "event")


def _stream_ref(stream: Stream) -> str:
    if not isinstance(stream, Stream):
        raise InvalidArgument(f"expected a Stream, got {type(stream).__name__}")
    return _stream(stream)


def _scalar(value: np.generic) -> ScalarArg:
    if value.dtype.itemsize > 8:  # (long double): no device takes it by value
        raise InvalidArgument(f"a kernel scalar is at most 8 bytes, got {value.dtype} ({value.dtype.itemsize})")
    return ScalarArg(value.dtype.str, value.tobytes())
