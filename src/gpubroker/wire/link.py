"""The link's own messages, typed: the hello, the ring upgrade and shared-memory segment registration.

A link is a stream socket whose frames (``frames.py``: 4-byte big-endian length, then the payload) carry protocol
batches (``commands.py``) once it is set up. Setting it up takes the messages here, each a msgspec Struct decoded
by one decoder, as the commands are; every answer is one envelope ``[0, status, result]``: status 0 and the
typed result, or status 1 and an error (``GpuBrokerError.to_wire``).

- ``Hello`` (client -> front, the first frame on every link listener: ``<socket>.fast``, ``link_listen``,
  ``link_vsock_port``) authenticates the connection and says what it is for. A map, so that a newer client's
  extra fields are ignored, not refused. ``link: 1``: batches; the front hands the connection to the session's
  worker, which answers ``LinkAccepted``. ``segments: 1`` (Unix sockets only, where descriptors pass): the
  front keeps the connection and registers shared-memory segments on it, answering ``SegmentsAccepted``.
- ``RingRequest`` (in a batch link's hello on ``<socket>.fast``: the client's window and spin): the same-host
  ring (``ring.py``). The FRONT makes the ring, never the client: a sealed memfd of exactly the rings' size,
  charged to the tenant's ``shared_memory`` as a segment is, and a SOCK_SEQPACKET socketpair for the doorbells,
  both ends refusing descriptors (``SO_PASSRIGHTS`` off). It answers ``RingGranted`` first, with the memfd and the
  client's doorbell attached (SCM_RIGHTS), or ``ring: 0`` and why not; then hands the link, the memfd and the
  worker's doorbell to the worker, whose ``LinkAccepted`` says whether it mapped the ring. A client's descriptor
  never reaches a worker: the worker's end of every link refuses them (front/_links.py).
- ``SegmentRequest`` (client -> front, on a segments connection after its hello): ``RegisterSegment`` with one
  memfd attached (sealed, exactly ``size`` bytes: the SDK's ``create_segment_fd``), answered
  ``SegmentRegistered``; ``ReleaseSegment``, answered ``SegmentReleased``. Tagged arrays, as the commands.

Sizes are bounded twice: a frame by its reader (``hello_max_bytes`` for a hello, ``MAX_SEGMENT_FRAME`` for a
segment request) before its payload is read, and each field here. Bytes that are not the message expected raise
``Malformed``, whose text says why (for the answer and the audit line), never a decoder's traceback.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, TypeVar

import msgspec

from gpubroker.wire.commands import MAX_HANDLE
from gpubroker.wire.commands import encode as _encode
from gpubroker.wire.errors import GpuBrokerError, WireError, error_from_wire
from gpubroker.wire.ring import MAX_RING_WINDOW, MAX_SPIN_US

__all__ = [
    "LINK_SEND_BUFFER",
    "LINK_SUFFIX",
    "LINK_VERSION",
    "MAX_CODECS",
    "MAX_SEGMENT_FRAME",
    "SEGMENTS_VERSION",
    "Hello",
    "LinkAccepted",
    "Malformed",
    "RegisterSegment",
    "ReleaseSegment",
    "RingGranted",
    "RingRequest",
    "SegmentRegistered",
    "SegmentReleased",
    "SegmentRequest",
    "SegmentsAccepted",
    "accepted",
    "decode_hello",
    "decode_segment_request",
    "encode",
    "link_path",
    "open_answer",
    "refusal",
]

LINK_VERSION: Final = 1  # the hello's ``link``: batches, as commands.py has them
SEGMENTS_VERSION: Final = 1  # the hello's ``segments``: the requests below
# The Unix socket beside each ``unix:PATH`` listener that takes links (and segment registrations): ``PATH.fast``.
LINK_SUFFIX: Final = ".fast"
MAX_CODECS: Final = 16  # codecs a hello may offer
# What each end of a link (and of the front's socketpair behind a TCP link) may have on its way to the other: a
# copy's 1 MiB chunk and more, so the reader takes a frame in one recv and one wake-up, not in pieces of the
# default buffer (~200 KiB). The kernel caps it at wmem_max.
LINK_SEND_BUFFER: Final = 2 << 20
# A segment request is a handle and a size: a few dozen bytes. Larger is a bug or a hostile peer.
MAX_SEGMENT_FRAME: Final = 64 * 1024

Token = Annotated[str, msgspec.Meta(max_length=4096)]  # (a broker's tokens are ~60 characters)
SessionId = Annotated[str, msgspec.Meta(max_length=256)]
Codec = Annotated[str, msgspec.Meta(max_length=16)]
Handle = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HANDLE)]
Positive = Annotated[int, msgspec.Meta(gt=0)]


def link_path(unix_path: str) -> str:
    """The link socket beside the broker's Unix socket ``unix_path``."""
    return unix_path + LINK_SUFFIX


class RingRequest(msgspec.Struct, kw_only=True, frozen=True):
    """A hello's ask for a same-host ring: room for ``window`` batches in flight each way (the front sizes the
    rings from it and the link's max frame), and how long the worker may spin for the next batch."""

    window: Annotated[int, msgspec.Meta(ge=1, le=MAX_RING_WINDOW)]
    spin_us: Annotated[int, msgspec.Meta(ge=0, le=MAX_SPIN_US)] = 0


# -- the hello -----------------------------------------------------------------------------------
class Hello(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """A link's first frame: who (``token``; over mTLS the certificate may say it instead), which session, and
    what for: ``link`` (the batch protocol's version) or ``segments`` (the segment requests' version)."""

    token: Token | None = None
    session: SessionId | None = None
    link: int | None = None
    segments: int | None = None
    # Codecs the client takes for a batch link's bulk bytes, in its order of preference (the worker picks one).
    compress: Annotated[tuple[Codec, ...], msgspec.Meta(max_length=MAX_CODECS)] = ()
    # A batch link on ``<socket>.fast`` may ask for a shared-memory ring (answered RingGranted first).
    ring: RingRequest | None = None


class LinkAccepted(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """The worker's answer to a batch link's hello: the largest frame it takes, the codec it chose ("" none)."""

    link: int  # LINK_VERSION
    max_frame: int
    compress: Codec = ""
    ring: int = 0  # 1: the worker mapped the ring the front granted; its batches go through it


class SegmentsAccepted(msgspec.Struct, frozen=True):
    """The front's answer to a segments hello: authenticated, the session is the caller's."""

    segments: int = SEGMENTS_VERSION


# -- the ring ----------------------------------------------------------------------------------
class RingGranted(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """The front's answer to a hello's RingRequest, before the link's own answer: ``ring`` 1 with the ring's memfd
    and the client's doorbell attached (the command ring of ``commands`` bytes, then the ack ring of ``acks``,
    after the index page), or 0 with ``reason`` (the link goes on without a ring)."""

    ring: int
    commands: int = 0
    acks: int = 0
    reason: str = ""


# -- segment registration ------------------------------------------------------------------------
class _SegmentRequest(msgspec.Struct, array_like=True, tag_field="op", frozen=True):
    pass


class RegisterSegment(_SegmentRequest, tag="register", frozen=True):
    """Map the memfd attached to this frame (exactly ``size`` bytes) into the session's worker as ``handle``,
    chosen by the client as every handle is (``commands.new_handle("segment")``), for CopyShared."""

    handle: Handle
    size: Positive


class ReleaseSegment(_SegmentRequest, tag="release", frozen=True):
    """Unmap a segment before its session ends."""

    handle: Handle


SegmentRequest = RegisterSegment | ReleaseSegment


class SegmentRegistered(msgspec.Struct, frozen=True):
    segment: str
    size: int


class SegmentReleased(msgspec.Struct, frozen=True):
    released: bool = True


# -- encoding and decoding -----------------------------------------------------------------------
class Malformed(ValueError):
    """Bytes that are not the message expected; the text says why, short enough for an answer and an audit line."""


encode = _encode  # the command model's one encoder: a Struct or plain values -> msgpack bytes
_hello = msgspec.msgpack.Decoder(Hello)
_segment_request: msgspec.msgpack.Decoder[RegisterSegment | ReleaseSegment] = msgspec.msgpack.Decoder(SegmentRequest)
_answer = msgspec.msgpack.Decoder(tuple[int, int, msgspec.Raw])
_error = msgspec.msgpack.Decoder(WireError)  # the one error envelope (wire/errors.py)
T = TypeVar("T")
_results: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}  # an answer's result, by its type


def _decode(decoder: msgspec.msgpack.Decoder[T], payload: bytes | bytearray | memoryview) -> T:
    try:
        return decoder.decode(payload)
    except msgspec.ValidationError as exc:  # msgpack, but not this message
        raise Malformed(str(exc)[:200]) from None
    except Exception as exc:  # any input may fail: DecodeError, RecursionError for deep nesting
        # (in a field it skips), UnicodeDecodeError for a string that is not UTF-8
        raise Malformed(f"not msgpack ({type(exc).__name__}: {str(exc)[:120]})") from None


def decode_hello(payload: bytes | bytearray | memoryview) -> Hello:
    return _decode(_hello, payload)


def decode_segment_request(payload: bytes | bytearray | memoryview) -> RegisterSegment | ReleaseSegment:
    return _decode(_segment_request, payload)


def accepted(result: msgspec.Struct) -> bytes:
    """The payload of an answer that says yes."""
    return encode((0, 0, result))


def refusal(error: GpuBrokerError) -> bytes:
    """The payload of an answer that says no, and why."""
    return encode((0, 1, error.as_wire()))


def open_answer(payload: bytes | bytearray | memoryview, kind: type[T]) -> T:
    """The result of an answer, of type ``kind``; its error raised as the GpuBrokerError it names, and Malformed
    for anything else."""
    _, status, result = _decode(_answer, payload)
    if status == 0:
        decoder = _results.get(kind)
        if decoder is None:
            decoder = _results[kind] = msgspec.msgpack.Decoder(kind)
        result_of_kind: T = _decode(decoder, result)
        return result_of_kind
    if status != 1:
        raise Malformed(f"an answer with status {status}")
    error: WireError = _decode(_error, result)
    raise error_from_wire(error)
