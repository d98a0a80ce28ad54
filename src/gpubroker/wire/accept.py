"""The front and its acceptor process: typed messages on a Unix SOCK_SEQPACKET socketpair.

The front's raw listeners accept in a process of their own (``broker/front/_acceptor.py``), so that a peer
connecting and closing in a loop costs the front's event loop nothing: the acceptor names each peer, applies the
per-peer connection rate, closes what it refuses and counts it, and hands the front only what it admits. Each
message is one packet (its boundaries kept by the socket), a msgspec Struct tagged like the link's segment
requests, with at most one descriptor attached (SCM_RIGHTS):

- front -> acceptor, ``ToAcceptor``: ``Listen`` (the listening socket attached: accept on it, as listener
  ``listener``), ``Unlisten`` (stop and close it), ``Pause`` (the front is out of descriptors: accept nothing on
  it for ``seconds``);
- acceptor -> front, ``FromAcceptor``: ``Started`` (first: it is ready to accept), ``Admitted`` (the accepted
  connection attached), ``Refused`` (connections closed for their peer's connection rate since the last report),
  ``AcceptFailed`` (accept() failed: paused, or stopped for good).

The front checks what it can itself (that the descriptor is a stream socket accepted on that listener, the peer's
credentials and address): it takes from the acceptor only the owner of a local TCP peer's socket, which the
acceptor looked up as it accepted the connection (the peer's socket may be gone by the time the front could).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from gpubroker.wire import encoding

__all__ = ["MAX_ACCEPT_MESSAGE", "MAX_REFUSED_PEERS", "AcceptFailed", "Admitted", "FromAcceptor", "Listen", "Pause",
           "Refused", "Started", "ToAcceptor", "Unlisten", "decode_from_acceptor", "decode_to_acceptor", "encode"]

# A message is a few dozen bytes; a report of refusals at most MAX_REFUSED_PEERS keys of a few dozen each.
MAX_ACCEPT_MESSAGE: Final = 16 * 1024
MAX_REFUSED_PEERS: Final = 32  # peers a refusal report names (its counts cover every peer)

ListenerId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Kind = Annotated[str, msgspec.Meta(max_length=32)]
PeerKey = Annotated[str, msgspec.Meta(max_length=128)]


class _ToAcceptor(msgspec.Struct, array_like=True, tag_field="op", frozen=True):
    pass


class Listen(_ToAcceptor, tag="listen", frozen=True):
    """Accept on the listening socket attached, as ``listener``; ``kind``: its listener family (audit lines)."""

    listener: ListenerId
    kind: Kind


class Unlisten(_ToAcceptor, tag="unlisten", frozen=True):
    """Stop accepting on ``listener`` and close it (connections accepted and not yet handed over are closed)."""

    listener: ListenerId


class Pause(_ToAcceptor, tag="pause", frozen=True):
    """The front ran out of descriptors serving ``listener``: accept nothing on it for ``seconds``."""

    listener: ListenerId
    seconds: Annotated[float, msgspec.Meta(ge=0.0, le=60.0)]


ToAcceptor = Listen | Unlisten | Pause


class _FromAcceptor(msgspec.Struct, array_like=True, tag_field="op", frozen=True):
    pass


class Started(_FromAcceptor, tag="started", frozen=True):
    """The acceptor's first message: it runs (at its priority, dying with the front) and takes listeners."""

    pid: int


class Admitted(_FromAcceptor, tag="admitted", frozen=True):
    """A connection accepted on ``listener`` within its peer's rate (attached). ``owner``: the uid owning the
    socket of a TCP peer on this host, as the acceptor found it when it accepted the connection (-1: unknown, or
    not a local TCP peer)."""

    listener: ListenerId
    owner: int = -1


class Refused(_FromAcceptor, tag="refused", frozen=True):
    """Connections closed at accept for their peer's connection rate since the last report: (listener, count)
    for each listener, and (listener, peer key, count) for at most MAX_REFUSED_PEERS peers (for audit lines)."""

    counts: Annotated[tuple[tuple[ListenerId, Count], ...], msgspec.Meta(max_length=1024)]
    peers: Annotated[tuple[tuple[ListenerId, PeerKey, Count], ...], msgspec.Meta(max_length=MAX_REFUSED_PEERS)]


class AcceptFailed(_FromAcceptor, tag="failed", frozen=True):
    """accept() on ``listener`` failed with ``errno`` (``reason``: its text): paused for ``paused`` seconds (out of
    descriptors or memory), or, with ``paused`` 0, no longer accepting on it."""

    listener: ListenerId
    errno: int
    reason: Annotated[str, msgspec.Meta(max_length=256)]
    paused: Annotated[float, msgspec.Meta(ge=0.0, le=60.0)] = 0.0


FromAcceptor = Started | Admitted | Refused | AcceptFailed

# (wire/encoding.py's, not commands.py's name for it: the acceptor process imports no numpy)
encode: Final = encoding.encode


_to_acceptor: msgspec.msgpack.Decoder[Listen | Unlisten | Pause] = msgspec.msgpack.Decoder(ToAcceptor)
_from_acceptor: msgspec.msgpack.Decoder[Started | Admitted | Refused | AcceptFailed] = msgspec.msgpack.Decoder(
    FromAcceptor)


def decode_to_acceptor(payload: bytes) -> Listen | Unlisten | Pause:
    """A message of the front (msgspec's errors raised as they are: the acceptor exits on one, a bug)."""
    return _to_acceptor.decode(payload)


def decode_from_acceptor(payload: bytes) -> Started | Admitted | Refused | AcceptFailed:
    """A message of the acceptor; raises ValueError (msgspec's DecodeError or ValidationError) on any other bytes."""
    return _from_acceptor.decode(payload)
