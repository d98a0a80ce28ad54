"""The GpuCompute Protocol: one interface, implemented in-process by backends and remotely by RemoteGpu."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from gpubroker.wire.host import HostBuffer
from gpubroker.wire.torch import OpResult, TensorMeta, TorchOp, TorchOpSync
from gpubroker.wire.types import ArrayRef, Buffer, DeviceInfo, Event, Kernel, Module, ModuleFormat, Stream

__all__ = ["GpuCompute"]


@runtime_checkable
class GpuCompute(Protocol):
    """Device operations: the SDK's one interface, the same on a broker's session and in-process.

    [`RemoteGpu`][gpubroker.client.RemoteGpu] (what [`connect`][gpubroker.client.connect] returns) implements it on
    a broker's session; `gpubroker.broker.backends.open_backend("cuda" | "opencl", device)` returns an in-process
    backend with the very same methods. Code written against `GpuCompute` runs on either, on CUDA or OpenCL.

    **Order.** Work runs in program order on each stream; `stream=None` is the default stream. Launches, memsets,
    device copies and library operations are asynchronous: they return once queued. Host copies return once the
    host memory has been read or written, after the work queued before them on their stream.

    **Errors** are [`GpuBrokerError`][gpubroker.client.GpuBrokerError] subclasses named after gRPC status codes.
    Arguments that are wrong on their face (a bare Python `int` as a kernel argument, a negative size, a copy past
    the end of its buffer) raise at the call. What the device or the worker finds later (a launch the kernel
    refuses, an allocation over the quota with `async_commands`, a fault in the kernel) is *deferred*: raised by
    the next call that waits for the device, which is [`synchronize`][gpubroker.client.GpuCompute.synchronize],
    [`synchronize_event`][gpubroker.client.GpuCompute.synchronize_event],
    [`destroy_stream`][gpubroker.client.GpuCompute.destroy_stream] or a host copy, with a message naming the
    command (`command 5 (launch of 'scale') failed: ...`).

    Any call on a broker's session may also raise:

    - [`WorkerCrashed`][gpubroker.client.WorkerCrashed]: the tenant's worker process died; the session's device
      state is gone. Open a new session.
    - [`DeadlineExceeded`][gpubroker.client.DeadlineExceeded]: no answer within the session's `timeout`; or the
      tenant's device work ran past the broker's kernel time limit, or a compile past its compile time limit, and
      the worker was restarted (the session's device state is gone: open a new session).
    - [`Unavailable`][gpubroker.client.Unavailable]: the broker or the connection to it is gone. Retry, on
      another broker if need be.
    - [`NotFound`][gpubroker.client.NotFound] naming the session: it ended (closed, its lease expired, ended by
      an operator, or the broker restarted). Open a new session.
    - [`Unauthenticated`][gpubroker.client.Unauthenticated]: the token was rotated or its tenant removed.
      Reconnect with the current token.

    Sizes and offsets are in bytes. `grid` is blocks (OpenCL work-groups) per dimension and `block` is threads
    (work-items) per block, everywhere.
    """

    def initialize(self) -> None:
        """Open the device: the session on a broker, the context in-process.

        [`connect`][gpubroker.client.connect] and `open_backend` call it; call it yourself only on a `RemoteGpu`
        constructed directly. On a `RemoteGpu` a second call does nothing.

        Raises:
            Unauthenticated: the token is missing, wrong or revoked (or the client certificate names no tenant).
            NotFound: the broker has no such device (the message says how many it serves).
            Unavailable: the broker cannot be reached, is draining, or the device does not serve new sessions
                (its workers keep failing), or the tenant crashed its workers too often lately. Retry later or on
                another broker; `exc.details["retry_after_seconds"]` says when, where waiting helps.
            ResourceExhausted: the tenant already has as many sessions as the broker allows
                (`max_sessions_per_tenant`; close one), or, with no device named, has used its whole memory quota
                on every serving device.
            FailedPrecondition: this object was closed; or, in-process, the device's runtime library is missing.
        """
        ...

    def device_info(self) -> DeviceInfo:
        """What the device is and can do, read now.

        Returns:
            The device's name, backend (`"cuda"` or `"opencl"`), memory, limits and clock. On a broker, also the
                tenant's memory quota, use and room on this device and the device's health; those fields are
                `None` in-process.

        Raises:
            FailedPrecondition: this object is closed, or not initialized.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def allocate_memory(self, size: int) -> Buffer:
        """Allocate `size` bytes of device memory; its contents are undefined until written.

        On a broker every allocation counts against the tenant's memory quota on this device until it is freed
        or the session ends. With `async_commands` the allocation is queued like a launch: the `Buffer` comes back
        at once, and a refusal is raised at the next wait (later uses of the buffer then raise `NotFound`).

        Args:
            size: The number of bytes, > 0 (an `int` or a NumPy integer).

        Returns:
            The new allocation, a view at offset 0 of `size` bytes.

        Raises:
            InvalidArgument: `size` is not an integer, or is <= 0.
            ResourceExhausted: the allocation would take the tenant past its memory quota on this device (the
                message and `exc.details` give `quota`, `used` and `requested`); or the device has not that much
                memory free; or the session holds as many handles as the broker allows. Free memory, or ask the
                operator for a larger quota.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def free_memory(self, buf: Buffer) -> None:
        """Free an allocation; its handle, and every view of it, is invalid afterwards.

        Queued like a launch with `async_commands` (its error deferred to the next wait). An allocation queued
        that way which failed (its error raised at a wait) or never ran (a failure earlier in its batch) is freed
        by sending nothing, as `cudaFree` of a failed `cudaMalloc`'s null pointer.

        Args:
            buf: The allocation, or any view of it.

        Raises:
            NotFound: `buf` names no live allocation of this session: never allocated here, already freed, or
                another session's (all three read alike).
            FailedPrecondition: a [`copy_peer`][gpubroker.client.copy_peer] is reading or writing the buffer.
            InvalidArgument: `buf` is not a `Buffer`.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def copy_h2d(self, src: HostBuffer, buf: Buffer, offset: int = 0,
                 stream: Stream | None = None) -> None:
        """Copy all of `src` into `buf` starting `offset` bytes into it; returns once `src` is consumed.

        The copy runs after the work queued before it on `stream`; when the call returns, `src` may be reused.
        The range is checked before any byte moves, so a refused copy writes nothing.

        Args:
            src: Host memory to read: any C-contiguous object with the buffer protocol
                ([HostBuffer][gpubroker.client.HostBuffer]: a NumPy array, `bytes`, `bytearray`, `memoryview`).
                On the same host, an array from [`RemoteGpu.host_array`][gpubroker.client.RemoteGpu.host_array]
                is copied without passing through a socket.
            buf: The destination allocation or view.
            offset: Where to start writing, in bytes from the view's start.
            stream: The stream the copy is ordered on; `None` for the default stream.

        Raises:
            OutOfRange: `offset + len(src)` runs past the end of the allocation.
            InvalidArgument: a negative `offset`; `src` without the buffer protocol, or not C-contiguous.
            NotFound: `buf` (or `stream`) names nothing live in this session.
            GpuBrokerError: an earlier command's deferred error (this copy then may not have run: handle the
                error and copy again), or any error every call may raise
                (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def copy_d2h(self, buf: Buffer, dst: HostBuffer, offset: int = 0,
                 stream: Stream | None = None) -> None:
        """Fill the writable `dst` from `buf` starting `offset` bytes into it; returns once `dst` is full.

        The copy runs after the work queued before it on `stream`, so it reads what earlier launches wrote.

        Args:
            buf: The source allocation or view.
            dst: Writable host memory, C-contiguous ([HostBuffer][gpubroker.client.HostBuffer]: a NumPy array,
                `bytearray`, a writable `memoryview`); exactly `len(dst)` bytes are read.
            offset: Where to start reading, in bytes from the view's start.
            stream: The stream the copy is ordered on; `None` for the default stream.

        Raises:
            OutOfRange: `offset + len(dst)` runs past the end of the allocation.
            InvalidArgument: `dst` is read-only (`bytes`), not C-contiguous or has no buffer protocol; a negative
                `offset`.
            NotFound: `buf` (or `stream`) names nothing live in this session.
            GpuBrokerError: an earlier command's deferred error (`dst` then may not have been filled), or any
                error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def copy_d2d(self, src: Buffer, dst: Buffer, size: int, src_offset: int = 0, dst_offset: int = 0,
                 stream: Stream | None = None) -> None:
        """Copy `size` bytes between two device buffers (or two ranges of one); asynchronous, like a launch.

        Args:
            src: The source allocation or view.
            dst: The destination allocation or view (it may be `src`).
            size: The number of bytes, >= 0.
            src_offset: Where to start reading, in bytes from `src`'s view start.
            dst_offset: Where to start writing, in bytes from `dst`'s view start.
            stream: The stream the copy is queued on; `None` for the default stream.

        Raises:
            OutOfRange: either range runs past the end of its allocation.
            InvalidArgument: a negative size or offset; on OpenCL, overlapping ranges of one allocation.
            NotFound: `src`, `dst` or `stream` names nothing live in this session.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
                On a broker the errors above are raised by the call, or with `async_commands` by the next wait.
        """
        ...

    def memset(self, buf: Buffer, value: int, size: int | None = None, offset: int = 0,
               stream: Stream | None = None) -> None:
        """Set `size` bytes (default: to the end) to the byte `value`; asynchronous, like a launch.

        Args:
            buf: The allocation or view to fill.
            value: The byte, 0 to 255.
            size: How many bytes; `None` for every byte from `offset` to the end of the allocation.
            offset: Where to start, in bytes from the view's start.
            stream: The stream the fill is queued on; `None` for the default stream.

        Raises:
            InvalidArgument: `value` is not a byte (0..255); a negative `size` or `offset`.
            OutOfRange: `offset + size` runs past the end of the allocation.
            NotFound: `buf` or `stream` names nothing live in this session.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
                On a broker the errors above are raised by the call, or with `async_commands` by the next wait.
        """
        ...

    def compile_kernel(self, source: str, name: str, options: Sequence[str] = ()) -> Kernel:
        """Compile kernel source for this device and return one of its kernels.

        The source language is the device's: CUDA C (compiled by NVRTC; declare kernels `extern "C"` so their
        names are not mangled) when `device_info().backend` is `"cuda"`, OpenCL C when it is `"opencl"`. The same
        as [`load_module`][gpubroker.client.GpuCompute.load_module] then
        [`get_kernel`][gpubroker.client.GpuCompute.get_kernel].

        Args:
            source: The kernel source.
            name: The kernel's name in the source.
            options: Compiler options, such as `["-DN=256"]`.

        Returns:
            The kernel, to pass to [`execute_kernel`][gpubroker.client.GpuCompute.execute_kernel].

        Raises:
            CompileError: the source did not compile; `exc.log` holds the compiler's output. Fix the source.
            NotFound: the source has no kernel `name` (on CUDA: is it `extern "C"`?).
            InvalidArgument: empty source, or options that are not strings.
            ResourceExhausted: the source is larger than the broker's `max_module_bytes`.
            DeadlineExceeded: the compile ran past the broker's `compile_timeout_seconds`; the tenant's worker
                was restarted and this session's device state is gone (open a new session).
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def load_module(self, image: str | bytes, format: ModuleFormat, options: Sequence[str] = ()) -> Module:
        """Load a module (source to compile, or a binary image) and list its kernels.

        Args:
            image: Source text, or the bytes of a binary image.
            format: What `image` is: [`ModuleFormat.OPENCL_C`][gpubroker.client.ModuleFormat] on OpenCL;
                `CUDA_C`, `PTX`, `CUBIN` or `FATBIN` on CUDA.
            options: Compiler options for source formats (NVRTC's or the OpenCL compiler's).

        Returns:
            The module, with the names of its kernels where the backend can list them; take kernels from it with
                [`get_kernel`][gpubroker.client.GpuCompute.get_kernel].

        Raises:
            CompileError: source that did not compile; `exc.log` holds the compiler's output.
            InvalidArgument: a format this device's backend does not load (PTX on OpenCL, OpenCL C on CUDA), an
                empty or malformed image, or source that is not UTF-8.
            ResourceExhausted: the image is larger than the broker's `max_module_bytes`.
            DeadlineExceeded: the compile ran past the broker's `compile_timeout_seconds`; the tenant's worker
                was restarted and this session's device state is gone (open a new session).
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def get_kernel(self, module: Module, name: str) -> Kernel:
        """Take the kernel `name` from a loaded module.

        Args:
            module: A module from [`load_module`][gpubroker.client.GpuCompute.load_module].
            name: The kernel's name.

        Returns:
            The kernel, to pass to [`execute_kernel`][gpubroker.client.GpuCompute.execute_kernel].

        Raises:
            NotFound: the module has no kernel `name` (the message lists the ones it has), or `module` names no
                module of this session.
            InvalidArgument: `module` is not a `Module`.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def execute_kernel(self, kernel: Kernel, grid: int | Sequence[int], block: int | Sequence[int],
                       args: Sequence[object], shared_mem: int = 0, stream: Stream | None = None) -> None:
        """Launch `kernel` on `grid` blocks of `block` threads; asynchronous: returns once queued.

        The launch runs after the work queued before it on `stream`. Its results are read with a host copy
        (which waits for it) or after [`synchronize`][gpubroker.client.GpuCompute.synchronize].

        Args:
            kernel: A kernel from [`compile_kernel`][gpubroker.client.GpuCompute.compile_kernel] or
                [`get_kernel`][gpubroker.client.GpuCompute.get_kernel].
            grid: Blocks (OpenCL work-groups) per dimension: an int, or 1 to 3 ints (x, y, z).
            block: Threads (work-items) per block: an int, or 1 to 3 ints.
            args: The kernel's arguments in order: a [`Buffer`][gpubroker.client.Buffer] for each pointer
                parameter (a view made with [`Buffer.at`][gpubroker.client.Buffer.at] passes a pointer into the
                allocation; on OpenCL its offset must be a multiple of the device's base-address alignment), and a
                NumPy scalar (`np.int32(n)`, `np.float32(a)`) of the parameter's width for each value parameter.
            shared_mem: Bytes of dynamic shared memory per block. CUDA kernels read it as `extern __shared__`;
                OpenCL kernels take it as their last parameter, a `__local` pointer the backend supplies (the
                caller does not pass it).
            stream: The stream the launch is queued on; `None` for the default stream.

        Raises:
            ArgumentTypeError: an argument is a bare Python `int`, `float` or `bool` (its width is ambiguous:
                pass `np.int32(...)` or the like) or of another type; or, found by the kernel's parameters, a
                scalar of the wrong width or a Buffer where a value is expected. Fix the arguments.
            InvalidArgument: `grid` or `block` is not 1 to 3 positive ints; the block or grid exceeds the device's
                limits; the kernel takes another number of arguments; negative `shared_mem`.
            NotFound: `kernel`, a buffer argument or `stream` names nothing live in this session.
            Aborted: on CUDA, the kernel faulted (an illegal address, a trap) and corrupted the device context,
                raised at the next wait; the worker then restarts and the session's later calls raise
                `WorkerCrashed`. Fix the kernel and open a new session.
            DeadlineExceeded: the tenant's device work held the device past the broker's kernel time limit
                (`max_kernel_seconds`) while others waited; its worker was killed. Open a new session.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
                What the worker or the device finds is raised by the call, or with `async_commands` (and
                in-process, for faults inside the kernel) by the next wait.
        """
        ...

    def run_library(self, op: str, inputs: Sequence[ArrayRef], outputs: Sequence[ArrayRef],
                    params: Mapping[str, object] | None = None, stream: Stream | None = None) -> None:
        """Run the library operation `op` on `inputs`, writing `outputs`; asynchronous, like a launch.

        The operations are matmul, `linalg.*`, `fft.*`, sort, argsort, searchsorted, cumulative sums and
        products, unique and nonzero: the table is [`LIBRARY_OPS`][gpubroker.client.LIBRARY_OPS]. They run in the
        tenant's worker on the device's libraries (cuBLAS, cuSOLVER, cuFFT through CuPy on CUDA; NumPy on PoCL's
        host device). The array namespace ([`namespace`][gpubroker.client.array.namespace]) uses them; call this
        directly for arrays of your own.

        Every array is C-contiguous from its buffer view's offset. The caller allocates the outputs with exactly
        the dtypes and shapes [`library_outputs(op, [(dtype, shape), ...], params)`][gpubroker.client.library_outputs]
        gives. Outputs must not overlap inputs.

        Args:
            op: The operation's name, a key of `LIBRARY_OPS` (`"matmul"`, `"linalg.inv"`, `"fft.rfft"`, ...).
            inputs: The input arrays, as many as the op takes.
            outputs: The output arrays, exactly as `library_outputs` gives them.
            params: The op's parameters (ints, floats, bools, strs, None or lists of ints); missing ones take
                their defaults.
            stream: The stream the operation is queued on; `None` for the default stream.

        Raises:
            InvalidArgument: naming the op: an unknown op or param, a wrong number of arrays, a dtype or shape
                the op does not take, outputs other than `library_outputs` gives, an array that overruns its
                buffer, a param out of range, or input the op refuses (a singular matrix to `linalg.inv` where the
                library reports it). Checked at the call; what only the data shows, at the next wait.
            ResourceExhausted: the library ran out of device memory for its temporaries.
            NotFound: a buffer or `stream` names nothing live in this session.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def torch_op(self, op: TorchOp) -> None:
        """Run one PyTorch ATen operator on the session's tensors; queued, like a launch.

        The torch device (`gpubroker.client.torch`) calls this for each operator; call it directly only to drive
        the worker's PyTorch yourself. The worker runs `torch.ops.aten.<name>.<overload>` with the real PyTorch
        on the device (CUDA tensors on the session's stream on CUDA; PyTorch's CPU kernels on PoCL, whose device
        is the host CPU) and keeps each new output under the handle `op.outs` names. Before it runs, the new
        outputs' bytes (from `op.metas`) are reserved against the tenant's memory quota; a view shares its base's
        storage and costs nothing more. On a broker the command is always queued: its errors are raised by the
        next call that waits.

        Args:
            op: The operator (`gpubroker.wire.torch.TorchOp`): its overload name, which must be on the
                allowlist (`gpubroker.wire.torch_ops.ALLOWED`), its arguments (tensors by handle), a handle per
                new output (None where the return is an input or no tensor) and each new output's metadata.

        Raises:
            Unimplemented: the operator is not on the allowlist (or not in the worker's PyTorch); or PyTorch has
                no kernel for these arguments (`exc.details["torch_error"]` is `"NotImplementedError"`).
            InvalidArgument: PyTorch refused the operator (a shape mismatch, a dtype error, an index out of
                range): the message is PyTorch's, `exc.details["torch_error"]` its exception's class name
                (`"RuntimeError"`, `"IndexError"`, ...). Also: an unknown dtype name, a handle already in use,
                a device or generator argument other than the torch device's own.
            ResourceExhausted: the new outputs would take the tenant past its memory quota on this device (the
                message names the operator); nothing was kept, and the session goes on.
            NotFound: an argument names no tensor of this session.
            Aborted: on CUDA, the operator broke the device context (a device-side assert); the worker restarts.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def torch_op_sync(self, op: TorchOpSync) -> OpResult:
        """Run one PyTorch operator whose outputs' shapes depend on the data, or that returns a value; waits.

        `nonzero`, `unique`, `masked_select`, `_local_scalar_dense` (`.item()`), `equal`: the ones in
        `gpubroker.wire.torch_ops.SYNC`. Its errors are `torch_op`'s, raised here (with any earlier queued
        command's first).

        Args:
            op: The operator (`gpubroker.wire.torch.TorchOpSync`): as for `torch_op`, with no metadata.

        Returns:
            One entry per return (per `op.outs`): a tensor's metadata (dtype name, shape, strides, storage offset),
                or the plain value returned (an int, float or bool).

        Raises:
            Unimplemented: the operator is not on the allowlist, or returns a value the device cannot carry back
                (a complex number).
            InvalidArgument: PyTorch refused the operator (`exc.details["torch_error"]` names its exception's
                class), or the arguments are malformed, as for `torch_op`.
            ResourceExhausted: the outputs would take the tenant past its memory quota (the message names the
                operator); nothing was kept.
            NotFound: an argument names no tensor of this session.
            GpuBrokerError: an earlier queued command's error, or any error every call may raise
                (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def torch_from_buffer(self, handle: str, buf: Buffer, meta: TensorMeta, stream: Stream | None = None) -> None:
        """A new contiguous tensor `handle` of `meta`'s dtype and shape, holding the bytes of `buf` (row-major);
        queued, like a device copy. Its bytes count against the tenant's memory quota.

        Args:
            handle: The new tensor's handle (unique in the session, buffers' and streams' included).
            buf: The buffer view holding the elements, from its offset.
            meta: `(dtype name, shape, strides, storage offset)`; the strides and offset are ignored (the new
                tensor is contiguous).
            stream: The stream the copy is ordered on; `None` for the default stream.

        Raises:
            OutOfRange: the buffer holds fewer bytes than the tensor needs.
            InvalidArgument: an unknown dtype name, or a handle already in use.
            ResourceExhausted: past the tenant's memory quota.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def torch_to_buffer(self, handle: str, buf: Buffer, stream: Stream | None = None) -> None:
        """Write tensor `handle`'s elements, row-major, into `buf` from its offset; queued, like a device copy.

        Args:
            handle: The tensor (a view is written as its logical elements, not its storage).
            buf: The destination buffer view.
            stream: The stream the copy is ordered on; `None` for the default stream.

        Raises:
            NotFound: `handle` names no tensor of this session.
            OutOfRange: the elements run past the end of the buffer.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def torch_read(self, handle: str, stream: Stream | None = None) -> bytes:
        """A small tensor's elements, row-major, at once (`.item()`, `print`); waits.

        Args:
            handle: The tensor.
            stream: The stream the read is ordered on; `None` for the default stream.

        Returns:
            The elements' bytes, at most `gpubroker.wire.torch.MAX_TORCH_READ` of them.

        Raises:
            OutOfRange: the tensor is larger than `MAX_TORCH_READ` bytes: copy it through a buffer instead.
            NotFound: `handle` names no tensor of this session.
            GpuBrokerError: an earlier queued command's error, or any error every call may raise
                (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def torch_free(self, handles: Sequence[str]) -> None:
        """Drop the session's tensors `handles`; queued. A storage is freed, and its bytes leave the tenant's quota,
        with the last tensor that uses it. A handle that names no tensor is skipped (the outputs of an operator
        that failed never existed).

        Args:
            handles: The tensors' handles.

        Raises:
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def torch_seed(self, seed: int) -> None:
        """Seed the device's generator, which the session's random operators draw from (`torch.manual_seed`);
        queued.

        Args:
            seed: Any int64 or uint64.

        Raises:
            InvalidArgument: `seed` is not an int, or out of range.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def create_stream(self) -> Stream:
        """Create a stream: a queue whose work runs in order, concurrently with other streams' work.

        Returns:
            The new stream, to pass as `stream=` to copies, launches and synchronize.

        Raises:
            ResourceExhausted: the session holds as many streams (or handles) as the broker allows
                (`max_streams_per_session`); destroy some.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def destroy_stream(self, stream: Stream) -> None:
        """Finish the stream's queued work, then destroy it; waits, so deferred errors surface here too.

        Args:
            stream: The stream; the default stream cannot be destroyed.

        Raises:
            NotFound: `stream` names no stream of this session (never created, or already destroyed).
            InvalidArgument: `stream` is not a `Stream`.
            GpuBrokerError: an earlier command's deferred error, or any error every call may raise
                (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def synchronize(self, stream: Stream | None = None) -> None:
        """Wait until the work queued so far is done: on `stream`, or on every stream of the session.

        This is where deferred errors surface: the first command that failed since the last wait (a launch the
        kernel refused, a fault inside a kernel, a queued allocation over the quota) is raised here as the error
        it was, its message naming the command (`exc.details["seq"]` and `["command"]`). Once raised it is
        cleared. Commands queued right after the failed one may have been skipped with it (the rest of its
        batch), while later ones ran: treat what they wrote as unknown.

        Args:
            stream: The stream to wait for; `None` waits for all of them.

        Raises:
            NotFound: `stream` names no stream of this session.
            GpuBrokerError: the first deferred error of earlier commands (any subclass: `InvalidArgument`,
                `NotFound`, `OutOfRange`, `ResourceExhausted`, `Aborted` ...), or any error every call may raise
                (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def create_event(self) -> Event:
        """Create an event: a mark in a stream's work that other streams or the host can wait for.

        Returns:
            The event, not yet recorded (an event never recorded counts as complete).

        Raises:
            ResourceExhausted: the session holds as many handles as the broker allows.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def record_event(self, event: Event, stream: Stream | None = None) -> None:
        """Mark the point reached by the work queued so far on `stream`; a later record moves the mark.

        Args:
            event: The event.
            stream: The stream to mark; `None` for the default stream.

        Raises:
            NotFound: `event` or `stream` names nothing live in this session.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def wait_event(self, event: Event, stream: Stream | None = None) -> None:
        """Make `stream`'s later work wait, on the device, for the event's mark; the host does not block.

        An event never recorded is complete.

        Args:
            event: The event.
            stream: The stream that waits; `None` for the default stream.

        Raises:
            NotFound: `event` or `stream` names nothing live in this session.
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def synchronize_event(self, event: Event) -> None:
        """Block the host until the event's mark is reached (at once if it was never recorded).

        It waits for the device, so deferred errors of earlier commands surface here too.

        Args:
            event: The event.

        Raises:
            NotFound: `event` names no event of this session.
            GpuBrokerError: an earlier command's deferred error, or any error every call may raise
                (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def destroy_event(self, event: Event) -> None:
        """Destroy an event; waits already queued on it still happen.

        Args:
            event: The event.

        Raises:
            NotFound: `event` names no event of this session (never created, or already destroyed).
            GpuBrokerError: any error every call may raise (see [GpuCompute][gpubroker.client.GpuCompute]).
        """
        ...

    def close(self) -> None:
        """Release everything: on a broker, end the session (the broker frees its buffers, modules, streams and
        events); in-process, free the device objects. Closing twice does nothing; a closed object raises
        `FailedPrecondition` on use. `with connect(...) as gpu:` closes on leaving the block."""
        ...
