"""The client's gRPC channel: channels, auth metadata, keepalive, and gRPC errors into GpuBrokerError."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import grpc
import msgspec

from gpubroker.client._tls import TlsOptions
from gpubroker.wire.addresses import unix_path
from gpubroker.wire.errors import (
    ERROR_BUDGET_HEADER,
    ERROR_TRAILER,
    GpuBrokerError,
    WireError,
    decode_wire_error,
    error_from_wire,
)

__all__ = ["KEEPALIVE_OPTIONS", "make_channel", "translate_rpc_error", "translated"]

T = TypeVar("T")
# While calls are in flight the client pings the broker after 30 s without traffic and fails them when no answer
# comes within 10 s: a call waiting on a long kernel, or a command stream (which has no deadline), ends with
# UNAVAILABLE when the broker's host vanished instead of hanging. The broker allows pings this often.
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000), ("grpc.http2.ping_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0), ("grpc.http2.max_pings_without_data", 0))
# The error trailers this client accepts (gRPC's limit on received metadata raised to it, and the broker told so in
# each call's metadata): an error's details arrive whole, a compile log of up to 256 KiB among them (a client that
# says nothing gets them cut to gRPC's default 8 KiB).
ERROR_BUDGET = 512 * 1024
_ERROR_BUDGET_METADATA = ((ERROR_BUDGET_HEADER, str(ERROR_BUDGET)),)


def make_channel(target: str, token: str | None,
                 tls: TlsOptions | None = None) -> tuple[grpc.Channel, tuple[tuple[str, str], ...]]:
    """A channel to ``unix:/path`` or ``host:port``, and the metadata each call must add.

    Unix sockets and loopback TCP use gRPC local credentials, which let the bearer token travel as call
    credentials; ``tls`` selects TLS (optionally with a client certificate) or, with ``insecure``, plaintext.
    The client sends any size; the broker enforces its own limit.
    """
    options: list[tuple[str, Any]] = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                                      ("grpc.max_metadata_size", ERROR_BUDGET + 16 * 1024),
                                      ("grpc.absolute_max_metadata_size", ERROR_BUDGET + 16 * 1024),
                                      *KEEPALIVE_OPTIONS]
    unix = unix_path(target) is not None
    if tls is not None and tls.insecure and not unix:
        # gRPC refuses call credentials on an insecure channel, so the token rides as plain metadata.
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        return grpc.insecure_channel(target, options=options), metadata + _ERROR_BUDGET_METADATA
    if tls is not None and not unix:  # a Unix socket is local: tls does not apply to it
        root, key, cert = tls.materials()
        creds = grpc.ssl_channel_credentials(root, key, cert)
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
    else:
        kind = grpc.LocalConnectionType.UDS if unix else grpc.LocalConnectionType.LOCAL_TCP
        creds = grpc.local_channel_credentials(kind)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(target, creds, options=options), _ERROR_BUDGET_METADATA


def translate_rpc_error(err: grpc.RpcError) -> GpuBrokerError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = (err.details() if hasattr(err, "details") else None) or str(err)
    type_name = ""
    details: dict[str, Any] = {}
    # Pairs at run time (grpc's _Metadatum is a namedtuple); the stubs declare a class that is not iterable.
    trailers = cast("Sequence[tuple[str, Any]] | None",
                    err.trailing_metadata() if hasattr(err, "trailing_metadata") else None)
    for key, value in trailers or ():
        if key == ERROR_TRAILER and isinstance(value, bytes):
            try:
                extra = decode_wire_error(value)
                type_name, details = extra.type, extra.details
            except msgspec.DecodeError:
                pass  # (the status alone, then)
    if not type_name and code == grpc.StatusCode.UNAVAILABLE:  # (gRPC's own words, no broker answered)
        message = _connection_hint(message)
    return error_from_wire(WireError(code.name, message, type_name, details))


# gRPC's words for a connection that never came to be, and what the user does about each (the gRPC text is kept
# after the hint, for a search). A closed or reset connection means a TLS handshake refused only where there is one:
# on a Unix socket (gRPC names the address unix:...) nothing is negotiated, and the broker closes a connection there
# only when it refuses it (over one of its connection caps, which its audit log names) or stops.
_CONNECTION_HINTS = (
    ("No such file or directory", "no broker is listening there (the socket file does not exist): start one "
                                  "(`gpubroker serve --config FILE`) or check the target (--target, GPUBROKER_TARGET)"),
    ("Connection refused", "nothing accepts connections at that address: is the broker running, and is this its "
                           "address and port?"),
    ("errors resolving", "the target is no host name that resolves: a broker's Unix socket is written "
                         "unix:/PATH, a TCP one HOST:PORT"),
    ("neither UDS or TCP loopback", "a broker on another host is reached over TLS only: connect(target, "
                                    "tls=TlsOptions(ca_file=...)) (plaintext is for Unix sockets and loopback)"),
)
_CLOSED = ("Socket closed", "Connection reset by peer", "Broken pipe")
_CLOSED_UNIX_HINT = ("the broker closed the connection: it refuses a connection over its caps (its audit log says "
                     "which: connections per peer, per tenant, or their rate), or it is stopping; try again, and "
                     "if it goes on, ask the operator")
_CLOSED_TLS_HINT = ("the broker closed the connection as it was made: over TLS it may require a client certificate "
                    "(TlsOptions(cert_file=..., key_file=...)) or not trust this one, or this client may not trust "
                    "the broker's (TlsOptions(ca_file=...)); else it refused the connection over its caps or stopped")


def _connection_hint(message: str) -> str:
    for words, hint in _CONNECTION_HINTS:
        if words in message:
            return f"{hint} ({message})"
    if any(words in message for words in _CLOSED):
        return f"{_CLOSED_UNIX_HINT if 'unix:' in message else _CLOSED_TLS_HINT} ({message})"
    return message


def translated(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return call(*args, **kwargs)
    except grpc.RpcError as err:
        raise translate_rpc_error(err) from None
