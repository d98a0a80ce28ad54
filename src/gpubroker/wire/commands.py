"""The command model: every device operation as one typed command with one binary encoding.

Client, front and worker share this module. A command is a msgspec Struct encoded as a msgpack array whose first
element is its tag (``["launch", kernel, grid, ...]``); a batch is a list of them with an id and the sequence
number of its first command, and every batch is answered by one ``Ack``. The same bytes travel on every
transport: a framed link (a Unix socket straight to the worker, TCP through the front, vsock), inside gRPC's
``Commands`` stream, and from the front to the worker for the typed gRPC calls, which the front turns into
these commands once.

Handles are named by the client (``new_handle``: random, scoped to the session), so an allocation, a free or a
stream's creation queues like a launch and a chain of operations never waits for a round trip. The worker
resolves them, per session, in one place.

A synchronous call is a batch whose last command returns its result; asynchronous commands ride in batches that
are acknowledged in order, and the first failure is reported by its sequence number and description, then
raised at the next synchronize (as CUDA reports an asynchronous error).
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, ClassVar, Final

import msgspec

from gpubroker.wire.errors import InvalidArgument

__all__ = [
    "Ack",
    "Allocate",
    "Batch",
    "BufferArg",
    "BufRef",
    "CODECS",
    "Command",
    "COMMANDS",
    "CommandError",
    "CopyD2D",
    "CopyShared",
    "CreateEvent",
    "CreateStream",
    "DestroyEvent",
    "DestroyStream",
    "DeviceInfoQuery",
    "Free",
    "GetKernel",
    "KernelArg",
    "LINK_COMMANDS",
    "Launch",
    "LoadModule",
    "MAX_HANDLE",
    "Memset",
    "Read",
    "RecordEvent",
    "RunLibrary",
    "ScalarArg",
    "Synchronize",
    "SynchronizeEvent",
    "UnloadModule",
    "WaitEvent",
    "Write",
    "decode_ack",
    "decode_batch",
    "encode",
    "new_handle",
    "parse_batch",
]

MAX_HANDLE: Final = 64  # characters; a longer handle is refused at decoding
Handle = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HANDLE)]
OptionalStream = Annotated[str, msgspec.Meta(max_length=MAX_HANDLE)]  # "" is the default stream
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Codec = Annotated[str, msgspec.Meta(max_length=16)]
# Codecs a link may negotiate for its bulk bytes (Write data, Read results): lz4 blocks, for slow links.
CODECS: Final = ("lz4",)
Dims = Annotated[tuple[int, ...], msgspec.Meta(min_length=1, max_length=3)]

# A buffer view: the allocation's handle and the view's offset into it (Buffer.handle, Buffer.offset).
BufRef = tuple[Handle, NonNegative]

_PREFIX = {"buf": "b", "stream": "s", "event": "e", "module": "m", "kernel": "k", "segment": "g"}


def new_handle(kind: str) -> str:
    """A fresh handle for a buffer, stream, event, module, kernel or segment: random (64 bits), so a handle one session
    names can never be guessed into another's, and the worker refuses one already in use in the session."""
    return f"{_PREFIX[kind]}{secrets.token_hex(8)}"


class _Struct(msgspec.Struct, array_like=True, frozen=True, gc=False, omit_defaults=False):
    pass


# -- kernel arguments ------------------------------------------------------------------------------
class BufferArg(_Struct, tag="b", frozen=True):
    """A pointer into an allocation: ``handle`` plus ``offset`` bytes (a Buffer view)."""

    handle: Handle
    offset: NonNegative = 0


class ScalarArg(_Struct, tag="s", frozen=True):
    """A scalar by value: a numpy dtype string ("<f4", "<i8", ...) and its bytes."""

    dtype: Annotated[str, msgspec.Meta(max_length=16)]
    value: Annotated[bytes, msgspec.Meta(max_length=8)]


KernelArg = BufferArg | ScalarArg


# -- commands --------------------------------------------------------------------------------------
class _Command(_Struct, tag_field="op", frozen=True):
    # True: the command may travel on a framed link straight to the worker (device work and the memory and
    # streams it uses). False: only through the front, which supervises it (a compile may need its time limit).
    link: ClassVar[bool] = True


class Allocate(_Command, tag="allocate", frozen=True):
    handle: Handle
    size: Annotated[int, msgspec.Meta(gt=0)]


class Free(_Command, tag="free", frozen=True):
    handle: Handle


class Memset(_Command, tag="memset", frozen=True):
    buf: BufRef
    value: Annotated[int, msgspec.Meta(ge=0, le=255)]
    size: int  # bytes from ``offset``; -1: to the end of the view
    offset: NonNegative = 0
    stream: OptionalStream = ""


class CopyD2D(_Command, tag="copy_d2d", frozen=True):
    src: BufRef
    dst: BufRef
    size: NonNegative
    src_offset: NonNegative = 0
    dst_offset: NonNegative = 0
    stream: OptionalStream = ""


class Launch(_Command, tag="launch", frozen=True):
    kernel: Handle
    grid: Dims
    block: Dims
    args: list[KernelArg]
    shared_mem: NonNegative = 0
    stream: OptionalStream = ""


class CreateStream(_Command, tag="create_stream", frozen=True):
    handle: Handle


class DestroyStream(_Command, tag="destroy_stream", frozen=True):
    handle: Handle


class Synchronize(_Command, tag="synchronize", frozen=True):
    stream: OptionalStream = ""  # "": the whole device (every stream of the session)


# Events order streams on the device: ``WaitEvent`` makes a stream wait, on the GPU, for what was queued before the
# event's last ``RecordEvent`` (no host blocks); ``SynchronizeEvent`` makes the host wait for it. An event never
# recorded is complete (CUDA's rule): waiting on it returns at once.
class CreateEvent(_Command, tag="create_event", frozen=True):
    handle: Handle


class DestroyEvent(_Command, tag="destroy_event", frozen=True):
    handle: Handle


class RecordEvent(_Command, tag="record_event", frozen=True):
    event: Handle
    stream: OptionalStream = ""


class WaitEvent(_Command, tag="wait_event", frozen=True):
    event: Handle
    stream: OptionalStream = ""


class SynchronizeEvent(_Command, tag="synchronize_event", frozen=True):
    event: Handle


class Write(_Command, tag="write", frozen=True):
    """Host to device: ``data`` into the view at ``offset`` (one chunk of a copy; large copies are several)."""

    buf: BufRef
    offset: NonNegative
    data: bytes
    stream: OptionalStream = ""
    # "lz4": ``data`` is an lz4 block (no stored size) that decompresses to exactly ``size`` bytes (slow links
    # only: a link that negotiated lz4); "" : ``data`` is the bytes as they are and ``size`` is unused.
    codec: Codec = ""
    size: NonNegative = 0


# A library operation's array: the buffer view, a NumPy dtype name, the shape (C-contiguous from the view).
LibraryArray = tuple[BufRef, Annotated[str, msgspec.Meta(max_length=16)],
                     Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, le=1 << 62)], ...], msgspec.Meta(max_length=32)]]
# Its params: int, float, bool, short str, None or a short list of ints (gpubroker/wire/library.py checks each's
# meaning).
LibraryParam = (int | float | bool | Annotated[str, msgspec.Meta(max_length=32)] | None
                | Annotated[list[int], msgspec.Meta(max_length=32)])


class RunLibrary(_Command, tag="run_library", frozen=True):
    """A library operation (matmul, linalg, fft, sort, unique, ...: gpubroker/wire/library.py's table) on arrays of the
    session; device work like a launch."""

    name: Annotated[str, msgspec.Meta(max_length=32)]  # the op ("linalg.svd"); ``op`` is the command's tag
    inputs: Annotated[list[LibraryArray], msgspec.Meta(max_length=8)]
    outputs: Annotated[list[LibraryArray], msgspec.Meta(max_length=8)]
    params: Annotated[dict[Annotated[str, msgspec.Meta(max_length=32)], LibraryParam], msgspec.Meta(max_length=16)] = {}
    stream: OptionalStream = ""


class Read(_Command, tag="read", frozen=True):
    """Device to host: ``size`` bytes of the view from ``offset``; the Ack's result is the bytes."""

    buf: BufRef
    offset: NonNegative
    size: NonNegative
    stream: OptionalStream = ""
    # The codec the client takes the result in ("lz4" where its link negotiated it): then the result is
    # ``[codec, data]`` (codec "" when compressing did not pay: data raw), else the bytes as they are.
    codec: Codec = ""


class CopyShared(_Command, tag="copy_shared", frozen=True):
    """Between a shared-memory segment (same host; registered through the front) and device memory."""

    segment: Handle
    segment_offset: NonNegative
    buf: BufRef
    offset: NonNegative
    size: NonNegative
    to_device: bool
    stream: OptionalStream = ""


class DeviceInfoQuery(_Command, tag="device_info", frozen=True):
    """The device as its runtime describes it, plus this worker's memory use; the Ack's result is a dict."""


class LoadModule(_Command, tag="load_module", frozen=True):
    """Compile or load ``image`` (source as UTF-8 bytes); the Ack's result is the module's kernel names."""

    link: ClassVar[bool] = False
    handle: Handle
    format: Annotated[str, msgspec.Meta(max_length=16)]  # a ModuleFormat value
    image: bytes
    options: list[str] = []


class UnloadModule(_Command, tag="unload_module", frozen=True):
    link: ClassVar[bool] = False
    handle: Handle


class GetKernel(_Command, tag="get_kernel", frozen=True):
    link: ClassVar[bool] = False
    handle: Handle  # the kernel's new handle
    module: Handle
    name: Annotated[str, msgspec.Meta(max_length=1024)]


Command = (Allocate | Free | Memset | CopyD2D | Launch | RunLibrary | CreateStream | DestroyStream | Synchronize
           | CreateEvent | DestroyEvent | RecordEvent | WaitEvent | SynchronizeEvent | Write | Read | CopyShared
           | DeviceInfoQuery | LoadModule | UnloadModule | GetKernel)
COMMANDS: Final[tuple[type[_Command], ...]] = (
    Allocate, Free, Memset, CopyD2D, Launch, RunLibrary, CreateStream, DestroyStream, Synchronize, CreateEvent,
    DestroyEvent, RecordEvent, WaitEvent, SynchronizeEvent, Write, Read, CopyShared, DeviceInfoQuery, LoadModule,
    UnloadModule, GetKernel)
LINK_COMMANDS: Final = frozenset(c for c in COMMANDS if c.link)


# -- batches and acknowledgements ------------------------------------------------------------------
class Batch(_Struct, frozen=True):
    """Commands to run in order. ``id`` is the sender's (acks come back in order, each naming its batch);
    ``first`` is the sequence number of its first command, by which a failure is reported."""

    id: int
    first: int
    commands: list[Command]


class CommandError(_Struct, frozen=True):
    """The first command of a batch that failed: its sequence number, what it was, and the error."""

    seq: int
    command: str  # "launch of 'scale'", "allocate of 4096 bytes", ...
    code: str  # a gRPC status name
    message: str
    type: str = ""  # the GpuBrokerError class name
    details: dict[str, Any] = {}


class Ack(_Struct, frozen=True):
    """A batch's answer: how many of its commands ran, the first failure (the rest did not run), and the result
    of its last command when that returns one (a Read's bytes, a device description, kernel names)."""

    id: int
    done: int
    error: CommandError | None = None
    result: Any = None


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(Batch)
_ack_decoder = msgspec.msgpack.Decoder(Ack)
encode = _encoder.encode  # Batch or Ack -> bytes: the one encoding


def decode_batch(data: bytes | bytearray | memoryview) -> Batch:
    """A batch from the wire; msgspec.ValidationError / DecodeError (both msgspec.DecodeError) if malformed."""
    try:
        return _batch_decoder.decode(data)
    except UnicodeDecodeError as exc:  # msgspec lets a str that is not UTF-8 through as this, not a DecodeError
        raise msgspec.DecodeError(f"malformed string: {exc}") from None


def parse_batch(data: bytes | bytearray | memoryview) -> Batch:
    """``decode_batch`` for a receiver that answers a malformed batch with an error: InvalidArgument naming why."""
    try:
        return _batch_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"malformed batch: {exc}") from None


def decode_ack(data: bytes | bytearray | memoryview) -> Ack:
    try:
        return _ack_decoder.decode(data)
    except UnicodeDecodeError as exc:
        raise msgspec.DecodeError(f"malformed string: {exc}") from None
