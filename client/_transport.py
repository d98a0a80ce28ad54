"""The client's transport boundary: channels, auth metadata, and gRPC errors into GpuBrokerError."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import msgpack

from ._errors import GpuBrokerError, error_from_wire

__all__ = ["ERROR_TRAILER", "make_channel", "translate_rpc_error", "translated"]

ERROR_TRAILER = "gpubroker-error-bin"
T = TypeVar("T")


def make_channel(target: str, token: str | None) -> tuple[grpc.Channel, tuple[tuple[str, str], ...]]:
    """A channel to ``unix:/path`` or ``host:port``, and the metadata each call must add.

    Unix sockets and loopback TCP use gRPC local credentials, which let the bearer token travel as call
    credentials. The client sends any size; the broker enforces its own limit.
    """
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    kind = grpc.LocalConnectionType.UDS if target.startswith("unix:") else grpc.LocalConnectionType.LOCAL_TCP
    creds = grpc.local_channel_credentials(kind)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(target, creds, options=options), ()


def translate_rpc_error(err: grpc.RpcError) -> GpuBrokerError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = (err.details() if hasattr(err, "details") else None) or str(err)
    type_name: str | None = None
    details: dict[str, Any] = {}
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == ERROR_TRAILER:
            try:
                extra = msgpack.unpackb(value, raw=False)
                type_name, details = extra.get("type"), extra.get("details") or {}
            except (ValueError, msgpack.UnpackException):
                pass
    return error_from_wire(code.name, message, type_name, details)


def translated(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return call(*args, **kwargs)
    except grpc.RpcError as err:
        raise translate_rpc_error(err) from None


def translated_iter(iterator: Iterator[T]) -> Iterator[T]:
    try:
        yield from iterator
    except grpc.RpcError as err:
        raise translate_rpc_error(err) from None
