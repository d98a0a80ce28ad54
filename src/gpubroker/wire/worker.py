"""The front-worker protocol: typed requests, replies and lease messages, on the SDK's frames (wire/frames.py).

Each frame's payload is one message, encoded by the one encoder (``encode``, gpubroker/wire/commands.py):

- front -> worker, ``ToWorker``: ``[id, session, request]``, a request of the front with an id >= 1 (a
  ``WorkerRequest``: a batch of commands, limits, accounting, sessions, segments, links, copies between devices),
  or a lease message (``Grant``, ``Yield``, ``Revoke``) with the id ``CONTROL``;
- worker -> front, ``FromWorker``: ``[id, status, body]``, the answer to request ``id`` (status 0: its result, of
  the request's ``result`` type; status 1: a WireError), or, with the id ``CONTROL``, a lease message (``Want``,
  ``Released``). The worker's first frame (id 0) is its device's report, or the WireError it failed to start with.

Each request declares what it returns (its class's type parameter: ``Ping(WorkerRequest[int])``) and whether
serving it may run its tenant's code. The front trusts nothing a worker says (a worker runs its tenant's native
code and may write anything on its socket): ``read_reply`` bounds the frame by what the front can expect (a length
past the bound is refused before a byte of the payload is buffered) and decodes only the envelope, its body left
encoded; the body is then decoded as the one type the request it answers returns (``decode_result``), as a
WireError, or as a lease message, never as arbitrary msgpack, which would build an object of ~64 bytes for each
one-byte element: msgspec stops at the first element of the wrong type or an unknown key, and builds only what the
type admits (containers of bounded length).

Links carry the same frames with an encoded Batch or Ack as the payload, read and written without blocking by the
worker's ``_links.py``.
"""

from __future__ import annotations

import asyncio
import typing
from typing import Annotated, Any, ClassVar, Final, Generic, Literal

import msgspec
from msgspec import Raw
from typing_extensions import TypeVar

from gpubroker.wire.commands import BufRef, DeviceReport, Handle, NonNegative, encode
from gpubroker.wire.frames import (
    FRAME_HEADER,
    MAX_FRAME,
    FrameClosed,
    FrameRefused,
    FrameTooLarge,
    pack_frame,
    read_frame_async,
    read_payload_async,
    recv_frame,
    recv_payload,
    send_frame,
    send_payload,
    unpack_frame,
    write_frame_async,
)

__all__ = [
    "CONTROL",
    "EXIT_FATAL",
    "FRAME_HEADER",
    "MAX_FRAME",
    "MAX_LINKS_PER_SESSION",
    "REQUESTS",
    "AttachLink",
    "CloseLinks",
    "CloseSession",
    "DeviceTime",
    "DropLink",
    "FrameClosed",
    "FrameRefused",
    "FrameTooLarge",
    "FromWorker",
    "Grant",
    "LeaseToFront",
    "LeaseToWorker",
    "LinkRing",
    "PeerClose",
    "PeerCopy",
    "PeerExport",
    "PeerExported",
    "PeerLocal",
    "PeerOpen",
    "Pin",
    "Ping",
    "RegisterSegment",
    "ReleaseSegment",
    "Released",
    "Revoke",
    "RunBatch",
    "ServeLink",
    "SetLimits",
    "TakeDeviceTime",
    "ToWorker",
    "Unpin",
    "Usage",
    "UsageReport",
    "Want",
    "WorkerRequest",
    "Yield",
    "decode_device_report",
    "decode_lease",
    "decode_result",
    "decode_to_worker",
    "decode_worker_message",
    "encode",
    "pack_frame",
    "read_frame_async",
    "read_payload_async",
    "read_reply",
    "recv_frame",
    "recv_payload",
    "send_frame",
    "send_payload",
    "unpack_frame",
    "write_frame_async",
]

# The request id of lease messages between the front and the worker (replies to requests have ids >= 1).
CONTROL: Final = -1
# The status a worker exits with after its tenant's kernel corrupted its device context.
EXIT_FATAL: Final = 3
# A worker serves each session's links in order, one batch at a time; past this many, new links stay with the front.
MAX_LINKS_PER_SESSION: Final = 8

_MAX_IMPORT = 256  # characters of a peer import's id
_MAX_SESSIONS = 65536  # in a usage report (a tenant's sessions on one device: far fewer in any configuration)
T = TypeVar("T", default=Any)
B = TypeVar("B", default=Any)


class _Message(msgspec.Struct, array_like=True, frozen=True, gc=False):
    pass


# -- results -------------------------------------------------------------------------------------------------------
class DeviceTime(_Message, frozen=True):
    """The device seconds used since the last take (the fair scheduler's charge) and the memory in use."""

    seconds: Annotated[float, msgspec.Meta(ge=0)]
    memory_used: NonNegative


class UsageReport(_Message, frozen=True):
    """The worker's memory in use, all and by session; and what it ran since it started (counters: kernel launches,
    bytes copied host to device, device to host, device to device), which the front turns into metrics."""

    memory_used: NonNegative
    sessions: Annotated[dict[Annotated[str, msgspec.Meta(max_length=256)], NonNegative],
                        msgspec.Meta(max_length=_MAX_SESSIONS)]
    launches: NonNegative = 0
    h2d_bytes: NonNegative = 0
    d2h_bytes: NonNegative = 0
    d2d_bytes: NonNegative = 0


class PeerExported(_Message, frozen=True):
    """An allocation exported for another device's worker: the backend's IPC handle and the allocation's size."""

    handle: Annotated[bytes, msgspec.Meta(max_length=4096)]
    size: NonNegative


# -- requests, front -> worker ---------------------------------------------------------------------------------------
class WorkerRequest(_Message, Generic[T], tag_field="op", frozen=True):
    """One of the front's requests to its worker; ``T``, its type parameter, is what the reply's result is (the
    front decodes it as that and nothing else)."""

    # The type of the result (set from the type parameter).
    result: ClassVar[Any] = None
    # True: serving it may run the tenant's code (device work, a copy, a link); the front's own requests (limits,
    # accounting, closing) set False. Once one has been served, the worker's death is its tenant's failure.
    tenant_code: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is WorkerRequest:
                cls.result = typing.get_args(base)[0]


class RunBatch(WorkerRequest[bytes], tag="batch", frozen=True):
    """Run an encoded Batch (gpubroker/wire/commands.py) in the session; the result is its encoded Ack."""

    batch: bytes


class Ping(WorkerRequest[NonNegative], tag="ping", frozen=True):
    """The worker's pid."""

    tenant_code = False


class TakeDeviceTime(WorkerRequest[DeviceTime], tag="take_device_time", frozen=True):
    """A fence: the device time since the last one (the worker waits for its queued work first)."""

    tenant_code = False


class SetLimits(WorkerRequest[None], tag="set_limits", frozen=True):
    """The tenant's memory quota on this device and the per-session limits (at start and every reload); with
    ``device``, the broker's index of the device (named in quota errors), with ``max_frame``, the largest frame a
    link takes (the config's chunk_bytes plus 64 KiB). None: unchanged."""

    tenant_code = False
    memory_quota: NonNegative | None = None
    max_handles: NonNegative | None = None
    max_streams: NonNegative | None = None
    device: NonNegative | None = None
    max_frame: NonNegative | None = None


class Usage(WorkerRequest[UsageReport], tag="usage", frozen=True):
    tenant_code = False


class CloseSession(WorkerRequest[NonNegative], tag="close_session", frozen=True):
    """Free everything the session owned; the result is how many buffers and streams were freed."""

    tenant_code = False


class RegisterSegment(WorkerRequest[None], tag="register_segment", frozen=True):
    """Map the memfd sent on the fd channel with this request (``token`` pairs them) under the client's handle.

    (A request that comes with an fd decodes whatever its values: the worker takes the fd off its channel first
    and then checks them, so that the channel stays in step with the requests.)"""

    handle: str
    size: int
    token: bytes = b""


class ReleaseSegment(WorkerRequest[None], tag="release_segment", frozen=True):
    handle: Handle


class LinkRing(msgspec.Struct, frozen=True):
    """A same-host ring the front made for a link: the command ring's and the ack ring's bytes (after the index
    page) and the spin the client asked for (microseconds)."""

    commands: int
    acks: int
    spin_us: int = 0


class AttachLink(WorkerRequest[None], tag="attach_link", frozen=True):
    """Take over a client's authenticated link (sent on the fd channel, paired by ``token``) for the session: the
    worker answers its hello at once, or with ``held`` (the front's number for the link) only once the front says
    ``ServeLink``. ``compress``: the codecs the hello asked for, in the client's order. With ``ring``, the fd
    channel carries the ring's memfd and the worker's doorbell after the link (three fds): the front made them.
    ``spin_us``: how long the worker polls a link without a ring for the client's next batch after answering one
    (the broker host's spin, wire/ring.py; the worker takes at most MAX_SPIN_US)."""

    compress: list[str] = []  # (unbounded: see RegisterSegment; the worker reads its first 16)
    held: int | None = None
    token: bytes = b""
    ring: LinkRing | None = None
    spin_us: int = 0


class ServeLink(WorkerRequest[None], tag="serve_link", frozen=True):
    """Answer and serve the link taken with ``held`` (its credential was found still valid after the hand-off)."""

    held: int


class DropLink(WorkerRequest[None], tag="drop_link", frozen=True):
    """Close the link taken with ``held``, unanswered: its hand-off timed out."""

    held: int


class CloseLinks(WorkerRequest[None], tag="close_links", frozen=True):
    """Close the session's links (the credential that opened them was revoked); the session stays."""

    tenant_code = False


class Pin(WorkerRequest[None], tag="pin", frozen=True):
    """Keep buffers from being freed while a copy to or from another device uses them (all or none)."""

    tenant_code = False
    handles: Annotated[list[Handle], msgspec.Meta(max_length=16)]


class Unpin(WorkerRequest[None], tag="unpin", frozen=True):
    tenant_code = False
    handles: Annotated[list[Handle], msgspec.Meta(max_length=16)]


class PeerLocal(WorkerRequest[None], tag="peer_local", frozen=True):
    """Copy from another session's buffer on this device into this session's, and wait for it."""

    src_session: str
    src: BufRef
    dst: BufRef
    size: NonNegative
    src_offset: NonNegative
    dst_offset: NonNegative


class PeerExport(WorkerRequest[PeerExported], tag="peer_export", frozen=True):
    buf: BufRef


class PeerOpen(WorkerRequest[Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_IMPORT)]], tag="peer_open",
               frozen=True):
    """Open another device's exported allocation; the result is the import's id."""

    handle: Annotated[bytes, msgspec.Meta(max_length=4096)]
    size: NonNegative
    src_device: NonNegative


class PeerCopy(WorkerRequest[None], tag="peer_copy", frozen=True):
    import_id: Annotated[str, msgspec.Meta(max_length=_MAX_IMPORT)]
    src_offset: NonNegative
    size: NonNegative
    dst: BufRef
    dst_offset: NonNegative


class PeerClose(WorkerRequest[None], tag="peer_close", frozen=True):
    import_id: Annotated[str, msgspec.Meta(max_length=_MAX_IMPORT)]


REQUESTS: Final[tuple[type[WorkerRequest], ...]] = (
    RunBatch, Ping, TakeDeviceTime, SetLimits, Usage, CloseSession, RegisterSegment, ReleaseSegment, AttachLink,
    ServeLink, DropLink, CloseLinks, Pin, Unpin, PeerLocal, PeerExport, PeerOpen, PeerCopy, PeerClose)


# -- lease messages --------------------------------------------------------------------------------------------------
# The worker's links run device work without the front; the tenant's turns for it are leased (scheduler/_lease.py):
# the worker says Want, the front Grant; when others wait the front says Yield (give the turn back after the batch in
# hand) or, once the holder's slice is over, Revoke (now); the worker says Released each time it gives one back.
class Grant(_Message, tag="grant", tag_field="op", frozen=True):
    pass


class Yield(_Message, tag="yield", tag_field="op", frozen=True):
    pass


class Revoke(_Message, tag="revoke", tag_field="op", frozen=True):
    pass


class Want(_Message, tag="want", tag_field="op", frozen=True):
    pass


class Released(_Message, tag="released", tag_field="op", frozen=True):
    memory_used: NonNegative | None = None  # the memory its links' commands left in use, where known


LeaseToWorker = Grant | Yield | Revoke
LeaseToFront = Want | Released


# -- envelopes -------------------------------------------------------------------------------------------------------
class ToWorker(_Message, Generic[B], frozen=True):
    """A frame to the worker: a request with its id and session, or (``CONTROL``) a lease message."""

    id: int
    session: str
    body: B


class FromWorker(_Message, Generic[B], frozen=True):
    """A frame from the worker: ``body`` answers request ``id`` (status 0: its result; 1: a WireError), or is a
    lease message (``CONTROL``, status 0)."""

    id: int
    status: Literal[0, 1]
    body: B


_to_worker = msgspec.msgpack.Decoder(ToWorker[Raw])
_request = msgspec.msgpack.Decoder(typing.Union[(*REQUESTS, Grant, Yield, Revoke)])
_from_worker = msgspec.msgpack.Decoder(FromWorker[Raw])
_lease = msgspec.msgpack.Decoder(LeaseToFront)
_device_report = msgspec.msgpack.Decoder(DeviceReport)
_results: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def _decoding(decoder: msgspec.msgpack.Decoder[Any], data: Any) -> Any:
    try:
        return decoder.decode(data)
    except UnicodeDecodeError as exc:  # msgspec lets a str that is not UTF-8 through as this, not a DecodeError
        raise msgspec.DecodeError(f"malformed string: {exc}") from None


def decode_to_worker(payload: bytes | bytearray | memoryview) -> ToWorker[Raw]:
    """A frame from the front, its body still encoded (msgspec.DecodeError if it is no ToWorker)."""
    return typing.cast("ToWorker[Raw]", _decoding(_to_worker, payload))


def decode_worker_message(body: Raw) -> WorkerRequest | Grant | Yield | Revoke:
    """A ToWorker's body: a request, or a lease message (msgspec.DecodeError if it is neither)."""
    return typing.cast("WorkerRequest | Grant | Yield | Revoke", _decoding(_request, body))


def decode_result(request: type[WorkerRequest[T]] | type[WorkerRequest], body: Raw | bytes) -> T:
    """A reply's result to ``request``, decoded as the type the request returns and nothing else
    (msgspec.DecodeError if it is not one)."""
    decoder = _results.get(request)
    if decoder is None:
        decoder = _results[request] = msgspec.msgpack.Decoder(request.result)
    return typing.cast("T", _decoding(decoder, body))


def decode_device_report(body: Raw | bytes) -> dict[str, Any]:
    """The worker's first words: its device's report, of the type a DeviceInfoQuery returns (msgspec.DecodeError
    if it is not one)."""
    return typing.cast("dict[str, Any]", _decoding(_device_report, body))


def decode_lease(body: Raw | bytes) -> LeaseToFront:
    """A lease message from the worker (msgspec.DecodeError if it is none)."""
    return typing.cast("LeaseToFront", _decoding(_lease, body))


async def read_reply(reader: asyncio.StreamReader, limit: int) -> FromWorker[Raw]:
    """One frame from a worker of at most ``limit`` bytes, its body still encoded; FrameRefused past the limit or
    for bytes that are no FromWorker."""
    try:
        payload = await read_payload_async(reader, limit)
    except FrameTooLarge as exc:
        raise FrameRefused(f"a frame of {exc.length} bytes, over the front's limit of {limit}") from None
    try:
        return typing.cast("FromWorker[Raw]", _decoding(_from_worker, payload))
    except msgspec.DecodeError as exc:
        raise FrameRefused(f"a frame that is not [id, status, body] ({str(exc)[:120]})") from None
