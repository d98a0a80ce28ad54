"""RemoteGpu: GpuCompute over gRPC to a gpubroker, as a session that ends when it is closed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ._commands import CommandStream
from ._devices import copy_peer, device_info_from_pb
from ._errors import FailedPrecondition, GpuBrokerError, InvalidArgument, Unavailable
from ._fast import DirectCommands, FastChannel, fast_command_stream
from ._host import readable_bytes, writable_bytes
from ._shm import SharedMemory
from ._tls import TlsOptions
from ._transport import make_channel, translated, translated_iter
from ._types import (
    Buffer,
    DeviceInfo,
    Kernel,
    Module,
    ModuleFormat,
    Stream,
    check_kernel_args,
    normalize_dims,
)
from ._wire import FORMATS as _FORMATS
from ._wire import direct_ref as _direct_ref
from ._wire import ref as _ref
from ._wire import stream_handle as _stream

__all__ = ["RemoteGpu"]

# Synchronous calls the same-host fast path carries, by their fast-path operation.
_FAST_OPS = {"LaunchKernel": "launch", "Memset": "memset", "CopyDeviceToDevice": "copy_d2d",
             "Synchronize": "synchronize", "CopyShared": "copy_shared"}

# Calls that must see the effects of every command queued before them.
_ORDERED_AFTER_COMMANDS = frozenset({"Free", "DestroyStream", "GetDeviceInfo", "Synchronize", "Allocate"})

class RemoteGpu:
    """A session on one device of a broker. Same interface as the in-process backends.

    ``device=None`` lets the broker choose: the least loaded device that serves and where the tenant has quota
    room (``gpu.device`` then says which).

    ``timeout`` bounds each call (seconds); a background thread sends heartbeats within the lease. ``tls`` (a
    TlsOptions) is for TCP listeners with TLS or mTLS; with a client certificate the token may be None. On a unix:
    target copies use the broker's shared-memory side channel when it is there (``shared_memory=False``: never).
    """

    def __init__(self, target: str, token: str | None = None, device: int | None = None, *,
                 timeout: float | None = 300.0,
                 chunk_bytes: int | None = None, client_name: str = "gpubroker-python",
                 tls: TlsOptions | None = None, async_commands: bool = False, fast_path: bool = True,
                 shared_memory: bool = True, direct: bool = True) -> None:
        self.target = target
        self._token = token or ""
        # Same host (a unix: target): synchronous device calls take the broker's raw-socket fast path.
        self._want_fast = fast_path and target.startswith("unix:")
        self._want_direct = direct
        self._direct_commands = False
        self._fast: FastChannel | None = None
        # Same host: launches, memsets, device copies and syncs go straight to the session's worker.
        self._direct: FastChannel | None = None
        # Same host (a unix: target with the broker's "<socket>.shm"): copies go through shared memory.
        self._shm = SharedMemory(target, token, lambda: self._session, self._call, timeout) if shared_memory else None
        # With async_commands, launches, memsets and device copies return at once and their errors surface at
        # the next synchronize (as in CUDA); without, each is a round trip that raises its own error.
        self.async_commands = async_commands
        self._commands: CommandStream | DirectCommands | None = None
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
    def _call(self, method: str, request: Any) -> Any:
        if self._closed.is_set():
            raise FailedPrecondition("this RemoteGpu is closed")
        if self._commands is not None and method in _ORDERED_AFTER_COMMANDS:
            self._commands.wait(raise_error=False)  # program order: queued commands run first
        fast = self._fast
        if fast is not None and method in _FAST_OPS and fast.hung_up():
            self._fast = fast = None  # closed by the broker while idle (or revoked): this call goes by gRPC
        if fast is not None and method in _FAST_OPS:
            try:
                return fast.call(_FAST_OPS[method], request.SerializeToString())
            except GpuBrokerError as exc:
                if fast.closed:  # lost, or out of step after a deadline: later calls go by gRPC
                    self._fast = None
                if exc.details.get("sent") is not False:
                    raise
                # (closed by the broker before the request went out: this one goes by gRPC too)
        return translated(getattr(self._stub, method), request, metadata=self._metadata, timeout=self.timeout)

    def _before_host_copy(self) -> None:
        """A host copy sees the effects of every command queued before it (program order)."""
        if self._closed.is_set():
            raise FailedPrecondition("this RemoteGpu is closed")
        if self._commands is not None:
            self._commands.wait(raise_error=False)

    def _command(self, method: str, kind: str, request: Any) -> None:
        """An asynchronous command when async_commands is on, else a round trip."""
        if self._commands is None:
            self._call(method, request)
            return
        if self._closed.is_set():
            raise FailedPrecondition("this RemoteGpu is closed")
        # Callers send through DirectCommands only by submit_one (_direct_commands): this is the gRPC stream.
        assert isinstance(self._commands, CommandStream)
        request.ClearField("session")  # the stream names the session once
        self._commands.submit(**{kind: request})

    def _device_call(self, op: str, params: dict[str, Any], method: str, kind: str,
                     request: Callable[[], Any]) -> None:
        """A device call on the direct link when there is one, else through the broker's front."""
        direct = self._direct
        if direct is not None and direct.hung_up():
            self._direct = direct = None  # closed while idle (or revoked): this call goes through the front
        if direct is not None and self._commands is None:
            if self._closed.is_set():
                raise FailedPrecondition("this RemoteGpu is closed")
            try:
                direct.call(op, params)
                return
            except Unavailable:
                # The worker dropped the link (session ended, worker lost): the front knows why, and says so.
                self._direct = None
                direct.close()
        elif self._commands is not None and self._direct_commands:
            if self._closed.is_set():
                raise FailedPrecondition("this RemoteGpu is closed")
            self._commands.submit_one(op, params)
            return
        self._command(method, kind, request())

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
        self.chunk_bytes = min(self._requested_chunk or resp.max_chunk_bytes, resp.max_chunk_bytes)
        fast_path = self.target[len("unix:"):] + ".fast"
        if self._want_fast:
            try:
                self._direct = FastChannel(fast_path, self._token, self._session, self.timeout,
                                           direct=self._want_direct)
                if self._direct.direct:  # copies through shared memory still go by the front
                    self._fast = FastChannel(fast_path, self._token, self._session, self.timeout)
                else:
                    self._fast, self._direct = self._direct, None
            except Unavailable:
                self._fast = None  # an older broker, or the fast path switched off: gRPC serves everything
        if self.async_commands and self._direct is not None:
            # Same host: batches go straight to the worker, on a link of their own.
            self._commands = DirectCommands(lambda: self._open_direct(fast_path))
            self._direct_commands = True
        elif self.async_commands:
            if self._fast is not None:  # through the front's fast path
                open_stream = fast_command_stream(fast_path, self._token, self._session, self.timeout)
            else:
                def open_stream(batches: Iterator[pb.CommandBatch]) -> Iterator[pb.BatchAck]:
                    acks: Iterator[pb.BatchAck] = self._stub.Commands(batches, metadata=self._metadata)
                    return acks
            self._commands = CommandStream(open_stream, self._session)
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="gpubroker-heartbeat", daemon=True)
        self._heartbeat.start()

    def _open_direct(self, fast_path: str) -> FastChannel:
        link = FastChannel(fast_path, self._token, self._session, None, direct=True)  # acks may be a long kernel away
        if not link.direct:
            link.close()
            raise Unavailable("the broker declined a direct link for asynchronous commands")
        return link

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
        if not isinstance(size, (int, np.integer)):
            raise InvalidArgument(f"size must be an int, got {type(size).__name__}")
        resp = self._call("Allocate", pb.AllocateRequest(session=self._session, size=int(size)))
        return Buffer(resp.handle, resp.size)

    def free_memory(self, buf: Buffer) -> None:
        self._call("Free", pb.FreeRequest(session=self._session, buffer=_ref(buf).handle))

    def host_array(self, shape: int | Sequence[int], dtype: Any = np.uint8) -> np.ndarray:
        """A numpy array in memory shared with the broker's worker (same host, unix: target): copies to and from
        it, or any view of it, are a single CopyShared with no bytes through gRPC. Valid for this session."""
        if self._shm is None:
            raise FailedPrecondition("host_array needs shared memory; this RemoteGpu has shared_memory=False")
        return self._shm.host_array(shape, dtype)

    def copy_h2d(self, src: Any, buf: Buffer, offset: int = 0, stream: Stream | None = None) -> None:
        data = readable_bytes(src)
        header = pb.HostToDeviceHeader(session=self._session, buffer=_ref(buf), offset=offset, size=data.nbytes,
                                       stream=_stream(stream))
        chunk = self.chunk_bytes

        def chunks() -> Iterator[pb.HostToDeviceChunk]:
            yield pb.HostToDeviceChunk(header=header, data=bytes(data[:chunk]))
            for start in range(chunk, data.nbytes, chunk):
                yield pb.HostToDeviceChunk(data=bytes(data[start:start + chunk]))

        self._before_host_copy()
        if self._shm is not None and self._shm.copy(data, buf, offset, _stream(stream), to_device=True):
            return
        translated(self._stub.CopyHostToDevice, chunks(), metadata=self._metadata, timeout=self.timeout)

    def copy_d2h(self, buf: Buffer, dst: Any, offset: int = 0, stream: Stream | None = None) -> None:
        out = writable_bytes(dst)
        self._before_host_copy()
        if self._shm is not None and self._shm.copy(out, buf, offset, _stream(stream), to_device=False):
            return
        request = pb.CopyDeviceToHostRequest(session=self._session, buffer=_ref(buf), offset=offset,
                                             size=out.nbytes, chunk_bytes=self.chunk_bytes, stream=_stream(stream))
        done = 0
        responses = self._stub.CopyDeviceToHost(request, metadata=self._metadata, timeout=self.timeout)
        for msg in translated_iter(responses):
            n = len(msg.data)
            if done + n > out.nbytes:
                raise GpuBrokerError(f"broker sent more than the {out.nbytes} bytes asked for")
            out[done:done + n] = msg.data
            done += n
        if done != out.nbytes:
            raise GpuBrokerError(f"broker sent {done} of {out.nbytes} bytes")

    def copy_d2d(self, src: Buffer, dst: Buffer, size: int, src_offset: int = 0, dst_offset: int = 0,
                 stream: Stream | None = None) -> None:
        self._device_call(
            "copy_d2d", {"src": _direct_ref(src), "dst": _direct_ref(dst), "size": size, "src_offset": src_offset,
                         "dst_offset": dst_offset, "stream": _stream(stream)},
            "CopyDeviceToDevice", "copy_d2d", lambda: pb.CopyDeviceToDeviceRequest(
                session=self._session, src=_ref(src), src_offset=src_offset, dst=_ref(dst), dst_offset=dst_offset,
                size=size, stream=_stream(stream)))

    def memset(self, buf: Buffer, value: int, size: int | None = None, offset: int = 0,
               stream: Stream | None = None) -> None:
        if not 0 <= value <= 255:
            raise InvalidArgument(f"memset value must be a byte (0..255), got {value}")
        wire_size = -1 if size is None else size
        self._device_call(
            "memset", {"buf": _direct_ref(buf), "offset": offset, "size": wire_size, "value": value,
                       "stream": _stream(stream)},
            "Memset", "memset", lambda: pb.MemsetRequest(session=self._session, buffer=_ref(buf), offset=offset,
                                                         size=wire_size, value=value, stream=_stream(stream)))

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
        checked = check_kernel_args(args)
        grid, block = normalize_dims(grid, "grid"), normalize_dims(block, "block")

        def request() -> pb.LaunchKernelRequest:
            wire_args = []
            for arg in checked:
                if isinstance(arg, Buffer):
                    wire_args.append(pb.KernelArg(buffer=_ref(arg)))
                else:
                    wire_args.append(pb.KernelArg(scalar=pb.ScalarArg(dtype=arg.dtype.str, value=arg.tobytes())))
            return pb.LaunchKernelRequest(session=self._session, kernel=kernel.handle, grid=grid, block=block,
                                          shared_mem=shared_mem, stream=_stream(stream), args=wire_args)

        if self._direct is None and not self._direct_commands:
            self._command("LaunchKernel", "launch", request())
            return
        params = {"kernel": kernel.handle, "grid": grid, "block": block, "shared_mem": shared_mem,
                  "stream": stream.handle if stream is not None else "",
                  "args": [["b", a.handle, a.offset] if isinstance(a, Buffer) else ["s", a.dtype.str, a.tobytes()]
                           for a in checked]}
        if self._direct_commands and not self._closed.is_set():
            self._commands.submit_one("launch", params)  # type: ignore[union-attr]  # asynchronous launches' hot path
            return
        self._device_call("launch", params, "LaunchKernel", "launch", request)

    def create_stream(self) -> Stream:
        return Stream(self._call("CreateStream", pb.SessionRequest(session=self._session)).handle)

    def destroy_stream(self, stream: Stream) -> None:
        self._call("DestroyStream", pb.StreamRequest(session=self._session, stream=stream.handle))

    def synchronize(self, stream: Stream | None = None) -> None:
        try:
            if self._commands is not None and not self._direct_commands:
                # One round trip: the sync rides at the end of the last batch (the front's fast path or gRPC).
                self._commands.submit_one("synchronize", pb.StreamRequest(stream=_stream(stream)))
                return
            # A direct call, or with async_commands the last direct batch's tail; else through the front.
            self._device_call("synchronize", {"stream": _stream(stream)}, "Synchronize", "synchronize",
                              lambda: pb.StreamRequest(session=self._session, stream=_stream(stream)))
        finally:
            if self._commands is not None:
                self._commands.wait(raise_error=True)  # an asynchronous command's error surfaces here

    def close(self) -> None:
        """End the session (the broker frees its buffers, modules and streams) and the channel."""
        if self._closed.is_set():
            return
        if self._commands is not None:
            self._commands.close()
        if self._fast is not None:
            self._fast.close()
        if self._direct is not None:
            self._direct.close()
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
