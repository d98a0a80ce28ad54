"""RemoteGpu: GpuCompute on a gpubroker session: device commands through one transport, the control plane on gRPC."""

from __future__ import annotations

import functools
import struct
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc
import msgspec
import numpy as np

from gpubroker.client._channel import make_channel, translated
from gpubroker.client._devices import copy_peer, device_info_from_pb
from gpubroker.client._shm import SharedMemory
from gpubroker.client._tls import TlsOptions
from gpubroker.client._transports import TRANSPORTS, Transport, choose_transport
from gpubroker.client._wire import FORMATS as _FORMATS
from gpubroker.client._wire import buf_ref as _ref
from gpubroker.client._wire import handle as _handle
from gpubroker.client._wire import stream_handle as _stream
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.commands import (
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
    LibraryArray,
    Memset,
    RecordEvent,
    RunLibrary,
    ScalarArg,
    Synchronize,
    SynchronizeEvent,
    WaitEvent,
    new_handle,
)
from gpubroker.wire.errors import FailedPrecondition, GpuBrokerError, InvalidArgument, Unimplemented
from gpubroker.wire.host import check_device_range, readable_bytes, writable_bytes
from gpubroker.wire.library import check_library_call
from gpubroker.wire.torch import (
    OpResult,
    TensorMeta,
    TorchFree,
    TorchFromBuffer,
    TorchOp,
    TorchOpSync,
    TorchRead,
    TorchSeed,
    TorchToBuffer,
)
from gpubroker.wire.torch_ops import allowed as torch_allowed
from gpubroker.wire.types import (
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

__all__ = ["RemoteGpu"]


P = ParamSpec("P")
R = TypeVar("R")


def _abandons_on_interrupt(wait: Callable[Concatenate[RemoteGpu, P], R]) -> Callable[Concatenate[RemoteGpu, P], R]:
    """A wait that Ctrl-C interrupts abandons the session's work, as `cancel()` does, before the KeyboardInterrupt
    goes on: whatever the program does next (exits, or a notebook's next cell), the work does not keep the tenant's
    worker busy, and the tenant's next session does not wait behind it. (The transport may also be mid-frame then:
    the session could not go on anyway.)"""
    @functools.wraps(wait)
    def interruptible(self: RemoteGpu, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return wait(self, *args, **kwargs)
        except KeyboardInterrupt:
            self.cancel()
            raise
    return interruptible


class RemoteGpu:
    """A session on one device of a broker. Same interface as the in-process backends.

    ``device=None`` lets the broker choose: the least loaded device that serves and where the tenant has quota
    room (``gpu.device`` then says which).

    Every device command (allocate, free, memset, copies, launches, streams, synchronize) is built once
    (``gpubroker/wire/commands.py``) and goes through the one transport chosen at connect (``gpu.transport``):
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
    certificate the token may be None. On a unix: target copies use shared memory registered on the broker's
    link socket when it is there (``shared_memory=False``: never). ``compress`` ("auto", "lz4" or None) asks the
    link for lz4 on copies' bytes, each chunk sent compressed only where that shrinks it: "auto" on TCP and vsock
    links only (on the same host bytes move faster than lz4 packs them), "lz4" on any link, None never; gRPC never
    compresses.

    Make one with [`connect`][gpubroker.client.connect], which opens the session (a `RemoteGpu` constructed
    directly opens it at `initialize()` or on entering a `with` block). It is a context manager:
    `with connect(...) as gpu:` closes the session on leaving the block, error or not, so the broker frees its
    memory at once. Its GpuCompute methods behave as
    [GpuCompute][gpubroker.client.GpuCompute] documents; each method here says only what is particular to a
    session. A `RemoteGpu` may be shared by threads: its commands go out one at a time, in the order the calls
    are made.

    Args:
        target: The broker's address: `unix:/path` or `host:port`.
        token: The tenant's token; None with a client certificate that names the tenant.
        device: The broker's device index; None lets the broker choose.
        timeout: Seconds each call, and each wait for an acknowledgement, may take; None: no limit. A call
            past it raises `DeadlineExceeded`.
        chunk_bytes: The most bytes one copy command carries (the broker's limit caps it); None: the broker's.
        client_name: How the session names its client in the broker's logs.
        tls: TLS settings for `host:port` targets ([TlsOptions][gpubroker.client.TlsOptions]).
        async_commands: Queue commands and defer their errors to the next wait (see above); False makes each
            command a round trip that raises its own error.
        transport: `"auto"`, `"ring"`, `"link"` or `"grpc"`: how device commands travel (see above).
        vsock: Whether to look for the broker's vsock link (in a VM guest); None: probe for one.
        shared_memory: Whether host copies on a `unix:` target may use shared memory with the broker's worker.
        compress: `"auto"`, `"lz4"` or None: lz4 for copies' bytes on links (see above).

    Raises:
        InvalidArgument: an unknown `transport` or `compress`.
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
        """The broker's address this session is on."""
        self._token = token or ""
        self._tls = tls
        self._want_transport = transport
        self._vsock = vsock
        self._transport: Transport | None = None
        # Same host (a unix: target with the broker's "<socket>.fast"): copies go through shared memory.
        self._shm = SharedMemory(target, token, lambda: self._session, lambda: self.transport,
                                 timeout) if shared_memory else None
        self.async_commands = async_commands
        """Whether commands are queued, their errors deferred to the next wait (set at connect)."""
        self.timeout = timeout
        """Seconds each call may take (None: no limit)."""
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
        """The most bytes one copy command carries, agreed with the broker when the session opens."""
        self.lease_seconds = 0.0
        """How long the broker keeps the session without a heartbeat; a background thread sends them."""

    # -- plumbing ----------------------------------------------------------------------------------
    @property
    def transport(self) -> Transport:
        """The transport every device command takes (its ``kind``: "ring", "unix", "tcp", "vsock" or "grpc").

        Raises:
            FailedPrecondition: the session is closed, or not initialized.
        """
        if self._closed.is_set():
            raise FailedPrecondition("this RemoteGpu is closed")
        if self._transport is None:
            raise FailedPrecondition("this RemoteGpu is not initialized (use connect(), or call initialize())")
        return self._transport

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """A control-plane call (typed gRPC), within ``timeout`` (None: the session's). It sees the effects of every
        command queued before it: program order across the two planes (a queued error stays kept for the next
        synchronize)."""
        if self._closed.is_set():
            raise FailedPrecondition("this RemoteGpu is closed")
        self._drain()
        return translated(getattr(self._stub, method), request, metadata=self._metadata,
                          timeout=self.timeout if timeout is None else timeout)

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
        """Open the session on the broker and choose the transport; does nothing when it is open already.

        [`connect`][gpubroker.client.connect] calls it. See
        [GpuCompute.initialize][gpubroker.client.GpuCompute.initialize].

        Raises:
            Unavailable: also when `transport="link"` or `"ring"` was asked for and the broker offers none.
            GpuBrokerError: as [GpuCompute.initialize][gpubroker.client.GpuCompute.initialize] says.
        """
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
        """The session's id (as `gpubroker sessions` lists it); empty before `initialize`."""
        return self._session

    @property
    def device(self) -> int | None:
        """The broker's index of this session's device (None before ``initialize`` when the broker chooses)."""
        return self._info.id if self._info is not None else self._device

    def list_devices(self) -> list[DeviceInfo]:
        """Every device of this broker, with its health and this tenant's quota and use there.

        The same as [`list_devices`][gpubroker.client.list_devices] on this session's broker and credentials.

        Returns:
            One [DeviceInfo][gpubroker.client.DeviceInfo] per device of the broker; its `id` is the `device=` to
                open a session there.
        """
        return [device_info_from_pb(d) for d in self._call("ListDevices", pb.ListDevicesRequest()).devices]

    def copy_peer(self, src: Buffer, dst_gpu: RemoteGpu, dst: Buffer, size: int, src_offset: int = 0,
                  dst_offset: int = 0) -> str:
        """Copy from ``src`` here to ``dst`` in ``dst_gpu``, another session of this tenant on this broker (usually on
        another device); returns the path taken: "peer", "host", "device" or "none". See ``copy_peer``.

        Done when it returns, after the work both sessions queued before it; the errors are
        [`copy_peer`][gpubroker.client.copy_peer]'s.

        Args:
            src: The source allocation or view, of this session.
            dst_gpu: The destination session.
            dst: The destination allocation or view, of `dst_gpu`.
            size: Bytes, >= 0.
            src_offset: Where to start reading in `src`.
            dst_offset: Where to start writing in `dst`.

        Returns:
            `"peer"` (device to device), `"host"` (staged through the broker's host memory), `"device"` (both
                sessions on one device) or `"none"` (nothing to copy).
        """
        return copy_peer(self, src, dst_gpu, dst, size, src_offset, dst_offset)

    def device_info(self) -> DeviceInfo:
        """The device, with this tenant's quota, use and room on it and the device's health. See
        [GpuCompute.device_info][gpubroker.client.GpuCompute.device_info].

        Returns:
            The device as the worker reports it now.
        """
        return device_info_from_pb(self._call("GetDeviceInfo", pb.SessionRequest(session=self._session)))

    def allocate_memory(self, size: int) -> Buffer:
        """Allocate device memory, counted against the tenant's quota on this device. With `async_commands` it is
        queued: a refusal (`ResourceExhausted` past the quota) is raised at the next wait. See
        [GpuCompute.allocate_memory][gpubroker.client.GpuCompute.allocate_memory].

        Args:
            size: Bytes, > 0.

        Returns:
            The new allocation.
        """
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool):
            raise InvalidArgument(f"size must be an int, got {type(size).__name__}")
        if size <= 0:
            raise InvalidArgument(f"allocation size must be > 0, got {size}")
        # The handle is ours: an allocation queues like a launch (an over-quota one fails at the next sync).
        handle = new_handle("buf")
        self._command(Allocate(handle, int(size)))
        return Buffer(handle, int(size))

    def free_memory(self, buf: Buffer) -> None:
        """Free an allocation (queued with `async_commands`).
        See [GpuCompute.free_memory][gpubroker.client.GpuCompute.free_memory].

        Args:
            buf: The allocation or any view of it.
        """
        handle = _ref(buf)[0]
        transport = self._transport
        if transport is not None and transport.never_made(handle):
            return  # (a failed batch did not make it: its error was raised already, and there is nothing to free)
        self._command(Free(handle))

    def host_array(self, shape: int | Sequence[int], dtype: Any = np.uint8) -> np.ndarray:
        """A numpy array in memory shared with the broker's worker (same host, unix: target): copies to and from
        it, or any view of it, are a single CopyShared with no bytes through a socket. Valid for this session.

        Fill it and pass it (or a slice) to `copy_h2d`, or pass it to `copy_d2h` and read it afterwards. The
        memory is mapped into the tenant's worker until the array and every view of it are gone, or the session
        ends; it counts against the broker's shared-memory limits. If the broker refuses the shared-memory side
        channel itself (its connection limits), the array is plain host memory instead, with a RuntimeWarning:
        copies of it then go as commands, slower but the same.

        Args:
            shape: The array's shape: an int or a sequence of ints.
            dtype: Its NumPy dtype.

        Returns:
            A zero-filled NumPy array of `shape` and `dtype`.

        Raises:
            FailedPrecondition: shared memory is off (`shared_memory=False`) or not offered: the target is not a
                `unix:` socket on this host, or the broker has no link socket (`<socket>.fast`) beside it.
            InvalidArgument: a negative dimension.
            ResourceExhausted: the session or the tenant would map more host memory than the broker allows
                (`max_shared_bytes_per_session`; the tenant's `shared_memory`, which defaults to its memory quota;
                `max_shared_bytes_per_tenant`).
        """
        if self._shm is None:
            raise FailedPrecondition("host_array needs shared memory; this RemoteGpu has shared_memory=False")
        return self._shm.host_array(shape, dtype)

    @_abandons_on_interrupt
    def copy_h2d(self, src: Any, buf: Buffer, offset: int = 0, stream: Stream | None = None) -> None:
        """Copy host memory to the device; always a round trip, also with `async_commands`. On a `unix:` target a
        `host_array` (or any host buffer of 256 KiB or more, through a staging segment) goes through shared
        memory; anything else goes as write commands of `chunk_bytes`.
        See [GpuCompute.copy_h2d][gpubroker.client.GpuCompute.copy_h2d].

        Args:
            src: Host memory to read (C-contiguous, with the buffer protocol).
            buf: The destination allocation or view.
            offset: Where to start writing, in bytes from the view's start.
            stream: The stream the copy is ordered on; None for the default stream.
        """
        data = readable_bytes(src)
        ref, where = _ref(buf), _stream(stream)
        transport = self.transport
        if self._shm is not None and self._shm.copy(data, buf, offset, where, to_device=True):
            return
        # Up front: a bad range must not leave a partial copy behind.
        check_device_range(buf, offset, data.nbytes, "copy_h2d")
        transport.copy_in(ref, offset, data, where, self.chunk_bytes)

    @_abandons_on_interrupt
    def copy_d2h(self, buf: Buffer, dst: Any, offset: int = 0, stream: Stream | None = None) -> None:
        """Copy device memory to the host; always a round trip, through shared memory where `copy_h2d` would go.
        See [GpuCompute.copy_d2h][gpubroker.client.GpuCompute.copy_d2h].

        Args:
            buf: The source allocation or view.
            dst: Writable host memory to fill (C-contiguous).
            offset: Where to start reading, in bytes from the view's start.
            stream: The stream the copy is ordered on; None for the default stream.
        """
        out = writable_bytes(dst)
        ref, where = _ref(buf), _stream(stream)
        transport = self.transport
        if self._shm is not None and self._shm.copy(out, buf, offset, where, to_device=False):
            return
        check_device_range(buf, offset, out.nbytes, "copy_d2h")
        transport.copy_out(ref, offset, out, where, self.chunk_bytes)

    def copy_d2d(self, src: Buffer, dst: Buffer, size: int, src_offset: int = 0, dst_offset: int = 0,
                 stream: Stream | None = None) -> None:
        """Copy between device buffers of this session (queued with `async_commands`). See
        [GpuCompute.copy_d2d][gpubroker.client.GpuCompute.copy_d2d].

        Args:
            src: The source allocation or view.
            dst: The destination allocation or view.
            size: Bytes, >= 0.
            src_offset: Where to start reading in `src`.
            dst_offset: Where to start writing in `dst`.
            stream: The stream the copy is queued on; None for the default stream.
        """
        _check_counts(size=size, src_offset=src_offset, dst_offset=dst_offset)
        self._command(CopyD2D(_ref(src), _ref(dst), size, src_offset, dst_offset, _stream(stream)))

    def memset(self, buf: Buffer, value: int, size: int | None = None, offset: int = 0,
               stream: Stream | None = None) -> None:
        """Fill device memory with a byte (queued with `async_commands`).
        See [GpuCompute.memset][gpubroker.client.GpuCompute.memset].

        Args:
            buf: The allocation or view to fill.
            value: The byte, 0 to 255.
            size: Bytes to set; None for the rest of the allocation.
            offset: Where to start, in bytes from the view's start.
            stream: The stream the fill is queued on; None for the default stream.
        """
        if not isinstance(value, (int, np.integer)) or not 0 <= value <= 255:
            raise InvalidArgument(f"memset value must be a byte (0..255), got {value!r}")
        _check_counts(offset=offset, size=0 if size is None else size)
        self._command(Memset(_ref(buf), int(value), -1 if size is None else size, offset, _stream(stream)))

    def compile_kernel(self, source: str, name: str, options: Sequence[str] = ()) -> Kernel:
        """Compile source in the tenant's worker, in the device's language (CUDA C or OpenCL C), with a compile
        cache of the tenant's own. See [GpuCompute.compile_kernel][gpubroker.client.GpuCompute.compile_kernel].

        Args:
            source: The kernel source.
            name: The kernel's name in it.
            options: Compiler options.

        Returns:
            The kernel.
        """
        backend = self._info.backend if self._info else "opencl"
        fmt = ModuleFormat.CUDA_C if backend == "cuda" else ModuleFormat.OPENCL_C
        return self.get_kernel(self.load_module(source, fmt, options), name)

    def load_module(self, image: str | bytes, format: ModuleFormat, options: Sequence[str] = ()) -> Module:
        """Load a module in the tenant's worker (within the broker's `max_module_bytes` and
        `compile_timeout_seconds`). See [GpuCompute.load_module][gpubroker.client.GpuCompute.load_module].

        Args:
            image: Source text or a binary image.
            format: What `image` is.
            options: Compiler options for source.

        Returns:
            The module and its kernels' names.
        """
        raw = image.encode() if isinstance(image, str) else bytes(image)
        resp = self._call("LoadModule", pb.LoadModuleRequest(session=self._session, format=_FORMATS[format],
                                                              image=raw, options=list(options)))
        return Module(resp.handle, tuple(resp.kernel_names))

    def get_kernel(self, module: Module, name: str) -> Kernel:
        """Take a kernel from a module of this session.
        See [GpuCompute.get_kernel][gpubroker.client.GpuCompute.get_kernel].

        Args:
            module: The module.
            name: The kernel's name.

        Returns:
            The kernel.
        """
        resp = self._call("GetKernel", pb.GetKernelRequest(session=self._session, module=module.handle, name=name))
        return Kernel(resp.handle, resp.name)

    def execute_kernel(self, kernel: Kernel, grid: int | Sequence[int], block: int | Sequence[int],
                       args: Sequence[object], shared_mem: int = 0, stream: Stream | None = None) -> None:
        """Launch a kernel. The argument types are checked here (a bare Python number raises `ArgumentTypeError`
        at once); the worker checks the rest, so without `async_commands` the call raises what it finds, with
        them the next wait does. Launches take fair-scheduling turns with other tenants' work. See
        [GpuCompute.execute_kernel][gpubroker.client.GpuCompute.execute_kernel].

        Args:
            kernel: The kernel.
            grid: Blocks per dimension.
            block: Threads per block.
            args: Buffers and NumPy scalars.
            shared_mem: Bytes of dynamic shared memory per block.
            stream: The stream the launch is queued on; None for the default stream.
        """
        # The hot path of asynchronous work: arguments of the types seen before are converted in one pass (a
        # type test each); anything else takes the full check, which says what is wrong.
        wire = _wire_args(args) if type(args) is list or type(args) is tuple else None
        if wire is None:
            checked = check_kernel_args(args)
            wire = [BufferArg(*_ref(a)) if isinstance(a, Buffer) else _scalar(a) for a in checked]
        if type(kernel) is not Kernel:
            raise InvalidArgument(f"expected a Kernel, got {type(kernel).__name__}")
        if type(shared_mem) is not int or shared_mem < 0:
            _check_counts(shared_mem=shared_mem)
        handle = kernel.handle if type(kernel.handle) is str and 0 < len(kernel.handle) <= MAX_HANDLE \
            else _handle(kernel.handle, "kernel")
        self._command(Launch(handle, normalize_dims(grid, "grid"), normalize_dims(block, "block"), wire, shared_mem,
                             _stream(stream) if stream is not None else ""))

    def run_library(self, op: str, inputs: Sequence[ArrayRef], outputs: Sequence[ArrayRef],
                    params: Mapping[str, object] | None = None, stream: Stream | None = None) -> None:
        """Run a library operation in the tenant's worker. The call is checked here against the op table (a
        mistake raises at once); the worker checks it again against the real allocations. See
        [GpuCompute.run_library][gpubroker.client.GpuCompute.run_library].

        Args:
            op: The operation's name.
            inputs: The input arrays.
            outputs: The output arrays.
            params: The op's parameters.
            stream: The stream it is queued on; None for the default stream.
        """
        # Checked here too (the table is pure): a mistake raises at the call, not at the next synchronize, and
        # only what encodes is sent. The worker checks again against the real allocations.
        ins, outs, checked = check_library_call(op, inputs, outputs, params)
        self._command(RunLibrary(op, [_library_array(r) for r in ins], [_library_array(r) for r in outs], checked,
                                 _stream(stream) if stream is not None else ""))

    # The torch device's commands. What only changes the worker's tables or queues device work is always queued
    # (its error raised by the next waiting call), whatever async_commands says: the torch device issues one per
    # operator, and PyTorch users expect CUDA's asynchronous errors. What returns something waits.
    def torch_op(self, op: TorchOp) -> None:
        """Queue one PyTorch operator on the session's tensors (always queued: its error is raised by the next
        waiting call). See [GpuCompute.torch_op][gpubroker.client.GpuCompute.torch_op].

        Args:
            op: The operator.
        """
        if not isinstance(op, TorchOp):
            raise InvalidArgument(f"torch_op takes a TorchOp, got {type(op).__name__}")
        if not torch_allowed(op.name):
            raise Unimplemented(f"the torch operator {op.name!r:.140} is not on the broker's allowlist")
        self.transport.submit(op)

    @_abandons_on_interrupt
    def torch_op_sync(self, op: TorchOpSync) -> OpResult:
        """Run one PyTorch operator and wait for what it returned. See
        [GpuCompute.torch_op_sync][gpubroker.client.GpuCompute.torch_op_sync].

        Args:
            op: The operator.

        Returns:
            Per return, a tensor's metadata or a plain value.
        """
        if not isinstance(op, TorchOpSync):
            raise InvalidArgument(f"torch_op_sync takes a TorchOpSync, got {type(op).__name__}")
        if not torch_allowed(op.name):
            raise Unimplemented(f"the torch operator {op.name!r:.140} is not on the broker's allowlist")
        # (the Ack's result arrives as plain msgpack values: lists where the metadata's tuples were)
        result: OpResult = msgspec.convert(self.transport.call(op), OpResult)
        return result

    def torch_from_buffer(self, handle: str, buf: Buffer, meta: TensorMeta, stream: Stream | None = None) -> None:
        """Queue a new tensor made from a buffer's bytes. See
        [GpuCompute.torch_from_buffer][gpubroker.client.GpuCompute.torch_from_buffer].

        Args:
            handle: The new tensor's handle.
            buf: The buffer view holding its elements.
            meta: Its dtype name and shape (strides and offset ignored).
            stream: The stream the copy is ordered on.
        """
        self.transport.submit(TorchFromBuffer(_handle(handle, "tensor"), _ref(buf), meta, _stream(stream)))

    def torch_to_buffer(self, handle: str, buf: Buffer, stream: Stream | None = None) -> None:
        """Queue a tensor's elements into a buffer. See
        [GpuCompute.torch_to_buffer][gpubroker.client.GpuCompute.torch_to_buffer].

        Args:
            handle: The tensor.
            buf: The destination buffer view.
            stream: The stream the copy is ordered on.
        """
        self.transport.submit(TorchToBuffer(_handle(handle, "tensor"), _ref(buf), _stream(stream)))

    @_abandons_on_interrupt
    def torch_read(self, handle: str, stream: Stream | None = None) -> bytes:
        """A small tensor's elements, at once (waits). See
        [GpuCompute.torch_read][gpubroker.client.GpuCompute.torch_read].

        Args:
            handle: The tensor.
            stream: The stream the read is ordered on.

        Returns:
            The elements' bytes, row-major.
        """
        return bytes(self.transport.call(TorchRead(_handle(handle, "tensor"), _stream(stream))))

    def torch_free(self, handles: Sequence[str]) -> None:
        """Queue dropping tensors. See [GpuCompute.torch_free][gpubroker.client.GpuCompute.torch_free].

        Args:
            handles: The tensors' handles.
        """
        checked = [_handle(h, "tensor") for h in handles]
        for start in range(0, len(checked), 4096):  # (a command carries at most 4096)
            self.transport.submit(TorchFree(checked[start:start + 4096]))

    def torch_seed(self, seed: int) -> None:
        """Queue seeding the device's generator. See [GpuCompute.torch_seed][gpubroker.client.GpuCompute.torch_seed].

        Args:
            seed: Any int64 or uint64.
        """
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not -(1 << 63) <= seed < 1 << 64:
            raise InvalidArgument(f"a seed is an int64 or uint64, got {seed!r:.80}")
        self.transport.submit(TorchSeed(int(seed)))

    def create_stream(self) -> Stream:
        """Create a stream (queued with `async_commands`).
        See [GpuCompute.create_stream][gpubroker.client.GpuCompute.create_stream].

        Returns:
            The stream.
        """
        handle = new_handle("stream")
        self._command(CreateStream(handle))
        return Stream(handle)

    def destroy_stream(self, stream: Stream) -> None:
        """Finish and destroy a stream; always a round trip.
        See [GpuCompute.destroy_stream][gpubroker.client.GpuCompute.destroy_stream].

        Args:
            stream: The stream.
        """
        self.transport.call(DestroyStream(_stream_ref(stream)))

    @_abandons_on_interrupt
    def synchronize(self, stream: Stream | None = None, *, timeout: float | None = None) -> None:
        """Wait for the device: one round trip carrying whatever is still queued. See
        [GpuCompute.synchronize][gpubroker.client.GpuCompute.synchronize].

        Args:
            stream: The stream to wait for; None for all of the session's.
            timeout: Seconds this wait may take; None: the session's `timeout`.

        Raises:
            DeadlineExceeded: The work did not finish within ``timeout``. It goes on running and the session stays
                usable: wait again (with a longer timeout), or `cancel()` to abandon it.
            KeyboardInterrupt: Ctrl-C during the wait: the session's work is abandoned and the session ended first,
                as by `cancel()` (so in a notebook, an interrupted wait ends the session: open a new one).
        """
        # One round trip carrying what is queued and the sync; an asynchronous command's error surfaces here.
        self.transport.call(Synchronize(_stream(stream)), _timeout(timeout))

    # Events are commands like stream creation: queued with async_commands, the handle chosen here.
    def create_event(self) -> Event:
        """Create an event (queued with `async_commands`).
        See [GpuCompute.create_event][gpubroker.client.GpuCompute.create_event].

        Returns:
            The event.
        """
        handle = new_handle("event")
        self._command(CreateEvent(handle))
        return Event(handle)

    def record_event(self, event: Event, stream: Stream | None = None) -> None:
        """Record an event (queued with `async_commands`).
        See [GpuCompute.record_event][gpubroker.client.GpuCompute.record_event].

        Args:
            event: The event.
            stream: The stream to mark; None for the default stream.
        """
        self._command(RecordEvent(_event_ref(event), _stream(stream)))

    def wait_event(self, event: Event, stream: Stream | None = None) -> None:
        """Make a stream wait for an event, on the device (queued with `async_commands`). See
        [GpuCompute.wait_event][gpubroker.client.GpuCompute.wait_event].

        Args:
            event: The event.
            stream: The stream that waits; None for the default stream.
        """
        self._command(WaitEvent(_event_ref(event), _stream(stream)))

    @_abandons_on_interrupt
    def synchronize_event(self, event: Event, *, timeout: float | None = None) -> None:
        """Wait on the host for an event; always a round trip.
        See [GpuCompute.synchronize_event][gpubroker.client.GpuCompute.synchronize_event].

        Args:
            event: The event.
            timeout: Seconds this wait may take; None: the session's `timeout`.

        Raises:
            DeadlineExceeded: The event was not reached within ``timeout``; the session stays usable, as for
                `synchronize`.
        """
        # The host waits: one round trip carrying what is queued, as synchronize.
        self.transport.call(SynchronizeEvent(_event_ref(event)), _timeout(timeout))

    def destroy_event(self, event: Event) -> None:
        """Destroy an event (queued with `async_commands`).
        See [GpuCompute.destroy_event][gpubroker.client.GpuCompute.destroy_event].

        Args:
            event: The event.
        """
        self._command(DestroyEvent(_event_ref(event)))

    def close(self) -> None:
        """End the session (the broker frees its buffers, modules and streams) and the channel.

        Commands still queued in the client are dropped (those already sent may run, and the close waits for
        them): `synchronize()` first to have them all run and see their errors, or `cancel()` to abandon them.
        Never raises for a session that is already gone; closing twice does nothing. Leaving a `with` block
        calls it (`cancel` if the block raised, Ctrl-C's KeyboardInterrupt included).
        """
        self._end(cancel=False)

    def cancel(self) -> None:
        """Abandon the session's work and end the session, without waiting for the work.

        Commands still queued in the client are dropped; the broker ends the session, and if its work still
        runs a second later (a long kernel, or work queued before it) it stops the session's worker, unless the
        tenant's other sessions on the device use that worker too (then the work finishes there, unwaited for).
        The work's device time up to then is charged to the tenant as usual. The RemoteGpu is closed afterwards:
        open a new session to go on; the next one does not wait behind the abandoned work. Never raises for a
        session that is already gone.
        """
        self._end(cancel=True)

    def _end(self, cancel: bool) -> None:
        if self._closed.is_set():
            return
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        try:
            if self._session:
                # (a cancel waits for no work: the broker's grace and a worker's stop, not the session's timeout)
                self._call("CloseSession", pb.CloseSessionRequest(session=self._session, cancel=cancel),
                           timeout=min(self.timeout or _CANCEL_TIMEOUT, _CANCEL_TIMEOUT) if cancel else None)
        except GpuBrokerError:
            pass  # already gone (expired, worker lost): nothing left to free
        finally:
            self._closed.set()
            self._channel.close()
            if self._shm is not None:
                self._shm.close()

    def __enter__(self) -> RemoteGpu:
        """Open the session if it is not open yet (`initialize`); the block gets this RemoteGpu."""
        self.initialize()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        """End the session on leaving the block: `close()`, or `cancel()` if the block raised (Ctrl-C in a long
        `synchronize()` leaves at once, abandoning the work, instead of waiting for it in the close)."""
        self._end(cancel=kind is not None)


# How long a cancel waits for the broker's answer: its grace for the work (1 s) and a worker's stop, with room.
_CANCEL_TIMEOUT = 15.0


def _timeout(value: object) -> float | None:
    """A call's own time limit, checked (a bad one raises before anything is sent)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise InvalidArgument(f"timeout must be a positive number of seconds or None, got {value!r:.80}")
    return float(value)


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


def _library_array(ref: ArrayRef) -> LibraryArray:
    """A checked ArrayRef (``check_library_call``: a Buffer of int offset) as RunLibrary carries it; only its
    handle is left to check."""
    buf = ref.buffer
    handle = buf.handle
    if type(handle) is not str or not 0 < len(handle) <= MAX_HANDLE:
        handle = _handle(handle, "buffer")  # (raises)
    return (handle, buf.offset), ref.dtype, ref.shape


def _stream_ref(stream: Stream) -> str:
    if not isinstance(stream, Stream):
        raise InvalidArgument(f"expected a Stream, got {type(stream).__name__}")
    return _stream(stream)


# A NumPy scalar type's dtype.str (built as a new string at each read) and how its bytes are made: by struct for
# integers, bools and float64, whose values convert exactly (``tobytes`` on a NumPy scalar costs ~0.9 us, most of
# a launch argument's cost; a generated reduction passes seven); by ``tobytes`` for the rest (float32 through a
# double could change a NaN's payload).
_SCALAR_CODES: dict[type, tuple[str, Callable[[Any], bytes]]] = {}
_PACKED = {("i", 1): "<b", ("i", 2): "<h", ("i", 4): "<i", ("i", 8): "<q", ("u", 1): "<B", ("u", 2): "<H",
           ("u", 4): "<I", ("u", 8): "<Q", ("b", 1): "<?", ("f", 8): "<d"}


def _wire_args(args: Sequence[object]) -> list[KernelArg] | None:
    """Kernel arguments as a launch carries them, where each is a plain Buffer with a well-formed handle and
    offset or a NumPy scalar of a type ``_scalar`` accepted before (only those are in _SCALAR_CODES); None for
    anything else, which then takes ``check_kernel_args`` (and its error)."""
    wire: list[KernelArg] = []
    for arg in args:
        kind = type(arg)
        known = _SCALAR_CODES.get(kind)
        if known is not None:
            wire.append(ScalarArg(known[0], known[1](arg)))
        elif kind is Buffer:
            name, offset = arg.handle, arg.offset  # type: ignore[attr-defined]
            if type(name) is not str or not 0 < len(name) <= MAX_HANDLE or type(offset) is not int or offset < 0:
                return None
            wire.append(BufferArg(name, offset))
        else:
            return None
    return wire


def _scalar(value: np.generic) -> ScalarArg:
    known = _SCALAR_CODES.get(type(value))
    if known is None:
        dtype = value.dtype
        if dtype.itemsize > 8:  # (long double): no device takes it by value
            raise InvalidArgument(f"a kernel scalar is at most 8 bytes, got {dtype} ({dtype.itemsize})")
        fmt = _PACKED.get((dtype.kind, dtype.itemsize)) if dtype.byteorder in "=|<" and sys.byteorder == "little" \
            else None
        known = _SCALAR_CODES[type(value)] = (dtype.str, struct.Struct(fmt).pack if fmt else np.generic.tobytes)
    return ScalarArg(known[0], known[1](value))
