"""The front and its TLS relay processes: typed messages on a Unix SOCK_SEQPACKET socketpair.

A TCP link over TLS is decrypted and encrypted in a process of the front's own (``broker/front/_tls_relays.py``),
not in a thread of the front: OpenSSL takes a TLS record (16 KiB) a call, and every call lets go of the GIL and
takes it again, so the relays of one process serialise on its interpreter whatever their count (measured on an
H200 host: 1.2-1.6 GB/s for 1 to 8 relay threads in one process, 4.8 GB/s for 4 relay processes). Each message is
one packet (its boundaries kept by the socket), a msgspec Struct tagged like the acceptor's messages
(``wire/accept.py``), with at most one descriptor attached (SCM_RIGHTS):

- front -> relay process: ``Serve`` (the TLS certificate, key and client CA to serve with: not on the socketpair,
  whose packets are small, but in a memfd the process is started with); then ``ToRelay``: ``Relay`` (a
  connection attached: do its handshake and read its hello, as link ``link``), ``Abort`` (its hello's deadline
  passed, or it was evicted: shut it), ``Verdict`` (write ``frames``; then relay to the worker's socket
  attached, or close);
- relay process -> front, ``FromRelay``: ``Ready`` (it serves), ``Progressed`` (a link's handshake began, or is
  done or its hello's first byte came), ``HelloRead`` (the hello's frame and the client certificate's names),
  ``HelloFailed`` (why there is no hello), ``Ended`` (the link's relay is over: its place in the counts is free).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from gpubroker.wire import encoding

__all__ = ["MAX_NAME", "MAX_NAMES", "MAX_RELAYED_HELLO", "MAX_RELAY_MESSAGE", "Abort", "Ended", "FromRelay",
           "HelloFailed", "HelloRead", "Progressed", "Ready", "Relay", "Serve", "ToRelay", "Verdict",
           "decode_from_relay", "decode_serve", "decode_to_relay", "encode"]

# The largest hello_max_bytes a relay process reads for the front (a larger one is read by a thread of the front),
# and the largest message: such a hello with room for its envelope. A packet must fit in the socket's send buffer
# (wmem_max, 208 KiB by default, doubled by the kernel).
MAX_RELAYED_HELLO: Final = 128 * 1024
# A client certificate's names a hello carries at most, and their length (a certificate past them is refused).
MAX_NAMES: Final = 64
MAX_NAME: Final = 1024
MAX_RELAY_MESSAGE: Final = MAX_RELAYED_HELLO + MAX_NAMES * MAX_NAME + 16 * 1024

LinkId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]
Pem = Annotated[bytes, msgspec.Meta(max_length=64 << 20)]
Why = Annotated[str, msgspec.Meta(max_length=512)]
# How a hello failed, each the front's exception of that name (_tcp_relay.py): "handshake" HandshakeFailed,
# "cut-short" HelloCutShort, "timeout" TimeoutError, "closed" EOFError, "error" OSError (a reset, a TLS error).
Failure = Literal["handshake", "cut-short", "timeout", "closed", "error"]


class Serve(msgspec.Struct, array_like=True, frozen=True):
    """What a relay process serves TLS with (the memfd it starts with): this certificate chain and key (PEM); with
    ``client_ca``, a client certificate it issued is required (mTLS)."""

    cert: Pem
    key: Pem
    client_ca: Pem | None = None


class _ToRelay(msgspec.Struct, array_like=True, tag_field="op", frozen=True):
    pass


class Relay(_ToRelay, tag="relay", frozen=True):
    """The connection attached is link ``link``: its TLS handshake and its hello's frame (at most ``hello_limit``
    bytes of body; a longer one's header only), within ``timeout`` seconds."""

    link: LinkId
    hello_limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_RELAYED_HELLO)]
    timeout: Annotated[float, msgspec.Meta(gt=0.0)]


class Abort(_ToRelay, tag="abort", frozen=True):
    """Link ``link``'s hello is too late, or its connection was evicted: shut it (the front audited why)."""

    link: LinkId


class Verdict(_ToRelay, tag="verdict", frozen=True):
    """What link ``link`` does after its hello: write ``frames`` (the front's answers), then relay between the
    connection and the worker's socket attached (tenant ``tenant``'s link), or (none attached) close it."""

    link: LinkId
    frames: Annotated[tuple[bytes, ...], msgspec.Meta(max_length=16)]
    tenant: Annotated[str, msgspec.Meta(max_length=1024)] = ""  # whose link (its relay polls within the tenant's share)


ToRelay = Relay | Abort | Verdict


class _FromRelay(msgspec.Struct, array_like=True, tag_field="op", frozen=True):
    pass


class Ready(_FromRelay, tag="ready", frozen=True):
    """The relay process's first message: it has its TLS context and takes links."""

    pid: int


class Progressed(_FromRelay, tag="progressed", frozen=True):
    """Link ``link``'s handshake has begun (``progressed`` false: its first bytes came, so it is no idle
    connection), or is done or a byte of its hello came (``progressed`` true: a late hello is audited as such)."""

    link: LinkId
    progressed: bool


class HelloRead(_FromRelay, tag="hello", frozen=True):
    """Link ``link``'s hello: its frame (header and body; only the header of one longer than the limit), and its
    verified client certificate's names (gRPC's order: SAN URIs, then the CN) and notBefore (none without one)."""

    link: LinkId
    frame: Annotated[bytes, msgspec.Meta(max_length=MAX_RELAYED_HELLO + 4)]
    names: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=MAX_NAME)], ...],
                     msgspec.Meta(max_length=MAX_NAMES)] = ()
    issued: float | None = None


class HelloFailed(_FromRelay, tag="failed", frozen=True):
    """Link ``link`` has no hello: ``failure`` says how (the relay process closed it), ``why`` in fixed words."""

    link: LinkId
    failure: Failure
    why: Why


class Ended(_FromRelay, tag="ended", frozen=True):
    """Link ``link``'s relay is over (the worker's end or the client's closed, or either failed)."""

    link: LinkId


FromRelay = Ready | Progressed | HelloRead | HelloFailed | Ended

encode: Final = encoding.encode

_serve: msgspec.msgpack.Decoder[Serve] = msgspec.msgpack.Decoder(Serve)
_to_relay: msgspec.msgpack.Decoder[Relay | Abort | Verdict] = msgspec.msgpack.Decoder(ToRelay)
_from_relay: msgspec.msgpack.Decoder[Ready | Progressed | HelloRead | HelloFailed | Ended] = msgspec.msgpack.Decoder(
    FromRelay)


def decode_serve(payload: bytes) -> Serve:
    """The TLS material a relay process starts with."""
    return _serve.decode(payload)


def decode_to_relay(payload: bytes) -> Relay | Abort | Verdict:
    """A message of the front (msgspec's errors raised as they are: the relay process exits on one, a bug)."""
    return _to_relay.decode(payload)


def decode_from_relay(payload: bytes) -> Ready | Progressed | HelloRead | HelloFailed | Ended:
    """A message of a relay process; raises ValueError (msgspec's DecodeError or ValidationError) on any other
    bytes."""
    return _from_relay.decode(payload)
