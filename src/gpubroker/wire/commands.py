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

Each command declares its traits on its class (``Command``'s class variables): whether a link may carry it,
whether it is device work (a batch holding one waits for the tenant's turn), whether it works on the host's CPU,
the type of its result (which the front decodes a worker's answer as, and nothing else) and how a failure names
it. Defining the class registers it: the decoders, ``commands()`` and ``link_commands()`` take every registered
command, so a new operation is its class here, its handler in the worker and its backend method, and nothing else
(docs/architecture/adding-an-operation.md).
"""

from __future__ import annotations

import functools
import operator
import secrets
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Final, Generic, Optional

import msgspec
from typing_extensions import TypeVar

from gpubroker.wire import encoding
from gpubroker.wire.errors import GpuBrokerError, InvalidArgument, WireError
from gpubroker.wire.types import device_info_from_report

__all__ = [
    "Ack",
    "Allocate",
    "Batch",
    "BufferArg",
    "BufRef",
    "Bytes",
    "CODECS",
    "Command",
    "CommandError",
    "CopyD2D",
    "CopyShared",
    "CreateEvent",
    "CreateStream",
    "DestroyEvent",
    "DestroyStream",
    "DeviceInfoQuery",
    "DeviceReport",
    "Free",
    "GetKernel",
    "Handle",
    "KernelArg",
    "KernelNames",
    "Launch",
    "LoadModule",
    "MAX_FRONT_COMMANDS",
    "MAX_HANDLE",
    "READ_HEAD_MAX",
    "Memset",
    "NonNegative",
    "OptionalStream",
    "Read",
    "RecordEvent",
    "RunLibrary",
    "ScalarArg",
    "Synchronize",
    "SynchronizeEvent",
    "UnloadModule",
    "WaitEvent",
    "Write",
    "commands",
    "decode_ack",
    "decode_ack_for",
    "decode_read_ack",
    "decode_batch",
    "encode",
    "encode_ack_parts",
    "link_commands",
    "new_handle",
    "outline_batch",
    "parse_batch",
    "read_ack_head",
    "tag_of",
]

MAX_HANDLE: Final = 64  # characters; a longer handle is refused at decoding
# The most commands a batch through the front (gRPC's Commands stream) may hold: the front reads each one's outline
# on its event loop, so their number bounds that work. (A client sends at most 256 a batch; a link, straight to
# the worker, has no such limit.)
MAX_FRONT_COMMANDS: Final = 4096
Handle = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HANDLE)]
OptionalStream = Annotated[str, msgspec.Meta(max_length=MAX_HANDLE)]  # "" is the default stream
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Codec = Annotated[str, msgspec.Meta(max_length=16)]
if TYPE_CHECKING:
    Bytes = bytes | bytearray | memoryview
else:
    # A copy chunk's bytes: any bytes-like value encodes as they are, and a receiver decodes a view of the frame
    # it read (msgspec's memoryview: no copy of the chunk before it goes to the device).
    Bytes = memoryview
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


# -- commands ------------------------------------------------------------------------------------
# What a DeviceInfoQuery returns: the device's fields (wire/types.py DeviceInfo) and the worker's memory use, as a
# map of short scalars (DeviceInfoQuery.check_result then holds it to every field of DeviceInfo).
DeviceReport = Annotated[dict[str, str | bool | int | float | Annotated[list[int], msgspec.Meta(max_length=3)] | None],
                         msgspec.Meta(max_length=64)]
# What a LoadModule returns: the module's kernel names.
KernelNames = Annotated[list[Annotated[str, msgspec.Meta(max_length=1024)]], msgspec.Meta(max_length=65536)]


# The decoder of batches of every command, built at first use and again after a command is defined (Command), so
# that the hot path (each batch of each link) reads one global.
_batch_decoder: msgspec.msgpack.Decoder[Batch] | None = None
# The same for the front's outlines of batches (``outline_batch``).
_outline_decoder: msgspec.msgpack.Decoder[Batch] | None = None


def _batches() -> msgspec.msgpack.Decoder[Batch]:
    global _batch_decoder
    decoder = _batch_decoder
    if decoder is None:
        decoder = _batch_decoder = msgspec.msgpack.Decoder(
            Batch[functools.reduce(operator.or_, commands())])  # type: ignore[misc]
    return decoder


@functools.cache
def _ack_decoder(last: type[Command] | None) -> msgspec.msgpack.Decoder[Ack]:
    """An Ack whose result may be only what ``last`` returns (None: anything, for a receiver that trusts the
    sender)."""
    if last is None:
        return msgspec.msgpack.Decoder(Ack)
    # (a type built at run time from the command's trait, which no static type checker follows; Optional, because
    # None | None is no expression)
    result: Any = Optional[last.result]  # noqa: UP045
    return msgspec.msgpack.Decoder(Ack[result])


def tag_of(command: Command | type[Command]) -> str:
    """A command's wire tag ("launch", "load_module", ...)."""
    return str(command.__struct_config__.tag)


class Command(_Struct, tag_field="op", frozen=True):
    """One device operation; its subclasses are the command model, each registered as it is defined.

    A subclass declares, besides its fields, the traits every process reads off the class below (it sets those
    whose default does not fit, as plain class attributes), and may override ``describe`` and ``check_result``.
    """

    # True: the command may travel on a framed link straight to the worker (device work and the memory and
    # streams it uses). False: only through the front, which supervises it (a compile may need its time limit).
    link: ClassVar[bool] = True
    # True: it uses the device, so a batch holding it waits for the tenant's fair-scheduling turn on the front's
    # paths (links take the same turn as a lease). False for what only changes the session's tables (allocations,
    # streams, events, modules). The default is the safe one.
    device_work: ClassVar[bool] = True
    # True: the worker works on the host's CPU for it (a compile, a copy): while one is in flight through the
    # front, the worker may use CPU outside its device turns (the front's CPU watch).
    host_work: ClassVar[bool] = False
    # The type of what it returns as a batch's last command (msgspec validates a worker's answer as this type and
    # nothing else; ``check_result`` then holds the value to the command). None: it returns nothing.
    result: ClassVar[Any] = None
    # Fields the front relays without reading (a kernel's arguments, a write's bytes, an operator's metadata): its
    # outline of a batch (``outline_batch``) leaves them undecoded, for the worker to decode and check, so that what
    # the front does with them on its event loop is a scan. Never a field that the front's checks read.
    front_skips: ClassVar[tuple[str, ...]] = ()
    # True only for the outline classes (``_outline_of``): no commands of their own.
    outline: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A new command: the decoders are built again, over every command, when next used.
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("outline"):
            return
        global _batch_decoder, _outline_decoder
        commands.cache_clear()
        _batch_decoder = _outline_decoder = None
        _ack_decoder.cache_clear()

    def describe(self) -> str:
        """What the command was, as a failure names it to the user ("memset of 16 bytes"); by default its tag and
        the object it names (its ``handle`` or ``event`` field, where it has one: "free of 'b1'")."""
        named = getattr(self, "handle", None) or getattr(self, "event", None)
        return tag_of(self) if named is None else f"{tag_of(self)} of {named!r}"

    def check_result(self, result: Any) -> None:
        """Hold a result already of type ``result`` to this command (a read's bytes are exactly its size);
        ValueError saying why not. By default any value of the type is fine."""


@functools.cache
def commands() -> tuple[type[Command], ...]:
    """Every command: each subclass of Command, in the order defined; TypeError if two share a tag."""
    found: dict[str, type[Command]] = {}
    pending = list(Command.__subclasses__())
    while pending:
        cls = pending.pop(0)
        other = found.setdefault(tag_of(cls), cls)
        if other is not cls:
            raise TypeError(f"two commands with the tag {tag_of(cls)!r}: {other.__qualname__} and {cls.__qualname__}")
        pending.extend(sub for sub in cls.__subclasses__() if not sub.outline)
    return tuple(found.values())


def link_commands() -> frozenset[type[Command]]:
    """The commands a link may carry (``link`` true)."""
    return frozenset(cls for cls in commands() if cls.link)


class Allocate(Command, tag="allocate", frozen=True):
    device_work = False
    handle: Handle
    size: Annotated[int, msgspec.Meta(gt=0)]

    def describe(self) -> str:
        return f"allocate of {self.size} bytes"


class Free(Command, tag="free", frozen=True):
    device_work = False
    handle: Handle


class Memset(Command, tag="memset", frozen=True):
    buf: BufRef
    value: Annotated[int, msgspec.Meta(ge=0, le=255)]
    size: int  # bytes from ``offset``; -1: to the end of the view
    offset: NonNegative = 0
    stream: OptionalStream = ""

    def describe(self) -> str:
        return "memset to the end of the view" if self.size == -1 else f"memset of {self.size} bytes"


class CopyD2D(Command, tag="copy_d2d", frozen=True):
    src: BufRef
    dst: BufRef
    size: NonNegative
    src_offset: NonNegative = 0
    dst_offset: NonNegative = 0
    stream: OptionalStream = ""

    def describe(self) -> str:
        return f"copy_d2d of {self.size} bytes"


class Launch(Command, tag="launch", frozen=True):
    front_skips = ("args",)
    kernel: Handle
    grid: Dims
    block: Dims
    args: list[KernelArg]
    shared_mem: NonNegative = 0
    stream: OptionalStream = ""

    def describe(self) -> str:
        return f"launch of kernel {self.kernel!r}"  # (the worker names the kernel where it knows it)


class CreateStream(Command, tag="create_stream", frozen=True):
    device_work = False
    handle: Handle


class DestroyStream(Command, tag="destroy_stream", frozen=True):
    device_work = False
    handle: Handle


class Synchronize(Command, tag="synchronize", frozen=True):
    stream: OptionalStream = ""  # "": the whole device (every stream of the session)


# Events order streams on the device: ``WaitEvent`` makes a stream wait, on the GPU, for what was queued before the
# event's last ``RecordEvent`` (no host blocks); ``SynchronizeEvent`` makes the host wait for it. An event never
# recorded is complete (CUDA's rule): waiting on it returns at once.
class CreateEvent(Command, tag="create_event", frozen=True):
    device_work = False
    handle: Handle


class DestroyEvent(Command, tag="destroy_event", frozen=True):
    device_work = False
    handle: Handle


class RecordEvent(Command, tag="record_event", frozen=True):
    event: Handle
    stream: OptionalStream = ""


class WaitEvent(Command, tag="wait_event", frozen=True):
    event: Handle
    stream: OptionalStream = ""


class SynchronizeEvent(Command, tag="synchronize_event", frozen=True):
    event: Handle


class Write(Command, tag="write", frozen=True):
    """Host to device: ``data`` into the view at ``offset`` (one chunk of a copy; large copies are several)."""

    host_work = True
    front_skips = ("data",)
    buf: BufRef
    offset: NonNegative
    data: Bytes
    stream: OptionalStream = ""
    # "lz4": ``data`` is an lz4 block (no stored size) that decompresses to exactly ``size`` bytes (slow links
    # only: a link that negotiated lz4); "" : ``data`` is the bytes as they are and ``size`` is unused.
    codec: Codec = ""
    size: NonNegative = 0

    def describe(self) -> str:
        return f"write of {self.size} bytes ({self.codec})" if self.codec else f"write of {len(self.data)} bytes"


# A library operation's array: the buffer view, a NumPy dtype name, the shape (C-contiguous from the view).
LibraryArray = tuple[BufRef, Annotated[str, msgspec.Meta(max_length=16)],
                     Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, le=1 << 62)], ...], msgspec.Meta(max_length=32)]]
# Its params: int, float, bool, short str, None or a short list of ints (gpubroker/wire/library.py checks each's
# meaning).
LibraryParam = (int | float | bool | Annotated[str, msgspec.Meta(max_length=32)] | None
                | Annotated[list[int], msgspec.Meta(max_length=32)])


class RunLibrary(Command, tag="run_library", frozen=True):
    """A library operation (matmul, linalg, fft, sort, unique, ...: gpubroker/wire/library.py's table) on arrays of the
    session; device work like a launch."""

    front_skips = ("inputs", "outputs", "params")
    name: Annotated[str, msgspec.Meta(max_length=32)]  # the op ("linalg.svd"); ``op`` is the command's tag
    inputs: Annotated[list[LibraryArray], msgspec.Meta(max_length=8)]
    outputs: Annotated[list[LibraryArray], msgspec.Meta(max_length=8)]
    params: Annotated[dict[Annotated[str, msgspec.Meta(max_length=32)], LibraryParam], msgspec.Meta(max_length=16)] = {}
    stream: OptionalStream = ""

    def describe(self) -> str:
        return f"run_library of {self.name!r}"


class Read(Command, tag="read", frozen=True):
    """Device to host: ``size`` bytes of the view from ``offset``; the Ack's result is the bytes."""

    host_work = True
    result = bytes  # (as the front gets it: a link's codec applies only on the link)
    buf: BufRef
    offset: NonNegative
    size: NonNegative
    stream: OptionalStream = ""
    # The codec the client takes the result in ("lz4" where its link negotiated it): then the result is
    # ``[codec, data]`` (codec "" when compressing did not pay: data raw), else the bytes as they are.
    codec: Codec = ""

    def describe(self) -> str:
        return f"read of {self.size} bytes"

    def check_result(self, result: Any) -> None:
        if len(result) != self.size:
            raise ValueError(f"a read that returned other than the {self.size} bytes asked for")


class CopyShared(Command, tag="copy_shared", frozen=True):
    """Between a shared-memory segment (same host; registered through the front) and device memory."""

    host_work = True
    segment: Handle
    segment_offset: NonNegative
    buf: BufRef
    offset: NonNegative
    size: NonNegative
    to_device: bool
    stream: OptionalStream = ""

    def describe(self) -> str:
        return f"copy_shared of {self.size} bytes {'to' if self.to_device else 'from'} the device"


class DeviceInfoQuery(Command, tag="device_info", frozen=True):
    """The device as its runtime describes it, plus this worker's memory use; the Ack's result is a dict."""

    device_work = False
    result = DeviceReport

    def check_result(self, result: Any) -> None:
        device_info_from_report(result)


class LoadModule(Command, tag="load_module", frozen=True):
    """Compile or load ``image`` (source as UTF-8 bytes); the Ack's result is the module's kernel names."""

    link = False
    device_work = False
    host_work = True
    result = KernelNames
    front_skips = ("options",)  # (not ``image``: the front holds its size to max_module_bytes)
    handle: Handle
    format: Annotated[str, msgspec.Meta(max_length=16)]  # a ModuleFormat value
    image: bytes
    options: list[str] = []


class UnloadModule(Command, tag="unload_module", frozen=True):
    link = False
    device_work = False
    handle: Handle


class GetKernel(Command, tag="get_kernel", frozen=True):
    link = False
    device_work = False
    handle: Handle  # the kernel's new handle
    module: Handle
    name: Annotated[str, msgspec.Meta(max_length=1024)]

    def describe(self) -> str:
        return f"get_kernel of {self.name!r}"


# -- batches and acknowledgements ------------------------------------------------------------------
C = TypeVar("C", bound=Command, default=Command)
R = TypeVar("R", default=Any)


class Batch(_Struct, Generic[C], frozen=True):
    """Commands to run in order. ``id`` is the sender's (acks come back in order, each naming its batch);
    ``first`` is the sequence number of its first command, by which a failure is reported.

    (Generic only so that its decoder is built over the commands registered: ``Batch`` is ``Batch[Command]``.)"""

    id: int
    first: int
    commands: list[C]


class CommandError(_Struct, frozen=True):
    """The first command of a batch that failed: its sequence number, what it was, and the error."""

    seq: int
    command: str  # "launch of 'scale'", "allocate of 4096 bytes", ...
    error: WireError

    # The error's fields, read through (``ack.error.code``).
    @property
    def code(self) -> str:
        return self.error.code

    @property
    def message(self) -> str:
        return self.error.message

    @property
    def type(self) -> str:
        return self.error.type

    @property
    def details(self) -> dict[str, Any]:
        return self.error.details

    @classmethod
    def of(cls, seq: int, command: str, exc: GpuBrokerError) -> CommandError:
        return cls(seq, command, exc.as_wire())


class Ack(_Struct, Generic[R], frozen=True):
    """A batch's answer: how many of its commands ran, the first failure (the rest did not run), and the result
    of its last command when that returns one (a Read's bytes, a device description, kernel names).

    (Generic only for the front, which decodes ``result`` as the last command's result type: ``decode_ack_for``.)"""

    id: int
    done: int
    error: CommandError | None = None
    result: R = None  # type: ignore[assignment]  # (None where no result is due: an R of None or Any)


encode = encoding.encode  # Batch, Ack, or any message of gpubroker/wire -> bytes: the one encoding (wire/encoding.py)

# A result at least this large is sent beside its Ack's head rather than copied into it (``encode_ack_parts``).
_RESULT_APART = 64 * 1024
_EMPTY_BIN: Final = b"\xc4\x00"  # msgpack's bin 8 of no bytes
_BIN32: Final = b"\xc6"  # msgpack's bin 32 tag (a 4-byte big-endian length follows)
# A Read's result as the worker makes it: plain bytes, or a flat byte view (format "B": its len is its bytes) of
# a page-locked buffer, which msgspec encodes as bin too.
_APART_TYPES: Final = (bytearray, memoryview)


def encode_ack_parts(ack: Ack) -> tuple[bytes, Bytes]:
    """``encode(ack)`` as two parts whose concatenation it is: a head, and the result's bytes as they are where
    they are large (a Read's, raw or as ``[codec, bytes]``), else ``b""``. A sender that writes both with one
    ``sendmsg`` then never copies a chunk into its answer. An Ack is an array whose last element is its result (so
    are the bytes of a ``[codec, bytes]``): encoded with empty bytes in their place it ends in that empty bin,
    which is replaced by the header of theirs."""
    result = ack.result
    placeholder: bytes | list[Any]
    if type(result) in _APART_TYPES:
        data, placeholder = result, b""
    elif type(result) is list and len(result) == 2 and type(result[1]) in _APART_TYPES:
        data, placeholder = result[1], [result[0], b""]
    else:
        return encode(ack), b""
    if not _RESULT_APART <= len(data) < 1 << 32:
        return encode(ack), b""
    head = encode(msgspec.structs.replace(ack, result=placeholder))
    assert head.endswith(_EMPTY_BIN)
    return head[:-len(_EMPTY_BIN)] + _BIN32 + len(data).to_bytes(4, "big"), data


def decode_batch(data: bytes | bytearray | memoryview) -> Batch:
    """A batch from the wire; msgspec.ValidationError / DecodeError (both msgspec.DecodeError) if malformed."""
    try:
        return (_batch_decoder or _batches()).decode(data)
    except UnicodeDecodeError as exc:  # msgspec lets a str that is not UTF-8 through as this, not a DecodeError
        raise msgspec.DecodeError(f"malformed string: {exc}") from None


def parse_batch(data: bytes | bytearray | memoryview) -> Batch:
    """``decode_batch`` for a receiver that answers a malformed batch with an error: InvalidArgument naming why."""
    try:
        return (_batch_decoder or _batches()).decode(data)
    # (a str that is not UTF-8 comes as UnicodeDecodeError: the client's error too, not the worker's bug, which
    # was a traceback in the broker's log and INTERNAL for every such batch)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"malformed batch: {exc}") from None


def _outline_of(cls: type[Command]) -> type[Command]:
    """``cls`` with its ``front_skips`` fields left undecoded (msgspec.Raw, which msgspec only steps over): a
    subclass of the same tag, so that the front's checks (isinstance, the class's traits, ``check_result``) read an
    outline as the command itself."""
    if not cls.front_skips:
        return cls
    defaults = {field.name: field.default is not msgspec.NODEFAULT or field.default_factory is not msgspec.NODEFAULT
                for field in msgspec.structs.fields(cls)}
    # (a skipped field that has a default keeps one, else no required field could follow it)
    skipped: list[Any] = [(name, msgspec.Raw, msgspec.Raw()) if defaults[name] else (name, msgspec.Raw)
                          for name in cls.front_skips]
    outline = msgspec.defstruct(f"{cls.__name__}Outline", skipped, bases=(cls,), tag=tag_of(cls), frozen=True,
                                namespace={"outline": True})
    assert issubclass(outline, cls)
    return outline


def _outlines() -> msgspec.msgpack.Decoder[Batch]:
    global _outline_decoder
    decoder = _outline_decoder
    if decoder is None:
        union: Any = functools.reduce(operator.or_, [_outline_of(cls) for cls in commands()])
        outline = msgspec.defstruct(
            "BatchOutline", [("commands", Annotated[list[union], msgspec.Meta(max_length=MAX_FRONT_COMMANDS)])],
            bases=(Batch,), frozen=True)
        decoder = _outline_decoder = msgspec.msgpack.Decoder(outline)
    return decoder


def outline_batch(data: bytes | bytearray | memoryview) -> Batch:
    """A batch as the front reads it before relaying it to the worker: its id, its first command's sequence number,
    and each command as its class with the fields the front checks (its ``front_skips`` fields undecoded: the
    worker decodes and checks them, and answers a batch malformed there with InvalidArgument), at most
    MAX_FRONT_COMMANDS of them; InvalidArgument naming why if malformed as far as it is read.

    Stepping over the skipped bytes costs msgspec about 2 ns a byte; decoding them, up to 25 (a torch operator's
    output metadata), which the front would spend on its event loop, charged to nobody."""
    try:
        return (_outline_decoder or _outlines()).decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        message = f"malformed batch: {exc}"
        if f"length <= {MAX_FRONT_COMMANDS} - at `$[2]`" in message:
            message += f" (a batch holds at most {MAX_FRONT_COMMANDS} commands here: send them in several)"
        raise InvalidArgument(message) from None


def decode_ack(data: bytes | bytearray | memoryview) -> Ack:
    """An Ack from a sender the receiver trusts (a client reading its broker): its result as it comes."""
    try:
        return _ack_decoder(None).decode(data)
    except UnicodeDecodeError as exc:
        raise msgspec.DecodeError(f"malformed string: {exc}") from None


# (decode_read_ack: raw bytes, or ``[codec, bytes]`` where the Read named a codec)
_read_ack_decoder: Final = msgspec.msgpack.Decoder(Ack[Optional[memoryview | tuple[str, memoryview]]])  # noqa: UP045


def decode_read_ack(data: bytes | bytearray | memoryview) -> Ack:
    """``decode_ack`` for an Ack to a batch that ends in a Read: its bytes a view of ``data`` (msgspec's
    memoryview: a chunk is not copied before it goes where the caller wants it), as they are or, where the Read
    named a codec, in a ``(codec, bytes)`` tuple."""
    try:
        return _read_ack_decoder.decode(data)
    except UnicodeDecodeError as exc:
        raise msgspec.DecodeError(f"malformed string: {exc}") from None


# The most bytes ``encode_ack_parts`` sends before a Read's raw bytes: an array header, three small fields and the
# bytes' bin 32 header.
READ_HEAD_MAX: Final = 64


def read_ack_head(head: bytes | bytearray | memoryview, size: int) -> bytes | None:
    """Where ``head`` is what ``encode_ack_parts`` sends before a Read's ``size`` raw bytes (an Ack with no error
    whose result is those bytes: their bin 32 header last), that Ack encoded with an empty result in their place
    (``decode_ack`` reads it with result ``b""``): a receiver can take the bytes straight into where they go. None
    for anything else (an error, a ``[codec, bytes]`` result, another size)."""
    tail = _BIN32 + size.to_bytes(4, "big")
    if not len(tail) < len(head) <= READ_HEAD_MAX or bytes(head[-len(tail):]) != tail:
        return None
    encoded = bytes(head[:-len(tail)]) + _EMPTY_BIN
    try:
        ack = decode_ack(encoded)
    except msgspec.DecodeError:
        return None
    return encoded if ack.error is None and ack.result == b"" else None


def decode_ack_for(data: bytes | bytearray | memoryview, batch: Batch) -> Ack:
    """An Ack to ``batch`` from a sender the receiver does not trust (the front reading a worker): its result
    decoded only as the type the batch's last command returns (``Command.result``; nothing where it returns
    nothing), so nothing else is ever built. msgspec.DecodeError if it is no such Ack; the caller holds the rest
    (ids, counts, ``check_result``) to the batch."""
    last = type(batch.commands[-1]) if batch.commands else Command
    try:
        return _ack_decoder(last).decode(data)
    except UnicodeDecodeError as exc:
        raise msgspec.DecodeError(f"malformed string: {exc}") from None


# The torch device's commands are defined in their own module; importing it here registers them in every process
# that decodes commands (front, worker, links, client), as a command class defined in this module would be.
from gpubroker.wire import torch as _torch_commands  # noqa: E402, F401
